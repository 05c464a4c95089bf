"""Lab 9, silent data corruption: one rank's arithmetic goes wrong without any error (a planted bit flip in one
gradient element), and two checks that data-parallel replicas allow find it.

A flip *after* the gradient all-reduce corrupts one replica only: its parameters leave the others', and the
cross-rank parameter checksum (:func:`scalebook.labs.checks.rank_checksums`) differs from that step on. A flip
*before* the all-reduce is averaged into every replica's gradient: all replicas take the same wrong step and
the checksums agree. Recomputing the step finds both: every rank restores its state from before the step,
computes its local gradient and the all-reduce again, and compares fingerprints with what it used; a
transient fault does not repeat, so the rank whose own local gradient (or, if none, whose reduced gradient)
changes is the faulty one.

Source: Dixit et al. 2021, "Silent Data Corruptions at Scale" (Meta); Hochschild et al. 2021, "Cores that
don't count" (Google); Grattafiori et al. 2024, "The Llama 3 Herd of Models", Sec. 3.3.4 (interruptions of the
405B run, silent data corruption among them).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from scalebook.data import corpus_tokens, get_batch
from scalebook.labs.checks import check_variants, checksum, rank_checksums, spread
from scalebook.model import GPT, GPTConfig

# A small, fast GPT (two layers of width 64): the lab is about the checks, not the model.
SDC_CONFIG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)
SDC_VARIANTS = (
    "broken: bit flip after the all-reduce",
    "broken: bit flip before the all-reduce",
    "fixed: no fault",
)


def flip_bit(tensor: torch.Tensor, index: int, bit: int) -> tuple[float, float]:
    """Flip bit ``bit`` (0: lowest mantissa bit, 23-30: exponent, 31: sign) of the float32 element ``index`` of
    ``tensor`` (flattened), in place, as a faulty ALU or memory cell would; returns (old, new) values."""
    if tensor.dtype != torch.float32 or not tensor.is_contiguous():
        raise ValueError(f"flip_bit needs a contiguous float32 tensor, got {tensor.dtype}")
    if not 0 <= bit <= 31 or not 0 <= index < tensor.numel():
        raise ValueError(f"bit must be in 0..31 and index in 0..{tensor.numel() - 1}, got bit {bit}, index {index}")
    words = tensor.view(-1).view(torch.int32)
    old = tensor.view(-1)[index].item()
    words[index] ^= ((1 << bit) ^ 0x80000000) - 0x80000000  # the mask as a signed 32-bit integer
    return old, tensor.view(-1)[index].item()


def _local_and_reduced_gradients(model, x, y, flip=None) -> tuple[float, float, float, tuple | None]:
    """Backward on this rank's batch, then the average over ranks. ``flip`` = (``"before"`` or ``"after"`` the
    all-reduce, parameter, index, bit) plants a fault in that parameter's gradient. Returns the loss, the
    fingerprints of the local and of the reduced gradient, and the flipped value (old, new) or None."""
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    flipped = None
    if flip and flip[0] == "before":
        flipped = flip_bit(flip[1].grad, *flip[2:])
    local = checksum(grads)
    world = dist.get_world_size()
    for g in grads:
        dist.all_reduce(g)
        g /= world
    if flip and flip[0] == "after":
        flipped = flip_bit(flip[1].grad, *flip[2:])
    return loss.item(), local, checksum(grads), flipped


def sdc_lab(
    variants=SDC_VARIANTS,
    *,
    steps: int = 4,
    faulty_rank: int = 1,
    faulty_step: int = 2,
    parameter: str = "blocks.0.mlp.c_fc.weight",
    index: int = 0,
    bit: int = 23,
    batch_size: int = 4,
    seq_len: int = 32,
    seed: int = 0,
) -> dict:
    """Worker: data-parallel AdamW replicas (gradients averaged by one all-reduce per tensor) in which
    ``faulty_rank`` flips bit ``bit`` of element ``index`` of ``parameter``'s gradient at ``faulty_step``.

    Per variant and step: ``losses`` (mean over ranks), the parameter ``checksums`` of every rank after the
    step, and ``recomputed``: for every rank, whether its recomputed local and reduced gradients differ from
    the ones it used. ``checksum_step`` is the first step whose checksums differ (None: never), and
    ``blamed`` the (rank, step) pairs that recomputation names. ``flip`` holds the flipped value (old, new).
    """
    variants = check_variants(variants, SDC_VARIANTS)
    rank, world = dist.get_rank(), dist.get_world_size()
    if not 0 <= faulty_rank < world:
        raise ValueError(f"faulty_rank must be one of the {world} ranks, got {faulty_rank}")
    out = {}
    for variant in variants:
        torch.manual_seed(seed)
        model = GPT(SDC_CONFIG)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        target = dict(model.named_parameters())[parameter]
        generator = torch.Generator().manual_seed(seed)
        losses, checksums, recomputed, flipped = [], [], [], None
        for step in range(steps):
            x, y = get_batch(corpus_tokens(), batch_size, seq_len, generator, rank=rank, world_size=world)
            before = copy.deepcopy(model.state_dict())
            flip = None
            if variant.startswith("broken") and rank == faulty_rank and step == faulty_step:
                flip = ("after" if "after" in variant else "before", target, index, bit)
            loss, local, reduced, flipped_now = _local_and_reduced_gradients(model, x, y, flip)
            flipped = flipped_now or flipped
            optimizer.step()
            checksums.append(rank_checksums(model.parameters()))
            # Recompute the step from the saved state: a healthy rank reproduces its fingerprints bit for bit.
            after = copy.deepcopy(model.state_dict())
            model.load_state_dict(before)
            _, local_again, reduced_again, _ = _local_and_reduced_gradients(model, x, y)
            model.load_state_dict(after)  # the optimizer's state is untouched: recomputation takes no step
            mine = torch.tensor([float(local_again != local), float(reduced_again != reduced), loss])
            everyone = [torch.empty(3) for _ in range(world)]
            dist.all_gather(everyone, mine)
            recomputed.append([(bool(t[0]), bool(t[1])) for t in everyone])
            losses.append(sum(t[2].item() for t in everyone) / world)
        out[variant] = {
            "losses": losses,
            "checksums": checksums,
            "recomputed": recomputed,
            "checksum_step": next((s for s, c in enumerate(checksums) if spread(c) > 0), None),
            "blamed": blame(recomputed),
            "flip": flipped,
        }
    return out


def blame(recomputed: list[list[tuple[bool, bool]]]) -> list[tuple[int, int]]:
    """The (rank, step) pairs that recomputation names: per step, the ranks whose recomputed *local* gradient
    differs; if none does, the ranks whose *reduced* gradient differs (a fault after the all-reduce). A
    fault before the all-reduce changes every rank's reduced gradient, but only the faulty rank's local one.
    """
    named = []
    for step, ranks in enumerate(recomputed):
        local = [r for r, (loc, _) in enumerate(ranks) if loc]
        named += [(r, step) for r in (local or [r for r, (_, red) in enumerate(ranks) if red])]
    return named
