"""Chapter 14's context-parallel experiments: ring attention and Ulysses on ranks against one-rank attention.

:func:`compare_ring_attention` runs :func:`scalebook.parallel.context.ring_attention` on every rank of the
default group against :func:`~scalebook.parallel.context.causal_attention` on the whole sequence, counting
bytes sent, bytes saved for backward and the half-chunk pairs every rank computes; :func:`compare_ulysses`
does the same for :func:`scalebook.parallel.ulysses.ulysses_attention`; :func:`ring_variants` measures the
naive ring against the one that skips masked pairs and overlaps its transfers (pairs, FLOPs counted by
``FlopCounterMode``, and each rank's CPU seconds of computing, the variants timed in turn, round after round);
:func:`context_parallel_study` launches all three for several context-parallel
sizes; :func:`gpt_context_parallel_errors` trains the GPT one step with ring attention or Ulysses against
one process.

Source: Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context";
Jacobs et al. 2023, "DeepSpeed Ulysses"; Tazi et al. 2025, "The Ultra-Scale Playbook", "Context parallelism".
"""

from __future__ import annotations

import copy
import os
import time

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from scalebook import accounting, configs, measure
from scalebook.comm import count_traffic, launch
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.context import (
    SPLITS,
    apply_context_parallel,
    causal_attention,
    context_parallel_batch,
    ring_attention,
    shard_sequence,
    unmasked_scores,
    unshard_sequence,
    validate_context_parallel,
)
from scalebook.parallel.ulysses import apply_ulysses, ulysses_attention

__all__ = [
    "RING_VARIANTS",
    "compare_ring_attention",
    "compare_ulysses",
    "context_parallel_study",
    "gpt_context_parallel_errors",
    "ring_variants",
    "ring_vs_ulysses_rows",
    "variant_name",
]

# (split, skip_masked, overlap): the naive ring computes every pair and waits for each transfer at once.
RING_VARIANTS = tuple((split, skip, overlap) for split in SPLITS for skip, overlap in
                      ((False, False), (True, False), (True, True)))  # fmt: skip


def variant_name(variant: tuple[str, bool, bool], sep: str = ", ") -> str:
    """``("zigzag", True, True)`` -> ``"zig-zag, skip + overlap"``; ``"naive"`` for neither saving."""
    split, skip, overlap = variant
    saving = {(False, False): "naive", (True, False): "skip", (True, True): "skip + overlap"}[skip, overlap]
    return f"{'zig-zag' if split == 'zigzag' else split}{sep}{saving}"


