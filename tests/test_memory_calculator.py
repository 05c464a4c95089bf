"""The memory calculator of scalebook.widgets: its arithmetic against hand counts, then its controls."""

import pytest

from scalebook import accounting, configs, widgets

GB = 10**9


def test_gpt3_175b_on_one_gpu_without_any_parallelism():
    n = accounting.param_count(configs.get_model("gpt3-175b"))
    estimate = widgets.memory_per_gpu("gpt3-175b", seq_len=2048, micro_batch=1)
    # Mixed precision with Adam: 2 + 2 + 12 bytes per parameter. Activations, Korthikanti et al.:
    # L s b h (34 + 5 a s / h) = 96 * 2048 * 12288 * (34 + 80) bytes.
    assert estimate.rows == (
        ("parameters", 2 * n),
        ("gradients", 2 * n),
        ("optimizer states", 12 * n),
        ("activations", 96 * 2048 * 12288 * 114),
    )
    assert estimate.capacity == 80 * GB and not estimate.fits


def test_llama_405b_in_its_published_layout():
    # Grattafiori et al. 2024, Table 4: TP 8, PP 16, DP 128 for 8K sequences. With ZeRO-1, sequence
    # parallelism and selective recomputation, per GPU: 2 N / 128 bytes of bf16 weights and as many of
    # gradients, 12 N / (128 * 128) of optimizer state, and per layer, without dropout, 16-bit and split
    # by t: the norm inputs, QKV input, Q, attention output and MLP input (6 h), K and V (2 d_kv = 2048),
    # the SwiGLU gate, up, SiLU output and product (4 d_ff = 4 * 53248): s b (12 h + 4 d_kv + 8 d_ff) / t.
    n = 405_853_388_800  # the published count (safetensors total), as in tests/test_accounting.py
    estimate = widgets.memory_per_gpu(
        "llama-3.1-405b", seq_len=8192, micro_batch=1, zero_stage=1, dp=128, tp=8, pp=16, sp=True,
        recompute="selective",
    )  # fmt: skip
    assert dict(estimate.rows) == {
        "parameters": 2 * n // 128,
        "gradients": 2 * n // 128,
        "optimizer states": -(-12 * n // (128 * 128)),
        "activations": 126 * 8192 * (12 * 16384 + 4 * 1024 + 8 * 53248) // 8,
    }


def test_fp32_activations_take_twice_the_bytes():
    half = widgets.memory_per_gpu("llama-3-8b", seq_len=4096, precision="mixed")
    full = widgets.memory_per_gpu("llama-3-8b", seq_len=4096, precision="fp32")
    assert dict(full.rows)["activations"] == 2 * dict(half.rows)["activations"]


def test_the_gpu_sets_the_capacity():
    assert widgets.memory_per_gpu("gpt2", gpu="mi300x").capacity == 192 * GB


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(model="gpt5"), "unknown model 'gpt5'"),
    (dict(gpu="tpu"), "unknown hardware 'tpu'"),
    (dict(tp=5), "tp (5) must divide n_heads (96)"),
    (dict(zero_stage=4), "zero_stage must be one of"),
])  # fmt: skip
def test_bad_layouts_raise_one_value_error(kwargs, message):
    with pytest.raises(ValueError) as error:
        widgets.memory_per_gpu(**kwargs)
    assert message in str(error.value)


def test_the_panel_recomputes_when_a_control_changes():
    panel = widgets.memory_calculator()
    grid, result = panel.children
    controls = {control.description: control for control in grid.children}
    controls["tp"].value = 8
    expected = widgets.memory_per_gpu("gpt3-175b", tp=8)
    assert result.value == widgets.memory_estimate_html(expected)
    assert f"{expected.total / GB:,.1f} GB" in result.value
    controls["tp"].value = 64  # does not divide 96 heads: the panel shows the error, it does not raise
    assert "Not a valid layout" in result.value and "must divide n_heads" in result.value


def test_fused_attention_drops_the_score_term():
    explicit = widgets.memory_per_gpu("gpt3-175b", seq_len=2048)
    fused = widgets.memory_per_gpu("gpt3-175b", seq_len=2048, attention="fused")
    # Korthikanti et al.'s 5 a s / h term, 96 layers: 5 a s^2 b bytes each.
    assert dict(explicit.rows)["activations"] - dict(fused.rows)["activations"] == 96 * 5 * 96 * 2048**2


def test_the_panel_has_an_attention_control():
    grid, result = widgets.memory_calculator(model="llama-3-8b").children
    controls = {control.description: control for control in grid.children}
    controls["sequence"].value = 8192
    controls["attention"].value = "fused"
    assert result.value == widgets.memory_estimate_html(
        widgets.memory_per_gpu("llama-3-8b", seq_len=8192, attention="fused"))


@pytest.mark.parametrize(("model", "trained_with"), [("llama-3-70b", "fused"), ("gpt3-175b", "explicit")])
def test_the_default_attention_is_what_the_model_was_trained_with(model, trained_with):
    """Llama-layout models train with fused kernels, which keep no s x s scores; GPT-3 and Megatron-LM's GPTs
    with explicit attention. At Llama 3 70B, t = 8, p = 8, s = 8,192, explicit attention keeps per layer the
    2 a s^2 b / t bytes of scores and K, V repeated to all 64 heads (2 s b (h - d_kv) 16-bit numbers / t more):
    80 x (2 x 64 x 8192^2 + 4 x 8192 x (8192 - 1024)) / 8 = 88 GB more than fused attention (issue 33)."""
    layout = dict(seq_len=8192, tp=8, pp=8) if model.startswith("llama") else dict(seq_len=2048)
    default = widgets.memory_per_gpu(model, **layout)
    assert default.rows == widgets.memory_per_gpu(model, attention=trained_with, **layout).rows
    if model == "llama-3-70b":
        explicit = dict(widgets.memory_per_gpu(model, attention="explicit", **layout).rows)["activations"]
        assert explicit - dict(default.rows)["activations"] == 80 * (2 * 64 * 8192**2 + 4 * 8192 * (8192 - 1024)) // 8
    assert widgets.memory_calculator_inputs().defaults["attention"] == "auto"
