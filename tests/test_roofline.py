"""The roofline: each GPT-layer operator's FLOPs and minimum bytes match what PyTorch counts and what the
tensors hold, and the ridge points sort the operators into memory- and compute-bound as the text says."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from scalebook import configs, measure
from scalebook.accounting import roofline

SHAPES = [(2, 16, 32, 4), (1, 24, 48, 6)]  # (batch, seq_len, d_model, n_heads): s != h, so no term hides another


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flops_and_bytes_match_flop_counter_and_tensor_nbytes(shape, dtype):
    calls = measure.gpt_layer_op_calls(*shape, dtype=dtype)
    ops = roofline.gpt_layer_ops(*shape, dtype_bytes=torch.empty((), dtype=dtype).element_size())
    assert [op.name for op in ops] == list(calls)
    for op in ops:
        call = calls[op.name]
        with FlopCounterMode(display=False) as counter:
            out = call()
        # Minimum traffic: every input read once, the output written once; integers, so exact.
        assert op.bytes == sum(t.nbytes for t in call.inputs) + out.nbytes, op.name
        if op.matmul:
            assert op.flops == counter.get_total_flops(), op.name
        else:
            # The counter counts no element-wise work; the formula's count is the stated convention.
            assert counter.get_total_flops() == 0, op.name
            assert op.flops == roofline.ELEMENTWISE_FLOPS[op.name] * out.numel(), op.name


def test_h100_ridge_point_and_which_ops_of_a_gpt3_layer_are_memory_bound():
    # H100 SXM: 989.5 TFLOP/s dense bf16 over 3.35 TB/s is a ridge of 295 FLOPs per byte.
    h100 = configs.get_hardware("h100-sxm")
    peak, bandwidth = h100.peak("bf16"), h100.hbm_bandwidth
    assert roofline.ridge_point(peak, bandwidth) == pytest.approx(295.4, abs=0.1)
    gpt3 = configs.get_model("gpt3-175b")
    ops = roofline.gpt_layer_ops(1, 2048, gpt3.d_model, gpt3.n_heads, dtype_bytes=2)
    bound = {op.name for op in ops if roofline.memory_bound(op, peak, bandwidth)}
    # Weight matmuls are compute-bound; everything element-wise, and unfused attention (d_head = 128:
    # about 2 d_head / p = 128 FLOPs per byte), is memory-bound.
    assert bound == {"LayerNorm", "attention scores QK^T", "softmax", "attention P V", "residual add", "GELU"}


def test_intensities_approach_the_closed_forms():
    # With many tokens (n >> h) a weight matmul tends to ~ 1.5 h / p (QKV), h / p (output), 1.6 h / p (MLP);
    # with long sequences the score matmuls to 2 d_head / p. Relative errors: O(h / n) for the weight
    # matmuls, 2 d_head / s (3 % here) for the scores, exactly s / (s + 2 d_head) of the limit.
    b, s, h, a, p = 64, 8192, 1024, 8, 2
    by_name = {op.name: op.intensity for op in roofline.gpt_layer_ops(b, s, h, a, dtype_bytes=p)}
    assert by_name["QKV projection"] == pytest.approx(1.5 * h / p, rel=0.01)
    assert by_name["output projection"] == pytest.approx(h / p, rel=0.01)
    assert by_name["MLP up"] == by_name["MLP down"] == pytest.approx(1.6 * h / p, rel=0.01)
    d_head = h // a
    assert by_name["attention scores QK^T"] == pytest.approx(2 * d_head / p * s / (s + 2 * d_head), rel=1e-12)
    assert by_name["attention scores QK^T"] == pytest.approx(2 * d_head / p, rel=0.04)
    assert by_name["softmax"] == 5 / (2 * p) and by_name["residual add"] == 1 / (3 * p)


def test_the_roof_is_the_lower_of_bandwidth_times_intensity_and_the_peak():
    assert roofline.attainable_flops(10.0, 1e12, 1e10) == 1e11  # memory-bound: 10 FLOP/B * 10 GB/s
    assert roofline.attainable_flops(1000.0, 1e12, 1e10) == 1e12  # compute-bound: the peak
    assert roofline.attainable_flops(100.0, 1e12, 1e10) == 1e12  # at the ridge both roofs meet


def test_bad_inputs_say_what_to_change():
    with pytest.raises(ValueError, match="d_model \\(30\\) must be divisible by n_heads \\(4\\)"):
        roofline.gpt_layer_ops(1, 8, 30, 4)
    with pytest.raises(ValueError, match="seq_len must be an integer >= 1"):
        roofline.gpt_layer_ops(1, 0, 32, 4)
    with pytest.raises(ValueError, match="bandwidth must be a positive number"):
        roofline.ridge_point(1e12, 0)
    with pytest.raises(ValueError, match="megabytes must be an integer >= 1"):
        measure.copy_bandwidth(0)


def test_measured_points_cover_every_op():
    # Timings are machine-dependent: only their shape is checked, never their values.
    torch.set_num_threads(1)
    points = measure.roofline_points(1, 16, 32, 4, repeats=1)
    ops = roofline.gpt_layer_ops(1, 16, 32, 4, dtype_bytes=4)
    assert [(p.name, p.intensity) for p in points] == [(op.name, op.intensity) for op in ops]
    assert all(p.seconds > 0 and p.flops_per_second > 0 for p in points)
    assert measure.copy_bandwidth(8, repeats=1) > 0
