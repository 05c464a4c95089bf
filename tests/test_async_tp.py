"""Async tensor parallelism in closed form: a collective decomposed into steps hides under its matmul as the
alpha-beta model says, per pair and per layer; the decomposition itself is run on ranks in
tests/test_tensor_parallel.py (the library's sequence-parallel MLP against the decomposed one)."""

import math

import pytest

from scalebook import accounting, configs
from scalebook.accounting import async_tp


def test_chunked_overlap_time_by_hand():
    # 4 pieces of 1 s each, transfers of 0.5 s: every transfer hides, the matmul alone remains.
    assert async_tp.chunked_overlap_time(4.0, 0.5, 4) == 4.0
    # Transfers of 3 s: the first piece (this rank's own) runs at once, then three waits of 3 s.
    assert async_tp.chunked_overlap_time(4.0, 3.0, 4) == 1.0 + 3 * 3.0
    # A first piece that must arrive too waits one transfer more.
    assert async_tp.chunked_overlap_time(4.0, 3.0, 4, first_piece_local=False) == 3.0 + 1.0 + 3 * 3.0
    assert async_tp.chunked_overlap_time(4.0, 3.0, 1) == 4.0  # one rank: nothing to move


def test_decomposed_transfers_add_up_to_the_ring():
    for tp in (1, 2, 4, 8):
        steps = async_tp.decomposed_transfers(1024.0, tp)
        assert len(steps) == tp - 1
        assert sum(steps) == accounting.bytes_sent_per_rank("all_gather", 1024.0, tp)


def test_layer_pairs_cover_every_matmul_three_times_and_the_sequence_parallel_bytes():
    cfg = configs.get_model("llama-2-70b")
    s, b, tp = 4096, 1, 8
    pairs = async_tp.layer_collective_matmuls(cfg, tp, seq_len=s, micro_batch=b)
    assert len(pairs) == 10
    assert [p.op for p in pairs].count("all_gather") == 6  # 2 forward, 2 backward, 2 re-gathers
    # Forward once, backward twice (input and weight gradients), 2 FLOPs per weight and token, 1/t per rank.
    assert math.isclose(sum(p.flops for p in pairs), 3 * 2 * s * b * accounting.params.layer_matmul_weights(cfg) / tp)
    per_rank = sum(accounting.bytes_sent_per_rank(p.op, p.message_bytes, tp) for p in pairs)
    formula = accounting.tensor_parallel_bytes_per_layer(s, b, cfg.d_model, tp, sp=True)
    assert per_rank == formula["forward"] + formula["backward"]


def test_exposed_time_is_the_excess_of_each_step_over_its_piece():
    cfg = configs.get_model("llama-2-70b")
    s, tp, flops, bandwidth, alpha = 4096, 8, 5e14, 450e9, 3e-6
    times = async_tp.async_tp_layer_times(cfg, tp, seq_len=s, micro_batch=1, peak_flops=1e15, mfu=0.5,
                                          bandwidth=bandwidth, alpha=alpha)  # fmt: skip
    step = alpha + s * cfg.d_model * 2 / (tp * bandwidth)
    pairs = async_tp.layer_collective_matmuls(cfg, tp, seq_len=s, micro_batch=1)
    assert math.isclose(times.communication, 10 * (tp - 1) * step)
    exposed = sum((tp - 1) * max(0.0, step - p.flops / flops / tp) for p in pairs)
    assert math.isclose(times.exposed, exposed)
    # Only the h x h output projection is narrower than e t F / (2 B) = 8889 columns: its two pairs are exposed.
    width = async_tp.critical_width(tp, flops=flops, bandwidth=bandwidth)
    assert cfg.d_model < width < cfg.d_model + 2 * cfg.d_kv
    assert 0 < times.exposed < 0.1 * times.communication and times.hidden_fraction > 0.9
    assert math.isclose(times.overlapped, times.compute + times.exposed)


def test_short_sequences_expose_the_latency():
    cfg, hw = configs.get_model("llama-2-70b"), configs.get_hardware("h100-sxm")
    hidden = [async_tp.async_tp_layer_times(cfg, 8, seq_len=s, micro_batch=1, peak_flops=hw.peak("bf16"), mfu=0.5,
                                            bandwidth=450e9, alpha=3.4e-6).hidden_fraction
              for s in (512, 4096, 32768)]  # fmt: skip
    assert hidden == sorted(hidden) and hidden[0] < 0.8 < 0.95 < hidden[-1]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: async_tp.chunked_overlap_time(-1.0, 1.0, 2), "compute must be a number >= 0"),
        (lambda: async_tp.chunked_overlap_time(1.0, 1.0, 0), "pieces must be an integer >= 1"),
        (lambda: async_tp.layer_collective_matmuls(configs.get_model("llama-2-70b"), 8, seq_len=100, micro_batch=1),
         r"seq_len \(100\) must be divisible by tp \(8\)"),
        (lambda: async_tp.layer_collective_matmuls(configs.get_model("deepseek-v3"), 8, seq_len=64, micro_batch=1),
         "latent attention or experts"),
        (lambda: async_tp.async_tp_layer_times(configs.get_model("gpt2"), 2, seq_len=64, micro_batch=1,
                                               peak_flops=1e15, mfu=1.5, bandwidth=1e9, alpha=0.0), "mfu must be"),
    ],
)  # fmt: skip
def test_bad_input_raises_one_clear_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()
