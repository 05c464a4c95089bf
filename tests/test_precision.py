"""Floating-point formats, dynamic loss scaling and fp8 quantization (scalebook.precision), and the bytes
they take (scalebook.accounting.precision): formats against torch.finfo and torch's own casts, the loss
scaler against torch.amp.GradScaler step by step, fp8 scaling against its error bound and the byte formula."""

from __future__ import annotations

import math

import pytest
import torch

from scalebook import accounting, precision
from scalebook.accounting.precision import deepseek_v3_state_bytes, format_bytes

TORCH_FORMATS = ("fp32", "bf16", "fp16", "fp8-e4m3", "fp8-e5m2")


@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_formats_from_their_bits_match_torch_finfo(name):
    fmt, info = precision.float_format(name), torch.finfo(precision.DTYPES[name])
    assert (fmt.bits, fmt.max, fmt.smallest_normal, fmt.eps) == (info.bits, info.max, info.smallest_normal, info.eps)
    # finfo has no smallest subnormal: it is the bit pattern 0...01.
    one = torch.tensor([1], dtype=precision._SAME_WIDTH_INT[fmt.bits]).view(precision.DTYPES[name])
    assert fmt.smallest_subnormal == one.double().item()


def test_tf32_is_fp32_rounded_to_ten_mantissa_bits_to_nearest_even():
    torch.manual_seed(0)
    x = torch.randn(20_000) * torch.exp2(torch.randint(-120, 120, (20_000,)).float())
    tf32 = precision.round_mantissa(x, 10)
    assert not (tf32.view(torch.int32) & (2**13 - 1)).any()  # the 13 dropped bits are zero
    # Nearest: within half a tf32 ulp of x (fp64 arithmetic is exact for these differences).
    ulp = precision.float_format("tf32").ulp(x)
    assert ((tf32.double() - x.double()).abs() <= ulp / 2).all()
    # Ties go to the even neighbour: 1 + 2^-11 is halfway between 1 and 1 + 2^-10 (odd), 1 + 3 * 2^-11 between
    # 1 + 2^-10 (odd) and 1 + 2^-9 (even); the largest fp32 rounds up into the exponent, to inf.
    ties = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 3 * 2**-11), torch.finfo(torch.float32).max])
    assert precision.round_mantissa(ties, 10).tolist() == [1.0, 1 + 2**-9, -(1 + 2**-9), math.inf]
    # The same rounding to 7 bits is exactly torch's bf16 cast.
    assert torch.equal(precision.round_mantissa(x, 7), x.to(torch.bfloat16).float())
    special = torch.tensor([math.inf, -math.inf, math.nan])
    assert precision.cast(special, "tf32")[:2].tolist() == [math.inf, -math.inf]
    assert precision.cast(special, "tf32")[2].isnan()


def test_bit_strings_of_known_values():
    assert precision.bit_string(1.0, "fp32") == "0 01111111 " + "0" * 23
    assert precision.bit_string(-2.0, "bf16") == "1 10000000 0000000"
    assert precision.bit_string(0.1, "tf32") == "0 01111011 1001100110"  # 0.1 = 1.6 x 2^-4, rounded down
    assert precision.bit_string(65504.0, "fp16") == "0 11110 1111111111"
    assert precision.bit_string(448.0, "fp8-e4m3") == "0 1111 110"  # 1.75 x 2^8; 0 1111 111 is NaN
    assert precision.bit_string(57344.0, "fp8-e5m2") == "0 11110 11"
    assert precision.bit_string(2.0**-9, "fp8-e4m3") == "0 0000 001"  # the smallest subnormal


@pytest.mark.parametrize("name", ["fp8-e4m3", "fp8-e5m2"])
def test_ulp_is_the_gap_between_neighbouring_fp8_values(name):
    values = precision.representable_values(name)
    assert len(values) == {"fp8-e4m3": 127, "fp8-e5m2": 124}[name]  # 128 patterns minus NaN (and inf)
    assert values[-1].item() == precision.float_format(name).max
    assert torch.equal(values[1:] - values[:-1], precision.float_format(name).ulp(values[:-1]))


def test_fp32_ulp_matches_nextafter():
    x = torch.tensor([1e-30, 3e-7, 1.0, 1.5, 7.0, 1e30])
    gap = torch.nextafter(x, torch.tensor(math.inf)) - x
    assert torch.equal(gap.double(), precision.float_format("fp32").ulp(x))


def test_unknown_format_and_bad_round_mantissa_input_raise_one_clear_error():
    with pytest.raises(ValueError, match="format must be one of"):
        precision.float_format("fp4")
    with pytest.raises(ValueError, match="fp32 tensor"):
        precision.round_mantissa(torch.ones(2, dtype=torch.float64), 10)
    with pytest.raises(ValueError, match="only the fp8 formats"):
        precision.representable_values("fp16")