def compare_ring_attention(
    *,
    batch: int = 2,
    heads: int = 4,
    seq_len: int = 64,
    head_dim: int = 16,
    splits: tuple[str, ...] = SPLITS,
    seed: int = 0,
) -> dict[str, dict]:
    """On every rank of the default group (run it with :func:`scalebook.comm.launch`): ring attention
    against :func:`~scalebook.parallel.context.causal_attention` on the whole sequence, for each split in ``splits``.

    Every rank draws the same Q, K, V and output gradient, computes the one-rank reference and ring
    attention on its own shard, gathers the shards and reports, per split, the largest deviations of the
    output and of the Q, K, V gradients, the calls and bytes this rank sent in the forward and backward
    passes, the bytes saved for backward (ring and reference), the half-chunk pairs every rank computed
    and skipped (counted while it ran, gathered from all ranks) and the unmasked scores of every rank.
    """
    rank, cp = dist.get_rank(), dist.get_world_size()
    for split in splits:
        validate_context_parallel(seq_len, cp, split)
    gen = torch.Generator().manual_seed(seed)
    q, k, v, grad_out = (torch.randn(batch, heads, seq_len, head_dim, generator=gen) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = causal_attention(*full)
    reference.backward(grad_out)
    full_saved = measure.saved_by_call(causal_attention, *full).total
    results = {}
    for split in splits:
        mine = [shard_sequence(t, cp, rank, split=split).requires_grad_() for t in (q, k, v)]
        work = {}
        with count_traffic() as forward:
            out = ring_attention(*mine, split=split, work=work)
        with count_traffic() as backward:
            out.backward(shard_sequence(grad_out, cp, rank, split=split))
        ring_saved = measure.saved_by_call(lambda *t, split=split: ring_attention(*t, split=split), *mine).total
        every_rank = [None] * cp
        dist.all_gather_object(every_rank, work)
        errors = {"output": (_gathered(out, split) - reference).abs().max().item()}
        for name, local, ref in zip(("grad_q", "grad_k", "grad_v"), mine, full, strict=True):
            errors[name] = (_gathered(local.grad, split) - ref.grad).abs().max().item()
        results[split] = {
            "errors": errors,
            "forward": {op: (n, float(sent)) for op, (n, sent) in forward.by_op().items()},
            "backward": {op: (n, float(sent)) for op, (n, sent) in backward.by_op().items()},
            "ring_saved_bytes": ring_saved,
            "full_saved_bytes": full_saved,
            "half_blocks": every_rank,
            "unmasked_scores": unmasked_scores(seq_len, cp, split),
        }
    return results


def _gathered(t: torch.Tensor, split: str) -> torch.Tensor:
    """Every rank's tokens of ``t`` (b, heads, s/c, d), gathered and put back in sequence order."""
    pieces = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, t.detach().contiguous())
    return unshard_sequence(pieces, split=split)


