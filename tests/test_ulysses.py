"""Ulysses (DeepSpeed-Ulysses) on 2 and 4 ranks equals PyTorch's causal ``scaled_dot_product_attention`` over the
whole sequence (grouped-query by ``enable_gqa``), with as many K/V heads as query heads and with grouped-query
attention, for either token split: each rank's output and Q, K, V gradients against the same rows of the
reference, per tensor; its two all-to-alls per pass send what the closed form says; on the GPT it trains a step
like one process, every gradient per tensor; a head count the ranks do not divide is refused before anything is
sent. (PyTorch's own ``context_parallel`` does not run on CPU: see ``test_context_parallel``.)"""

import pytest
import torch
from test_context_parallel import attention_inputs, gpt_one_step, on_this_rank, relative_errors_against_sdpa

from scalebook.accounting import context as volume
from scalebook.comm import count_traffic, launch
from scalebook.experiments.context import compare_ulysses
from scalebook.model import GPT, GPTConfig
from scalebook.parallel import context, ulysses
from scalebook.parity import max_relative_difference

# Relative to each tensor's largest reference entry (parity.max_relative_difference), per tensor. The all-to-alls
# move values exactly and Ulysses runs SDPA itself on the heads it holds: its outputs and Q, K, V gradients were
# bit-identical to the reference here (0.0), the GPT's gradients within 4.3e-7 and its loss within 1.2e-7 (sums
# in another order). 1e-5 leaves 20x headroom over that; a dropped factor (1/sqrt(d) on the scores, 1/cp on a
# gradient) or a rank's rows put back in the wrong order moves the tensor it touches by 10% or more.
TOLERANCE = 1e-5
SHAPE = {"batch": 1, "seq_len": 32, "head_dim": 8}


def heads_of(kind: str, world: int) -> dict[str, int]:
    """4 heads with their own K/V (``"mha"``), or 4 cp query heads sharing cp K/V heads (``"gqa"``)."""
    return {"heads": 4, "kv_heads": 4} if kind == "mha" else {"heads": 4 * world, "kv_heads": world}


def ulysses_and_gpt(world: int) -> dict:
    """One launch: Ulysses against PyTorch's attention (4 heads; 4 cp query heads sharing cp K/V heads), with the
    bytes it sends; the GPT with cp = world against one process; the errors a head count that cp does not divide
    raises."""
    results = {"gpt": {split: gpt_one_step(world, split, method="ulysses") for split in context.SPLITS}}
    for kind in ("mha", "gqa"):
        results[kind] = compare_ulysses(**heads_of(kind, world), **SHAPE)  # bytes sent
        inputs = attention_inputs(**heads_of(kind, world), **SHAPE)
        results[kind, "sdpa"] = {split: on_this_rank(ulysses.ulysses_attention, *inputs, split)
                                 for split in context.SPLITS}  # fmt: skip
    q = torch.zeros(1, 3, 8, 8)  # 3 heads
    with count_traffic() as traffic:
        try:
            ulysses.ulysses_attention(q, q, q)
        except ValueError as error:
            results["bad_heads"] = str(error)
        try:
            ulysses.apply_ulysses(GPT(GPTConfig(n_layer=1, n_head=3, n_embd=24)))
        except ValueError as error:
            results["bad_model"] = str(error)
    results["calls_before_error"] = traffic.count()
    return results


@pytest.fixture(scope="module", params=[2, 4])
def launched(request):
    world = request.param
    return world, launch(ulysses_and_gpt, world, world, timeout=180)


def test_ulysses_output_and_gradients_equal_torch_sdpa(launched):
    world, results = launched
    for kind in ("mha", "gqa"):
        for split in context.SPLITS:
            per_rank = [result[kind, "sdpa"][split] for result in results]
            errors = relative_errors_against_sdpa(per_rank, split, **heads_of(kind, world), **SHAPE)
            assert max(errors) < TOLERANCE, (world, kind, split, errors)