# ---------------------------------------------------------------- loss scaling


def _scaled_training(scaler, steps, overflow_steps, clip):
    """fp16-autocast training of a small MLP; returns (scale, skipped?, parameters) after every step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    history = []
    for step in range(steps):
        x, y = torch.randn(32, 8, generator=data), torch.randn(32, 1, generator=data)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = (out.float() - y).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        if step in overflow_steps:  # an injected overflow: one gradient entry becomes inf or NaN
            model[0].weight.grad[0, 0] = math.inf if step % 2 else math.nan
        if clip:  # the documented pattern: unscale_, clip the true gradients, then step
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        params = [p.detach().clone() for p in model.parameters()]
        skipped = all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
        history.append((scaler.get_scale(), skipped, params))
    return history


@pytest.mark.parametrize(
    ("settings", "clip"),
    [
        # 2^24 overflows fp16's backward at first (natural infs), then backs off until it fits, then grows.
        (dict(init_scale=2.0**24, growth_factor=2.0, backoff_factor=0.5, growth_interval=3), False),
        # Factors that are not powers of two: the scale's fp32 arithmetic must match GradScaler's too.
        (dict(init_scale=1000.0, growth_factor=1.7, backoff_factor=0.3, growth_interval=2), True),
    ],
)
def test_dynamic_loss_scaler_matches_grad_scaler_step_by_step(settings, clip):
    steps, injected = 20, {4, 5, 11}
    ours = _scaled_training(precision.DynamicLossScaler(**settings), steps, injected, clip)
    ref = _scaled_training(torch.amp.GradScaler("cpu", **settings), steps, injected, clip)
    for step, ((scale, skipped, params), (ref_scale, ref_skipped, ref_params)) in enumerate(
        zip(ours, ref, strict=True)
    ):
        # Same arithmetic in the same order (fp32 scale, fp32 reciprocal, same optimizer): bit-identical.
        assert (scale, skipped) == (ref_scale, ref_skipped), step
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True)), step
    skipped_steps = {step for step, (_, skipped, _) in enumerate(ours) if skipped}
    assert injected <= skipped_steps  # every injected overflow was skipped
    assert len({scale for scale, _, _ in ours}) > 3  # the scale moved both ways, so the test exercises update()


def test_dynamic_loss_scaler_checkpoints_are_interchangeable_with_grad_scaler():
    settings = dict(init_scale=2.0**24, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ours, ref = precision.DynamicLossScaler(**settings), torch.amp.GradScaler("cpu", **settings)
    _scaled_training(ours, 10, {4}, clip=False)
    _scaled_training(ref, 10, {4}, clip=False)
    assert ours.state_dict() == ref.state_dict()
    # Resume each from the other's state: the next steps (new batches) agree bit for bit.
    resumed_ours, resumed_ref = precision.DynamicLossScaler(), torch.amp.GradScaler("cpu")
    resumed_ours.load_state_dict(ref.state_dict())
    resumed_ref.load_state_dict(ours.state_dict())
    assert resumed_ours.state_dict() == resumed_ref.state_dict() == ref.state_dict()
    after_ours = _scaled_training(resumed_ours, 6, {2}, clip=False)
    after_ref = _scaled_training(resumed_ref, 6, {2}, clip=False)
    assert [(s, k) for s, k, _ in after_ours] == [(s, k) for s, k, _ in after_ref]


def test_dynamic_loss_scaler_counts_skips_and_refuses_misuse():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = precision.DynamicLossScaler(init_scale=4.0, growth_interval=1)
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    assert p.grad.tolist() == [1.0, 1.0]  # d(4 * sum p)/dp = 4, divided by S = 4
    with pytest.raises(RuntimeError, match="already called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert (scaler.get_scale(), scaler.skipped_steps, p.tolist()) == (8.0, 0, [0.0, 0.0])
    p.grad = torch.tensor([math.inf, 0.0])
    scaler.step(opt)
    scaler.update()
    assert (scaler.get_scale(), scaler.skipped_steps, p.tolist()) == (4.0, 1, [0.0, 0.0])
    with pytest.raises(RuntimeError, match="needs a step"):
        scaler.update()


def test_dynamic_loss_scaler_rejects_bad_settings_in_one_error():
    with pytest.raises(ValueError) as err:
        precision.DynamicLossScaler(init_scale=0, growth_factor=0.5, backoff_factor=2, growth_interval=0)
    for name in ("init_scale", "growth_factor", "backoff_factor", "growth_interval"):
        assert name in str(err.value)


# ---------------------------------------------------------------- fp8


@pytest.mark.parametrize("block", [None, (1, 128), (128, 128), (3, 50)])
def test_fp8_quantization_is_within_half_an_ulp_of_each_scaled_value(block):
    torch.manual_seed(0)
    x = torch.randn(300, 260) * torch.exp2(torch.randint(-8, 8, (300, 1)).float())
    q, scales = precision.quantize_fp8(x, block=block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    back = precision.dequantize_fp8(q, scales, block=block)
    # Each group's amax maps to 448 exactly, and every value is rounded to the nearest e4m3 value of x / s:
    # the error is at most half an e4m3 ulp of x / s, times s, plus the fp32 rounding of the division x / s
    # and of the product q * s (2^-24 relative each; a tie can land either side of x / s's fp32 value).
    r, c = block or x.shape
    s = scales.repeat_interleave(r, 0).repeat_interleave(c, 1)[: x.shape[0], : x.shape[1]]
    bound = precision.float_format("fp8-e4m3").ulp(x / s) / 2 * s + x.abs().double() * 2**-22
    assert ((back - x).abs().double() <= bound).all()
    assert torch.equal(x.abs().amax(), back.abs().amax())  # the largest magnitude is kept exactly


def test_fp8_block_scaling_beats_tensor_scaling_when_a_few_activations_are_massive():
    torch.manual_seed(0)
    x, w = torch.randn(256, 512), torch.randn(384, 512) / 512**0.5

    def error(y, reference):  # each token's output relative to its own size, averaged over tokens
        return ((y - reference).norm(dim=1) / reference.norm(dim=1)).mean().item()

    clean = {r: error(precision.fp8_linear(x, w, recipe=r), x @ w.T) for r in precision.FP8_RECIPES}
    bf16 = error((x.bfloat16() @ w.bfloat16().T).float(), x @ w.T)
    x[0, 7] *= 1e5  # two "massive activations" (Sun et al. 2024): single entries 10^5 x the rest
    x[100, 300] *= 1e5
    massive = {r: error(precision.fp8_linear(x, w, recipe=r), x @ w.T) for r in precision.FP8_RECIPES}
    # e4m3 keeps 3 mantissa bits (rounding error up to 2^-4 relative), bf16 7: fp8 is several times worse.
    assert bf16 < clean["block"] / 5 and bf16 < clean["tensor"] / 5
    # Without outliers the two scalings are alike (within 5 %). e4m3's normals span 448 / 2^-6 ~ 2.9e4, so
    # a per-tensor scale set by a 10^5 outlier pushes every other token into the subnormals, while
    # 1 x 128 tiles keep the other tokens' scales their own: they stay at the clean error (within 5 %).
    assert abs(clean["tensor"] / clean["block"] - 1) < 0.05
    assert abs(massive["block"] / clean["block"] - 1) < 0.05
    assert massive["tensor"] > 3 * massive["block"]


def test_fp8_input_errors_are_clear():
    with pytest.raises(ValueError, match="recipe must be one of"):
        precision.fp8_linear(torch.ones(2, 4), torch.ones(3, 4), recipe="row")
    with pytest.raises(ValueError, match="weight"):
        precision.fp8_linear(torch.ones(2, 4), torch.ones(3, 5))
    with pytest.raises(ValueError, match="2-D"):
        precision.quantize_fp8(torch.ones(4))


# ---------------------------------------------------------------- accounting


@pytest.mark.parametrize(("shape", "block"), [((256, 512), None), ((256, 512), (1, 128)), ((300, 130), (128, 128)),
                                              ((5, 7), (2, 3))])  # fmt: skip
def test_fp8_byte_formula_matches_the_quantized_tensors(shape, block):
    q, scales = precision.quantize_fp8(torch.randn(shape), block=block)
    assert format_bytes(shape, "fp8-e4m3", block=block) == q.nbytes + scales.nbytes


def test_format_bytes_of_unscaled_formats_and_errors():
    for name in ("fp32", "bf16", "fp16"):
        assert format_bytes((3, 5), name) == torch.empty(3, 5, dtype=precision.DTYPES[name]).nbytes
    assert format_bytes((128, 128), "fp8-e4m3", block=(128, 128)) == 128 * 128 + 4
    with pytest.raises(ValueError, match="only fp8 tensors carry scales"):
        format_bytes((4, 4), "bf16", block=(2, 2))
    with pytest.raises(ValueError) as err:
        format_bytes((4, -1), "int4", block=(2,))
    assert "fmt must be one of" in str(err.value) and "shape must be" in str(err.value)


def test_deepseek_v3_keeps_12_bytes_per_parameter_against_16_for_bf16_mixed_precision():
    rows = deepseek_v3_state_bytes(671e9)
    assert sum(b for _, b in rows) == 12 * 671e9
    assert accounting.model_state_bytes(671e9, precision="mixed").total == 16 * 671e9
