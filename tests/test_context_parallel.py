"""Ring attention on 1, 2 and 4 ranks equals PyTorch's causal ``scaled_dot_product_attention`` over the whole
sequence (outputs and the Q, K, V gradients, each rank's tokens against the same rows of the reference, per
tensor); zig-zag balances the causal work, and the ring really skips the half-chunk pairs that lie entirely in a
query's future (pairs and matmul FLOPs counted as it runs), with or without overlapping its transfers; the naive
ring computes every pair. On the GPT, context parallelism (alone, and beside data parallelism) gives one
process's loss and every gradient, per tensor.

PyTorch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``) is not a
reference here: in torch 2.13 it does not run on CPU. Its ring replaces the CUDA SDPA kernels only; on a 2-rank
gloo launch, ``F.scaled_dot_product_attention(..., is_causal=True)`` inside ``context_parallel(mesh,
buffers=[q, k, v], ...)`` raises ``NotImplementedError: Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered``, and
under ``sdpa_kernel(SDPBackend.MATH)`` ``RuntimeError: aten.add.Tensor got mixed torch.Tensor and DTensor``.
"""

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from scalebook.comm import launch
from scalebook.experiments.context import RING_VARIANTS, compare_ring_attention, ring_variants
from scalebook.model import GPT, GPTConfig
from scalebook.parallel import context, ulysses
from scalebook.parity import max_relative_difference

# Relative to each tensor's largest reference entry (parity.max_relative_difference), per tensor. Float32 sums
# over different block orders differ in the last bits: measured at most 5e-7 (ring outputs and Q, K, V gradients
# against SDPA, GPT gradients against one process, cp = 1, 2, 4), so 1e-5 leaves 20x headroom, while a dropped
# factor (1/sqrt(d) = 0.35 on the scores, 1/cp = 0.5 on a gradient) moves the tensor it touches by 10% or more.
TOLERANCE = 1e-5