def compare_ulysses(
    *, batch: int = 2, heads: int = 4, kv_heads: int | None = None, seq_len: int = 64, head_dim: int = 16,
    splits: tuple[str, ...] = SPLITS, seed: int = 0,
) -> dict[str, dict]:  # fmt: skip
    """On every rank of the default group (run it with :func:`scalebook.comm.launch`): Ulysses attention
    against :func:`~scalebook.parallel.context.causal_attention` on the whole sequence (K and V repeated over
    each group of query heads when ``kv_heads`` < ``heads``), for each split in ``splits``. Reports, per
    split, the largest deviations of the output and of the Q, K, V gradients, the calls and bytes this
    rank sent in the forward and backward passes, and the head counts."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    kv_heads = kv_heads or heads
    gen = torch.Generator().manual_seed(seed)
    q, grad_out = (torch.randn(batch, heads, seq_len, head_dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, seq_len, head_dim, generator=gen) for _ in range(2))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    group_size = heads // kv_heads
    causal_attention(full[0], *(t.repeat_interleave(group_size, dim=1) for t in full[1:])).backward(grad_out)
    reference = causal_attention(q, k.repeat_interleave(group_size, dim=1), v.repeat_interleave(group_size, dim=1))
    results = {}
    for split in splits:
        mine = [shard_sequence(t, cp, rank, split=split).requires_grad_() for t in (q, k, v)]
        with count_traffic() as forward:
            out = ulysses_attention(*mine, split=split)
        with count_traffic() as backward:
            out.backward(shard_sequence(grad_out, cp, rank, split=split))
        errors = {"output": (_gathered(out, split) - reference).abs().max().item()}
        for name, local, ref in zip(("grad_q", "grad_k", "grad_v"), mine, full, strict=True):
            errors[name] = (_gathered(local.grad, split) - ref.grad).abs().max().item()
        results[split] = {
            "errors": errors,
            "forward": {op: (n, float(sent)) for op, (n, sent) in forward.by_op().items()},
            "backward": {op: (n, float(sent)) for op, (n, sent) in backward.by_op().items()},
            "heads": heads,
            "kv_heads": kv_heads,
        }
    return results


def _ring_pass(q, k, v, grad_out, split: str, skip: bool, overlap: bool) -> tuple[torch.Tensor, dict, dict]:
    """One forward and backward pass of ring attention: (this rank's output, pairs and seconds, matmul FLOPs
    per pass counted by ``FlopCounterMode``)."""
    mine = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    work = {}
    with FlopCounterMode(display=False) as forward:
        out = ring_attention(*mine, split=split, work=work, skip_masked=skip, overlap=overlap)
    with FlopCounterMode(display=False) as backward:
        out.backward(grad_out)
    return out, work, {"forward": forward.get_total_flops(), "backward": backward.get_total_flops()}


def ring_variants(
    *, batch: int = 2, heads: int = 4, seq_len: int = 64, head_dim: int = 16, variants=RING_VARIANTS,
    timed_seq_len: int | None = None, timed_head_dim: int | None = None, rounds: int = 5, seed: int = 0,
    counted: bool = True,
) -> dict[tuple[str, bool, bool], dict]:  # fmt: skip
    """On every rank of the default group: each ``(split, skip_masked, overlap)`` variant of ring attention,
    its output against one-rank attention (``"error"``), the half-chunk pairs every rank computed and the
    matmul FLOPs it ran (``FlopCounterMode``, forward and backward; ``"per_rank"``), unless ``counted`` is
    False (``FlopCounterMode``'s first use costs a second or two of CPU per rank). With ``timed_seq_len``,
    also every rank's seconds at that length, with heads ``timed_head_dim`` wide (default ``head_dim``;
    machine-dependent; ``"seconds"``: per rank, the CPU seconds of computing the forward and the backward pass
    and the rest of the wall clock, the variants timed in turn, each rank's best of ``rounds``) and the load
    average of the machine when the timing ended (``"load"``)."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    q, k, v, grad_out = (torch.randn(batch, heads, seq_len, head_dim, generator=gen) for _ in range(4))
    reference = causal_attention(q, k, v)
    results = {variant: {} for variant in variants}
    for split, skip, overlap in variants if counted else ():
        local = [shard_sequence(t, cp, rank, split=split) for t in (q, k, v, grad_out)]
        out, work, flops = _ring_pass(*local, split, skip, overlap)
        every_rank = [None] * cp
        dist.all_gather_object(every_rank, {"pairs": {p: work[p] for p in ("forward", "backward")}, "flops": flops})
        results[split, skip, overlap].update(error=(_gathered(out, split) - reference).abs().max().item(),
                                             per_rank=every_rank)  # fmt: skip
    if timed_seq_len:
        timed = [torch.randn(batch, heads, timed_seq_len // cp, timed_head_dim or head_dim) for _ in range(4)]
        timings = _time_ring(timed, variants, rounds=rounds)
        load = os.getloadavg()
        for variant, seconds in timings.items():
            results[variant].update(seconds=seconds, load=load)
    return results


def _time_ring(local: list[torch.Tensor], variants, *, rounds: int) -> dict[tuple[str, bool, bool], list[dict]]:
    """Every rank's CPU seconds of computing one forward and one backward pass of each variant, and the wall
    seconds of the pass: ``{variant: [per rank {"forward", "backward", "wait"}]}``, ``"wait"`` being the rest of
    the wall clock (waiting for a block, for the other rank or for a core).

    The CPU clock is this thread's (``time.thread_time``), on one intra-op thread: it counts what this rank
    computed, the autograd backward included (on CPU it runs on the calling thread), and not the time it
    waited, nor what other processes ran. The variants take turns, round after round, so that a change of
    load falls on all of them; each rank keeps, per variant, its round with the least CPU time.
    """
    best = {}
    with measure.one_thread():
        for _ in range(rounds):
            for split, skip, overlap in variants:
                mine = [t.clone().requires_grad_() for t in local[:3]]
                dist.barrier()  # every rank starts the pass together
                wall, cpu = time.perf_counter(), time.thread_time()
                out = ring_attention(*mine, split=split, skip_masked=skip, overlap=overlap)
                forward = time.thread_time() - cpu
                out.backward(local[3])
                computing = time.thread_time() - cpu
                seconds = {"forward": forward, "backward": computing - forward,
                           "wait": max(0.0, time.perf_counter() - wall - computing)}  # fmt: skip
                kept = best.get((split, skip, overlap))
                if kept is None or computing < kept["forward"] + kept["backward"]:
                    best[split, skip, overlap] = seconds
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, best)
    return {variant: [mine[variant] for mine in every_rank] for variant in variants}


def _study_on_rank(seq_len: int, timed_seq_len: int | None, gqa: bool, variants: bool) -> dict:
    """One launch, every measurement of the chapter's context-parallel section on this rank."""
    cp = dist.get_world_size()
    results = {
        "ring": compare_ring_attention(seq_len=seq_len),
        "ulysses": {"mha": compare_ulysses(seq_len=seq_len, heads=4)},
    }
    if variants:
        # Timed with heads 64 wide: at 16 the elementwise work of a pair (exponentials, the causal mask) outweighs
        # its matmuls on a CPU, and a diagonal pair costs about twice a plain one; at 64 a pair's CPU time is
        # closer to its FLOPs, which are what the ranks' shares of the work are counted in.
        results["variants"] = ring_variants(seq_len=seq_len, timed_seq_len=timed_seq_len, timed_head_dim=64, batch=1)
    if gqa:  # 8 query heads sharing 2 K/V heads: each rank gets 4 query heads and the one K/V head they share
        results["ulysses"]["gqa"] = compare_ulysses(seq_len=seq_len, heads=4 * cp, kv_heads=cp)
    return results


def context_parallel_study(
    cps: tuple[int, ...] = (2, 4), *, seq_len: int = 64, timed: dict[int, int] | None = None,
    gqa: tuple[int, ...] = (2,), variants: tuple[int, ...] = (4,), timeout: float = 300.0,
) -> dict[int, dict]:  # fmt: skip
    """Check every layout, then run, on ``cp`` fresh ranks for each ``cp`` (one launch each): ring attention
    (:func:`compare_ring_attention`), Ulysses with 4 heads and, for ``cp`` in ``gqa``, with grouped-query
    attention (:func:`compare_ulysses`), and for ``cp`` in ``variants`` the ring's variants
    (:func:`ring_variants`): counted, and timed at ``timed[cp]`` tokens (heads 64 wide) where given. Returns rank
    0's results per ``cp``: ``{"ring": {split: ...}, "ulysses": {"mha" | "gqa": {split: ...}}, "variants":
    {(split, skip, overlap): ...}}`` (``"variants"`` only for ``cp`` in ``variants``)."""
    timed = timed or {}
    for cp in cps:
        for split in SPLITS:
            validate_context_parallel(seq_len, cp, split)
            if cp in timed:
                validate_context_parallel(timed[cp], cp, split)
    return {
        cp: launch(_study_on_rank, cp, seq_len, timed.get(cp), cp in gqa, cp in variants, timeout=timeout)[0]
        for cp in cps
    }


def gpt_context_parallel_errors(cp: int, split: str = "zigzag", *, seed: int = 0, method: str = "ring") -> dict:
    """On every rank of the default group (run it with :func:`scalebook.comm.launch`): a small GPT trained one
    step with ring attention (``method="ring"``) or Ulysses (``"ulysses"``) on dp x cp ranks (cp consecutive
    ranks share two sequences, dp = world / cp blocks of them hold different ones) against the same GPT on
    the whole batch in this process. The gradients are averaged
    over all dp x cp ranks and the loss is logged as the mean of the local losses, as
    :mod:`scalebook.parallel.context` prescribes. Returns the deviations of the logged loss and of the
    largest gradient entry, the largest gradient entry, and the shape of this rank's tokens."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // cp
    cp_groups = [dist.new_group(list(range(d * cp, (d + 1) * cp))) for d in range(dp)]  # every rank makes all
    torch.manual_seed(seed)
    heads = 4 if method == "ulysses" else 2  # Ulysses deals whole heads to the ranks: cp must divide them
    reference = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=heads, n_embd=32))
    model = copy.deepcopy(reference)
    gen = torch.Generator().manual_seed(seed + 1)
    idx, targets = (torch.randint(0, 64, (2 * dp, 16), generator=gen) for _ in range(2))
    reference(idx, targets)[1].backward()

    group = cp_groups[rank // cp]
    {"ring": apply_context_parallel, "ulysses": apply_ulysses}[method](model, group, split=split)
    rows = slice(2 * (rank // cp), 2 * (rank // cp + 1))  # this dp rank's two sequences
    mine, my_targets, positions = context_parallel_batch(idx[rows], targets[rows], group, split)
    _, loss = model(mine, my_targets, positions=positions)
    loss.backward()
    for p in model.parameters():  # the data-parallel wrapper's job, over dp x cp: here the whole world
        dist.all_reduce(p.grad.div_(world))
    logged = loss.detach().clone()
    dist.all_reduce(logged.div_(world))
    ref_grads = dict(reference.named_parameters())
    return {
        "loss_error": abs(logged.item() - reference(idx, targets)[1].item()),
        "grad_error": max((p.grad - ref_grads[n].grad).abs().max().item() for n, p in model.named_parameters()),
        "grad_scale": max(p.grad.abs().max().item() for p in reference.parameters()),
        "local_tokens": tuple(mine.shape),
    }


def ring_vs_ulysses_rows(
    models: tuple[str, ...] = ("gpt3-175b", "llama-3-8b", "llama-3.1-405b"), cps: tuple[int, ...] = (8, 16), *,
    seq_len: int = 131072, hardware: str = "h100-sxm", links: tuple[str, ...] = ("nvlink-4", "infiniband-ndr"),
) -> tuple[list[list], list[str]]:  # fmt: skip
    """A table (rows, headers) of ring attention against Ulysses and Llama 3's all-gather of K and V for one
    ``seq_len``-token bf16 sequence of each model on ``cp`` ranks, from :mod:`scalebook.accounting.context`: the
    bytes each rank sends per layer in the forward pass, whether Ulysses can run, and from how many tokens per
    rank the ring hides its transfers behind ``hardware``'s dense bf16 peak on each of ``links`` (a prediction)."""
    peak = configs.get_hardware(hardware).peak_flops["bf16"]
    rows = []
    for name in models:
        cfg = configs.get_model(name)
        shape = dict(batch=1, heads=cfg.n_heads, seq_len=seq_len, head_dim=cfg.d_head, kv_heads=cfg.n_kv_heads)
        hide = [
            accounting.ring_overlap_min_tokens(cfg.n_heads, kv_heads=cfg.n_kv_heads, flops=peak, bandwidth=bandwidth)
            for bandwidth in (configs.get_link(link).bandwidth for link in links)
        ]
        for cp in cps:
            ring = accounting.ring_attention_bytes_per_rank(**shape, cp=cp)["forward"]
            gathered = accounting.kv_allgather_bytes_per_rank(**shape, cp=cp)["forward"]
            if accounting.ulysses_problems(cfg.n_heads, cfg.n_kv_heads, seq_len, cp):
                ulysses, less = f"no: c does not divide n_kv = {cfg.n_kv_heads}", "ring"
            else:
                sent = accounting.ulysses_bytes_per_rank(**shape, cp=cp)["forward"]
                ulysses, less = f"{sent / 1e9:.2f}", "Ulysses" if sent < ring else "ring"
            rows.append([name, f"{cfg.n_heads} / {cfg.n_kv_heads}", cp, f"{ring / 1e9:.2f}", f"{gathered / 1e9:.2f}",
                         ulysses, less, seq_len // cp, *(f"{h:,.0f}" for h in hide)])  # fmt: skip
    headers = ["model", "a / n_kv", "c", "ring GB sent", "all-gather GB sent", "Ulysses GB sent",
               "ring or Ulysses sends less", "tokens per rank s/c",
               *(f"ring hides its transfers from s/c = ({link})" for link in links)]  # fmt: skip
    return rows, headers