def test_ulysses_sends_what_the_closed_form_says(launched):
    world, results = launched
    for kind, heads, kv_heads in (("mha", 4, 4), ("gqa", 4 * world, world)):
        # By hand: a rank holds Q, K, V and the output, b (s/c) d (2 a + 2 n_kv) floats, and sends (c-1)/c of them.
        held = 1 * (32 // world) * 8 * (2 * heads + 2 * kv_heads) * 4
        expected = volume.ulysses_bytes_per_rank(1, heads, 32, 8, cp=world, kv_heads=kv_heads, dtype_bytes=4)
        assert expected == {"forward": (world - 1) * held / world, "backward": (world - 1) * held / world}
        for result in results:
            for r in result[kind].values():
                # Two all-to-alls each way (Q, K, V packed into one; the output) and nothing else.
                assert r["forward"] == {"all_to_all_single": (2, expected["forward"])}, (kind, r["forward"])
                assert r["backward"] == {"all_to_all_single": (2, expected["backward"])}, (kind, r["backward"])


def test_gpt_with_ulysses_trains_a_step_like_one_process(launched):
    world, results = launched
    for result in results:
        for split, gpt in result["gpt"].items():
            assert gpt["local_tokens"] == (2, 16 // world)
            loss_error = abs(gpt["loss"] - gpt["reference_loss"]) / gpt["reference_loss"]
            grad_error = max_relative_difference(gpt["grads"], gpt["reference_grads"])  # per tensor
            assert loss_error < TOLERANCE and grad_error < TOLERANCE, (world, split, loss_error, grad_error)


def test_heads_the_ranks_do_not_divide_raise_before_any_communication(launched):
    world, results = launched
    for result in results:
        assert f"cp ({world}) must divide heads (3)" in result["bad_heads"]
        assert f"cp ({world}) must divide heads (3)" in result["bad_model"]
        assert result["calls_before_error"] == 0


def test_layout_errors_name_what_to_change():
    with pytest.raises(ValueError, match=r"cp \(4\) must divide kv_heads \(2\); use cp in \[1, 2\]"):
        ulysses.validate_ulysses(8, 2, 64, 4)
    with pytest.raises(ValueError, match="divisible by 8"):  # zig-zag needs 2 cp chunks
        ulysses.validate_ulysses(8, 8, 20, 4)
    with pytest.raises(ValueError, match="must divide heads"):
        volume.ulysses_bytes_per_rank(1, 6, 64, 8, cp=4)
    with pytest.raises(ValueError, match="attention dropout"):
        ulysses.apply_ulysses(GPT(GPTConfig(n_layer=1, dropout=0.1)))


def test_volume_formulas_match_hand_counts():
    # Llama-3.1-405B-like attention: a = 128, n_kv = 8, d = 128, one 131,072-token sequence, bf16, c = 8.
    # Ring: K/V blocks of 8 * 16384 * 128 * 2 bytes = 32 MiB, 2 * 7 of them forward, 4 * 7 + 2 backward.
    block = 8 * 16384 * 128 * 2
    ring = volume.ring_attention_bytes_per_rank(1, 128, 131072, 128, cp=8, kv_heads=8)
    assert ring == {"forward": 14 * block, "backward": 30 * block}
    # Ulysses: 7/8 of 16384 * 128 * (256 + 16) * 2 bytes, each way.
    uly = volume.ulysses_bytes_per_rank(1, 128, 131072, 128, cp=8, kv_heads=8)
    assert uly["forward"] == uly["backward"] == 7 / 8 * 16384 * 128 * 272 * 2
    assert volume.ring_attention_bytes_per_rank(2, 4, 64, 16, cp=1) == {"forward": 0, "backward": 0}
    # Llama 3's all-gather of K and V: each rank's share, 16384 tokens * 8 heads * 128 * 2 bytes for K and as much for
    # V, goes to the 7 other ranks: 7 * 2 * 32 MiB forward; the backward gathers them again and reduce-scatters
    # their gradients, twice that.
    gathered = volume.kv_allgather_bytes_per_rank(1, 128, 131072, 128, cp=8, kv_heads=8)
    assert gathered == {"forward": 7 * 2 * 16384 * 8 * 128 * 2, "backward": 2 * 7 * 2 * 16384 * 8 * 128 * 2}
    assert gathered["forward"] == ring["forward"]  # the ring's forward passes the same K/V blocks, one hop at a time
    assert gathered["backward"] == ring["backward"] - 2 * block  # the ring also sends the gradients home
    assert volume.kv_allgather_bytes_per_rank(2, 4, 64, 16, cp=1) == {"forward": 0, "backward": 0}
    # Ring hides its transfers once s/c >= n_kv e P / (a B): 8 * 2 * 1e15 / (128 * 50e9) = 2500 tokens.
    assert volume.ring_overlap_min_tokens(128, kv_heads=8, flops=1e15, bandwidth=50e9) == pytest.approx(2500)