def test_reference_attention_equals_torch_sdpa():
    q, k, v = (torch.randn(2, 3, 24, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(context.causal_attention(q, k, v), expected, atol=1e-6)


def test_zigzag_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    # 16 tokens, cp = 4: eight chunks of two; rank 1 holds chunks 1 and 6.
    assert context.token_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    x = torch.arange(16.0).view(1, 16, 1)
    pieces = [context.shard_sequence(x, 4, r, dim=1) for r in range(4)]
    assert torch.equal(context.unshard_sequence(pieces, dim=1), x)


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    # Hand count, s = 8, cp = 2: a query at position i sees i + 1 keys. Contiguous: 1+2+3+4 = 10 and
    # 5+6+7+8 = 26. Zig-zag (chunks {0,3} and {1,2} of two tokens): 1+2+7+8 = 18 and 3+4+5+6 = 18.
    assert context.unmasked_scores(8, 2, "contiguous") == [10, 26]
    assert context.unmasked_scores(8, 2, "zigzag") == [18, 18]


# Half-chunk pairs (query, key) each rank computes, counted by hand. cp = 4 cuts the sequence into 8 chunks.
# Zig-zag rank r holds chunks r and 7 - r: chunk r sees chunks 0..r (r + 1 pairs), chunk 7 - r sees 0..7-r
# (8 - r pairs): 9 on every rank, of 16 met. Contiguous rank r holds chunks 2r and 2r + 1: 3, 7, 11, 15.
# Each query chunk meets its own key chunk once, the causal triangle: 2 diagonal pairs per rank.
HAND_COUNTED = {
    (1, "zigzag"): [3],  # one rank: chunks 0 and 1, pairs (0,0), (1,0), (1,1); (0,1) is in the future
    (1, "contiguous"): [3],
    (2, "zigzag"): [5, 5],
    (2, "contiguous"): [3, 7],
    (4, "zigzag"): [9, 9, 9, 9],
    (4, "contiguous"): [3, 7, 11, 15],
}


def test_half_block_formula_matches_hand_counts():
    for (cp, split), computed in HAND_COUNTED.items():
        expected = [{"full": n - 2, "diagonal": 2, "masked": 0, "skipped": 4 * cp - n} for n in computed]
        assert context.half_blocks_per_rank(cp, split) == expected
        # The naive ring computes the future pairs too, fully masked: 4 cp pairs on every rank.
        naive = [{"full": n - 2, "diagonal": 2, "masked": 4 * cp - n, "skipped": 0} for n in computed]
        assert context.half_blocks_per_rank(cp, split, skip_masked=False) == naive


def test_ring_flops_formula_matches_hand_count():
    # b=1, a=2, s=32, d=8, cp=2: half-chunks of n=8 tokens; one n x n x d matmul per head is 2*8*8*8 = 1024
    # FLOPs, so 2048 for both heads. A pair: 2 such matmuls forward, 5 backward. Zig-zag computes 5 pairs.
    flops = context.ring_attention_flops_per_rank(1, 2, 32, 8, cp=2)
    assert flops == [{"forward": 5 * 2 * 2048, "backward": 5 * 5 * 2048}] * 2
    naive = context.ring_attention_flops_per_rank(1, 2, 32, 8, cp=2, split="contiguous", skip_masked=False)
    assert naive == [{"forward": 8 * 2 * 2048, "backward": 8 * 5 * 2048}] * 2


# Ring attention's inputs: one sequence of 32 tokens, 2 heads of 8 dimensions.
SHAPE = {"batch": 1, "heads": 2, "seq_len": 32, "head_dim": 8}


def rank_positions(seq_len: int, cp: int, rank: int, split: str) -> torch.Tensor:
    """The positions rank ``rank`` holds, written out here rather than taken from ``context.token_positions``:
    contiguous, the rank's 1/cp of the sequence; zig-zag, chunks ``rank`` and ``2 cp - 1 - rank`` of 2 cp."""
    if split == "contiguous":
        n = seq_len // cp
        return torch.arange(rank * n, (rank + 1) * n)
    n = seq_len // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(first * n, (first + 1) * n), torch.arange(second * n, (second + 1) * n)])


def attention_inputs(batch: int, heads: int, seq_len: int, head_dim: int, kv_heads: int | None = None, seed: int = 0):
    """Q, K, V and the output's gradient, the same on every rank and in the test process."""
    gen = torch.Generator().manual_seed(seed)
    q, grad_out = (torch.randn(batch, heads, seq_len, head_dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads or heads, seq_len, head_dim, generator=gen) for _ in range(2))
    return q, k, v, grad_out


def sdpa_reference(q, k, v, grad_out) -> dict[str, torch.Tensor]:
    """PyTorch's causal attention over the whole sequence (grouped-query when K, V have fewer heads): the output
    and the gradients of Q, K and V."""
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    out.backward(grad_out)
    return {"output": out.detach(), **{name: t.grad for name, t in zip("qkv", full, strict=True)}}


def on_this_rank(attention, q, k, v, grad_out, split: str, **kwargs) -> dict[str, torch.Tensor]:
    """``attention`` (ring or Ulysses) on this rank's tokens: its output and its tokens' Q, K, V gradients."""
    pos = rank_positions(q.shape[-2], dist.get_world_size(), dist.get_rank(), split)
    mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    out = attention(*mine, split=split, **kwargs)
    out.backward(grad_out[:, :, pos])
    return {"output": out.detach(), **{name: t.grad for name, t in zip("qkv", mine, strict=True)}}


def relative_errors_against_sdpa(per_rank: list[dict], split: str, **shape) -> list[float]:
    """Per rank, the largest per-tensor relative difference (output, Q, K, V gradients) of its tokens from the
    same rows of PyTorch's attention over the whole sequence."""
    reference = sdpa_reference(*attention_inputs(**shape))
    cp = len(per_rank)
    errors = []
    for rank, mine in enumerate(per_rank):
        pos = rank_positions(shape["seq_len"], cp, rank, split)
        errors.append(max_relative_difference(mine, {name: t[:, :, pos] for name, t in reference.items()}))
    return errors


def gpt_one_step(cp: int, split: str, method: str = "ring", seed: int = 0) -> dict:
    """On every rank: a small GPT's loss and every gradient after one step with ring attention or Ulysses on
    dp x cp ranks (cp consecutive ranks share two sequences, dp = world / cp blocks hold different ones), the
    gradients averaged over all ranks as the data-parallel wrapper does, next to the same GPT on the whole
    batch in this process (``experiments.context.gpt_context_parallel_errors``, returning tensors, so that the
    test compares them per tensor)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // cp
    groups = [dist.new_group(list(range(d * cp, (d + 1) * cp))) for d in range(dp)]  # every rank makes all
    torch.manual_seed(seed)
    heads = 4 if method == "ulysses" else 2  # Ulysses deals whole heads to the ranks: cp must divide them
    reference = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=heads, n_embd=32))
    model = copy.deepcopy(reference)
    gen = torch.Generator().manual_seed(seed + 1)
    idx, targets = (torch.randint(0, 64, (2 * dp, 16), generator=gen) for _ in range(2))
    _, reference_loss = reference(idx, targets)
    reference_loss.backward()
    group = groups[rank // cp]
    {"ring": context.apply_context_parallel, "ulysses": ulysses.apply_ulysses}[method](model, group, split=split)
    rows = slice(2 * (rank // cp), 2 * (rank // cp + 1))  # this dp rank's two sequences
    mine, my_targets, positions = context.context_parallel_batch(idx[rows], targets[rows], group, split)
    _, loss = model(mine, my_targets, positions=positions)
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad.div_(world))
    logged = loss.detach().clone()
    dist.all_reduce(logged.div_(world))
    return {
        "loss": logged.item(),
        "reference_loss": reference_loss.item(),
        "grads": {name: p.grad for name, p in model.named_parameters()},
        "reference_grads": {name: p.grad for name, p in reference.named_parameters()},
        "local_tokens": tuple(mine.shape),
    }


def ring_attention_and_gpt(world: int) -> dict:
    """One launch, four claims: ring attention (every variant) against PyTorch's attention, with the bytes and
    pairs it counts; the GPT with cp = min(world, 2) (next to dp = world / cp) against one process; a batch
    that does not split raises."""
    inputs = attention_inputs(**SHAPE)
    results = {"ring": compare_ring_attention(**SHAPE)}  # bytes sent and saved, pairs computed
    results["variants"] = ring_variants(**SHAPE)  # pairs and FLOPs of the naive, skipping and overlapped rings
    results["sdpa"] = {
        (split, skip, overlap): on_this_rank(context.ring_attention, *inputs, split, skip_masked=skip, overlap=overlap)
        for split, skip, overlap in RING_VARIANTS
    }
    results["gpt"] = {split: gpt_one_step(min(world, 2), split) for split in context.SPLITS}
    try:  # 5 tokens cannot be cut into 2 cp chunks, for any cp
        context.context_parallel_batch(torch.zeros(1, 5, dtype=torch.long), None)
    except ValueError as error:
        results["bad_batch"] = str(error)
    return results


@pytest.fixture(scope="module", params=[1, 2, 4])
def launched(request):
    cp = request.param
    return cp, launch(ring_attention_and_gpt, cp, cp, timeout=120)


def test_gpt_loss_and_every_gradient_equal_one_process_under_context_parallelism(launched):
    world, results = launched
    cp = min(world, 2)
    for rank, result in enumerate(results):
        for split, gpt in result["gpt"].items():
            assert gpt["local_tokens"] == (2, 16 // cp)  # each rank really held 1/cp of every sequence
            loss_error = abs(gpt["loss"] - gpt["reference_loss"]) / gpt["reference_loss"]
            # Per tensor, relative to the tensor's largest reference entry: a missing 1/cp (or a gradient left
            # on its home rank) in any one tensor, however small its gradients, is off by far more than this.
            grad_error = max_relative_difference(gpt["grads"], gpt["reference_grads"])
            assert loss_error < TOLERANCE and grad_error < TOLERANCE, (world, rank, split, loss_error, grad_error)
        assert f"divisible by {2 * world}" in result["bad_batch"]


def test_ring_attention_output_and_gradients_equal_torch_sdpa(launched):
    cp, results = launched
    for variant in RING_VARIANTS:
        # Every rank's output and Q, K, V gradients against the same rows of PyTorch's attention, per tensor.
        errors = relative_errors_against_sdpa([r["sdpa"][variant] for r in results], variant[0], **SHAPE)
        assert max(errors) < TOLERANCE, (cp, variant, errors)


def test_ring_attention_sends_saves_and_computes_what_was_counted_by_hand(launched):
    cp, results = launched
    result = results[0]["ring"]
    for split in context.SPLITS:
        # The pairs the ranks really computed (counted inside the ring loop), forward and backward alike.
        for r, work in enumerate(result[split]["half_blocks"]):
            for phase in ("forward", "backward"):
                computed = work[phase]["full"] + work[phase]["diagonal"]
                assert computed == HAND_COUNTED[cp, split][r], (split, r, phase, work)
                assert work[phase]["diagonal"] == 2 and computed + work[phase]["skipped"] == 4 * cp
        if cp == 1:
            continue
        # Bytes counted by count_traffic against the block count: each block is 1 * 2 * (32/cp) * 8 floats.
        block = 2 * (32 // cp) * 8 * 4
        assert result[split]["forward"]["isend"][1] == 2 * (cp - 1) * block
        assert result[split]["backward"]["isend"][1] == (4 * (cp - 1) + 2) * block
        # Saved for backward: own Q, K, V, output (4 blocks) and the log-sum-exp (one float per query).
        assert result[split]["ring_saved_bytes"] == 4 * block + 2 * (32 // cp) * 4
        # The reference keeps the full 32 x 32 softmax per head: the s^2 term ring attention never holds.
        assert result[split]["full_saved_bytes"] > 2 * 32 * 32 * 4


def test_naive_and_overlapped_rings_compute_what_the_formulas_say(launched):
    cp, results = launched
    assert set(results[0]["variants"]) == set(RING_VARIANTS)
    for (split, skip, overlap), result in results[0]["variants"].items():
        pairs = context.half_blocks_per_rank(cp, split, skip_masked=skip)
        flops = context.ring_attention_flops_per_rank(1, 2, 32, 8, cp=cp, split=split, skip_masked=skip)
        for r, measured in enumerate(result["per_rank"]):
            for phase in ("forward", "backward"):
                assert measured["pairs"][phase] == pairs[r], (split, skip, overlap, r, phase)
            # FlopCounterMode counted the matmuls the rank really ran, independently of the loop's counters.
            assert measured["flops"] == flops[r], (split, skip, overlap, r)
        if not skip:  # the naive ring computes all 4 cp pairs it meets, so every rank does the same work
            assert {m["flops"]["forward"] for m in result["per_rank"]} == {8 * cp * 2 * 2 * (32 // (2 * cp)) ** 2 * 8}


def test_formulas_match_hand_counts():
    # b=2, a=4, s=64, d=16, fp32, cp=4: block = 2*4*16*16*4 = 8192 bytes.
    assert context.ring_bytes_per_rank(2, 4, 64, 16, cp=4) == {"forward": 6 * 8192, "backward": 14 * 8192}
    saved = context.attention_saved_bytes(2, 4, 64, 16, cp=4)
    assert saved == {"saved": 4 * 8192 + 2 * 4 * 16 * 4, "score_block": 2 * 4 * 16 * 16 * 4}
    assert math.isclose(context.attention_saved_bytes(2, 4, 64, 16)["score_block"], 2 * 4 * 64 * 64 * 4)


def test_bad_layout_raises_before_work():
    with pytest.raises(ValueError, match="divisible by 8"):
        context.validate_context_parallel(20, 4)
    with pytest.raises(ValueError, match="divisible by 4"):  # half-chunks need 2 cp chunks for either split
        context.validate_context_parallel(6, 2, "contiguous")
    with pytest.raises(ValueError, match="split must be one of"):
        context.token_positions(16, 2, 0, split="striped")


def test_model_level_bad_input_raises_before_work():
    with pytest.raises(ValueError, match="attention dropout"):
        context.apply_context_parallel(GPT(GPTConfig(n_layer=1, dropout=0.1)))
    with pytest.raises(ValueError, match="split must be one of"):
        context.apply_context_parallel(GPT(GPTConfig(n_layer=1)), split="striped")
    with pytest.raises(ValueError, match="no attention layer"):
        context.apply_context_parallel(torch.nn.Linear(2, 2))
