"""scalebook.accounting reproduces the published counts: parameters, bytes, FLOPs, GPUs and days."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import scalebook
from scalebook import accounting, configs, measure

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing below downloads; make sure nothing can

GB = 1e9
GPT_NAMES = [n for n in configs.list_models() if configs.get_model(n).arch == "gpt"]
# Dense Llama-layout models (HF LlamaForCausalLM builds them); the mixtures of experts: tests/test_moe_counting.py
LLAMA_NAMES = [
    n for n in configs.list_models() if configs.get_model(n).arch == "llama" and not configs.get_model(n).is_moe
]


@pytest.fixture(scope="module")
def hf():
    """(torch, transformers), hard dependencies; models are built on the meta device, so no weights are allocated."""
    return torch, transformers


def hf_model(hf, cfg):
    torch, transformers = hf
    if cfg.arch == "gpt":
        hf_config = transformers.GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model,
            n_layer=cfg.n_layers, n_head=cfg.n_heads,
        )  # fmt: skip
        build = transformers.GPT2LMHeadModel
    else:
        hf_config = transformers.LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
            num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.n_kv_heads,
            max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tied_embeddings,
        )  # fmt: skip
        build = transformers.LlamaForCausalLM
    with torch.device("meta"):
        return build(hf_config)


# ---------------------------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("name", GPT_NAMES)
def test_gpt_param_count_matches_hf_gpt2lmheadmodel(hf, name):
    # GPT-3 is GPT-2's architecture at other sizes, so HF's GPT-2 class builds every row of Table 2.1.
    # parameters() yields the tied embedding / LM head matrix once.
    cfg = configs.get_model(name)
    assert accounting.param_count(cfg) == sum(p.numel() for p in hf_model(hf, cfg).parameters())


@pytest.mark.parametrize("name", LLAMA_NAMES)
def test_llama_param_count_matches_hf_llamaforcausallm(hf, name):
    cfg = configs.get_model(name)
    assert accounting.param_count(cfg) == sum(p.numel() for p in hf_model(hf, cfg).parameters())


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("gpt2", 124_439_808),  # openai-community/gpt2 on the HF Hub: "124M params"
        ("gpt2-xl", 1_557_611_200),  # openai-community/gpt2-xl on the HF Hub: "1.56B params"
        ("llama-2-7b", 6_738_415_616),  # meta-llama/Llama-2-7b-hf safetensors total
        ("llama-3-8b", 8_030_261_248),  # meta-llama/Meta-Llama-3-8B safetensors total ("8.03B params")
        ("llama-3.1-405b", 405_853_388_800),  # meta-llama/Llama-3.1-405B safetensors total ("406B params")
    ],
)
def test_published_param_counts(name, published):
    assert accounting.param_count(configs.get_model(name)) == published


# param_breakdown's rows as groups of Hugging Face's parameter names (GPT2LMHeadModel, LlamaForCausalLM); a
# parameter joins the first group that matches. The tied head is yielded once, as wte: "LM head" is 0 for GPT.
HF_GROUPS = {
    "token embedding": r"wte\.|embed_tokens\.",
    "position embedding": r"wpe\.",
    "norms": r"ln_|norm\.",
    "attention weights": r"attn\..*\.weight$",
    "attention biases": r"attn\..*\.bias$",
    "MLP weights": r"mlp\..*\.weight$",
    "MLP biases": r"mlp\..*\.bias$",
    "LM head": r"lm_head\.",
}


@pytest.mark.parametrize("name", GPT_NAMES + LLAMA_NAMES)
def test_breakdown_rows_match_hf_parameter_groups(hf, name):
    # Each row against HF's tensors, so a parameter counted in the wrong row (or twice in one and not in
    # another) fails here though the total is right. (The MoEs: tests/test_moe_counting.py.)
    cfg = configs.get_model(name)
    assert accounting.param_breakdown(cfg) == measure.parameters_by_group(hf_model(hf, cfg), HF_GROUPS)


def test_gpt2_breakdown():
    # V d = 50257 * 768, n_ctx d = 1024 * 768, 12 layers of 4 d^2 + 4 d (attention) and 8 d^2 + 5 d (MLP),
    # 25 LayerNorms of 2 d, head tied to the embedding.
    assert accounting.param_breakdown(configs.get_model("gpt2")) == {
        "token embedding": 38_597_376,
        "position embedding": 786_432,
        "attention weights": 28_311_552,
        "attention biases": 36_864,
        "MLP weights": 56_623_104,
        "MLP biases": 46_080,
        "norms": 38_400,
        "LM head": 0,
    }


@pytest.mark.parametrize("name", GPT_NAMES)
def test_gpt_closed_form_omits_only_position_embeddings_and_final_layernorm(name):
    cfg = configs.get_model(name)
    omitted = accounting.param_count(cfg) - accounting.param_count_closed_form(cfg)
    assert omitted == cfg.max_seq_len * cfg.d_model + 2 * cfg.d_model


@pytest.mark.parametrize("name", LLAMA_NAMES)
def test_llama_closed_form_omits_only_rmsnorm_weights(name):
    cfg = configs.get_model(name)
    omitted = accounting.param_count(cfg) - accounting.param_count_closed_form(cfg)
    assert omitted == (2 * cfg.n_layers + 1) * cfg.d_model


def test_closed_form_of_gpt3_175b():
    # V d + L (12 d^2 + 13 d) = 50257 * 12288 + 96 * (12 * 12288^2 + 13 * 12288)
    #                         = 617,558,016 + 96 * 1,812,099,072 = 174,579,068,928
    assert accounting.param_count_closed_form(configs.get_model("gpt3-175b")) == 174_579_068_928


# -------------------------------------------------------------------------------------------- model states


def test_lecture_notes_gpt3_175b_memory_table():
    # Lecture-notes slide (Xu 2026) "GPU HBM content during training", GPT-3 175B with N rounded to 175e9:
    # fp32 parameters, Adam momentum and variance 700 GB each; 16-bit parameters and gradients 350 GB each.
    states = accounting.model_state_bytes(175e9)
    assert states.rows() == [
        ("fp32 master parameters", 700 * GB),
        ("Adam first moment", 700 * GB),
        ("Adam second moment", 700 * GB),
        ("16-bit parameters", 350 * GB),
        ("16-bit gradients", 350 * GB),
    ]
    assert (states.params, states.grads) == (350 * GB, 350 * GB)
    assert (states.optimizer, states.total) == (2100 * GB, 2800 * GB)


@pytest.mark.parametrize(("stage", "gb_per_device"), [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1_example(stage, gb_per_device):
    # Rajbhandari et al. 2020, Fig. 1: Psi = 7.5B, N_d = 64, K = 12:
    # (2+2+K) Psi = 120 GB; 4 Psi + K Psi/N_d = 31.4 GB; 2 Psi + 14 Psi/N_d = 16.6 GB; 16 Psi/N_d = 1.9 GB.
    total = accounting.model_state_bytes(7.5e9, zero_stage=stage, dp=64).total
    assert total / GB == pytest.approx(gb_per_device, abs=0.05)


def test_zero_stage_3_shards_every_row():
    assert accounting.model_state_bytes(7.5e9, zero_stage=3, dp=64).total == 16 * 7.5e9 / 64


@pytest.mark.parametrize(
    ("billions", "bf16_gb", "fp32_grad_acc_gb"),
    [(1, 16, 20), (7, 112, 140), (70, 1120, 1400), (405, 6480, 8100)],
)
def test_ultrascale_playbook_mixed_precision_totals(billions, bf16_gb, fp32_grad_acc_gb):
    # Ultra-Scale Playbook, "Mixed precision training": 16 bytes per parameter (2 + 2 + 4 + 8), and
    # 20 with an fp32 gradient accumulator (Nanotron).
    n = billions * 1e9
    assert accounting.model_state_bytes(n, precision="mixed").total == bf16_gb * GB
    assert accounting.model_state_bytes(n, precision="fp32").total == bf16_gb * GB
    assert accounting.model_state_bytes(n, precision="mixed-fp32-grads").total == fp32_grad_acc_gb * GB


@pytest.mark.parametrize(
    ("precision", "optimizer", "bytes_per_param"),
    [
        ("fp32", "adam", 16),
        ("fp32", "sgd", 8),
        ("fp32", "sgd-momentum", 12),
        ("mixed", "sgd", 8),  # 2 + 2 + fp32 master 4
        ("mixed", "sgd-momentum", 12),
        ("mixed-fp32-grads", "adam", 20),
    ],
)
def test_bytes_per_parameter_by_precision_and_optimizer(precision, optimizer, bytes_per_param):
    states = accounting.model_state_bytes(1000, precision=precision, optimizer=optimizer)
    assert states.total == 1000 * bytes_per_param


def test_tensor_and_pipeline_parallelism_divide_every_row():
    sharded = accounting.model_state_bytes(175e9, tp=8, pp=16, zero_stage=1, dp=4)
    # 16-bit parameters and gradients: 2 * 175e9 / 128 each; optimizer: 12 * 175e9 / (128 * 4).
    assert (sharded.params, sharded.grads, sharded.optimizer) == (2_734_375_000, 2_734_375_000, 4_101_562_500)


def test_a_shard_that_does_not_divide_evenly_rounds_up():
    assert accounting.model_state_bytes(1001, zero_stage=3, dp=2).params == 1001  # ceil(2 * 1001 / 2)
    assert accounting.model_state_bytes(1001, zero_stage=3, dp=4).params == 501  # ceil(2002 / 4)


def test_a_model_config_stands_for_its_published_parameter_count():
    # meta-llama/Meta-Llama-3-8B: 8,030,261,248 parameters (safetensors total); mixed-precision Adam keeps
    # 2 + 2 bytes of 16-bit parameters and gradients and 4 + 4 + 4 of fp32 master copy and moments for each.
    states = accounting.model_state_bytes(configs.get_model("llama-3-8b"))
    n = 8_030_261_248
    assert (states.params, states.grads, states.optimizer, states.total) == (2 * n, 2 * n, 12 * n, 16 * n)


# ------------------------------------------------------------------------------------------------ activations

GPT3 = configs.get_model("gpt3-175b")
SBH = 2048 * 1 * 12288  # s b h for GPT-3 175B, s = 2048, micro-batch 1
# 5 a s / h = 5 * 96 * 2048 / 12288 = 80


@pytest.mark.parametrize(
    ("options", "bytes_per_layer"),
    [
        # Korthikanti et al. 2022: s b h (34 + 5 a s / h) = SBH * 114
        (dict(), SBH * 114),
        # tensor parallel t = 8: s b h (10 + 24/8 + 80/8) = SBH * 23
        (dict(tp=8), SBH * 23),
        # tensor + sequence parallel: s b h / 8 (34 + 80) = SBH * 14.25
        (dict(tp=8, sp=True), SBH * 114 // 8),
        # + selective recomputation: s b h / 8 * 34
        (dict(tp=8, sp=True, recompute="selective"), SBH * 34 // 8),
        # tensor parallel + selective recomputation: s b h (10 + 24/8)
        (dict(tp=8, recompute="selective"), SBH * 13),
        # full recomputation keeps the layer input, 2 s b h; sharded by SP
        (dict(recompute="full"), SBH * 2),
        (dict(tp=8, sp=True, recompute="full"), SBH * 2 // 8),
    ],
)
def test_korthikanti_activation_memory_for_gpt3_175b(options, bytes_per_layer):
    assert accounting.activation_bytes(GPT3, seq_len=2048, micro_batch=1, **options) == 96 * bytes_per_layer


def test_gpt3_175b_without_parallelism_needs_275_gb_of_activations_per_sequence():
    # 96 layers * 2048 * 12288 * 114 bytes = 275,414,777,856 bytes
    assert accounting.activation_bytes(GPT3, seq_len=2048, micro_batch=1) == 275_414_777_856


def test_selective_recomputation_saves_70_percent_for_gpt3_under_sp():
    # 1 - 34 / (34 + 80) = 0.70
    full = accounting.activation_bytes(GPT3, seq_len=2048, micro_batch=1, tp=8, sp=True)
    selective = accounting.activation_bytes(GPT3, seq_len=2048, micro_batch=1, tp=8, sp=True, recompute="selective")
    assert 1 - selective / full == pytest.approx(0.70, abs=0.005)


def test_activations_scale_linearly_with_micro_batch():
    one = accounting.activation_bytes(GPT3, seq_len=2048, micro_batch=1)
    assert accounting.activation_bytes(GPT3, seq_len=2048, micro_batch=4) == 4 * one


def test_activations_without_dropout_and_in_fp32():
    tiny = configs.gpt_like("tiny", vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=32)
    s, b, h, a = 32, 3, 64, 4
    # No dropout: 16 s b h elements and the softmax output a s^2 b, 2 bytes each.
    assert accounting.activation_bytes(tiny, seq_len=s, micro_batch=b, dropout=False) == 2 * (
        32 * s * b * h + 2 * a * s * s * b
    )
    # fp32 with dropout: 16 * 4 + 2 mask bytes per s b h; 2 * 4 + 1 per a s^2 b.
    assert accounting.activation_bytes(tiny, seq_len=s, micro_batch=b, dtype_bytes=4) == 2 * (
        66 * s * b * h + 9 * a * s * s * b
    )


# ------------------------------------------------------------------------------------------------------ FLOPs


def test_6nd_and_narayanans_count_agree_within_3_percent_for_gpt3_175b():
    # Attention scores add s / (6h) = 2.8 %, the logits V / (12 L h) = 0.4 %;
    # the embeddings inside 6ND's N take back 0.3 %.
    six_nd = accounting.training_flops(GPT3, 300e9)
    narayanan = accounting.training_flops_with_attention(GPT3, 300e9, seq_len=2048)
    assert narayanan / six_nd == pytest.approx(1.0274, abs=1e-3)


@pytest.mark.parametrize("recompute", [False, True])
def test_training_flops_with_attention_is_narayanans_equation(recompute):
    # Narayanan et al. 2021, Sec. 5.1: one iteration of B sequences of length s costs
    # 72 B s L h^2 (1 + s/(6h) + V/(12 L h)), or with recomputation 96 B s L h^2 (1 + s/(6h) + V/(16 L h)).
    B, s, L, h, V = 1536, 2048, 96, 12288, 50257
    if recompute:
        expected = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    else:
        expected = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    got = accounting.training_flops_with_attention(GPT3, B * s, seq_len=s, recompute=recompute)
    assert got == pytest.approx(expected, rel=1e-12)


def test_full_recomputation_turns_6nd_into_8nd():
    assert accounting.training_flops(175e9, 300e9) == 6 * 175e9 * 300e9
    assert accounting.training_flops(175e9, 300e9, recompute=True) == 8 * 175e9 * 300e9


def test_llama3_405b_pretraining_compute():
    # Grattafiori et al. 2024 (The Llama 3 Herd of Models): 405B parameters on 15.6T tokens, 3.8e25 FLOPs.
    flops = accounting.training_flops(configs.get_model("llama-3.1-405b"), 15.6e12)
    assert flops == pytest.approx(3.8e25, rel=0.01)


def test_flops_per_token_with_seq_len_counts_attention():
    cfg = configs.get_model("llama-3-8b")
    short, long = (accounting.flops_per_token(cfg, seq_len=s) for s in (2048, 4096))
    # Each extra position adds 3 * 4 L h FLOPs per token.
    assert long - short == 2048 * 3 * 4 * cfg.n_layers * cfg.d_model


@pytest.mark.parametrize("causal", [False, True])
def test_attention_flop_share_of_gpt3_from_narayanans_closed_form(causal):
    """GPT-3 175B per token forward: 24 L h^2 (weights), 4 L s h (Q K^T and P V, all s keys) and 2 h V (head);
    a causal mask leaves (s + 1) / 2 keys per query on average. The factor 3 of training cancels."""
    cfg = configs.get_model("gpt3-175b")
    L, h, V, s = cfg.n_layers, cfg.d_model, cfg.vocab_size, 2048
    attention = 4 * L * s * h * ((s + 1) / (2 * s) if causal else 1)
    expected = attention / (24 * L * h * h + attention + 2 * h * V)
    assert accounting.attention_flop_share(cfg, seq_len=s, causal=causal) == pytest.approx(expected, rel=1e-12)


def test_attention_is_57_percent_of_llama_405b_at_128k_in_the_mfu_convention_and_40_percent_executed():
    """The numbers Chapter 8 and the interview page state (issue 33): at 131,072 tokens."""
    cfg = configs.get_model("llama-3.1-405b")
    assert round(100 * accounting.attention_flop_share(cfg, seq_len=131072)) == 57
    assert round(100 * accounting.attention_flop_share(cfg, seq_len=131072, causal=True)) == 40
    with pytest.raises(ValueError, match="causal"):
        accounting.attention_flop_share(cfg, seq_len=8, causal="yes")


# ------------------------------------------------------------------------------------------- time and devices


def test_lecture_notes_gpu_estimate_for_gpt3():
    # Lecture-notes slide (Torres 2025): 6 x 175B x 300B / 160 TFLOP/s / (3600 * 24 * 30 s) "= 800 GPUs needed".
    # 6 * 175e9 * 300e9 = 3.15e23 FLOPs; one GPU over 30 days: 160e12 * 2,592,000 = 4.1472e20 FLOPs;
    # 3.15e23 / 4.1472e20 = 759.55, so 760 GPUs, "about 800".
    assert accounting.devices_needed(175e9, 300e9, days=30, peak_flops=160e12, mfu=1.0) == 760
    # The same as 51 % of an A100's 312 TFLOP/s.
    assert accounting.devices_needed(175e9, 300e9, days=30, peak_flops=312e12, mfu=160 / 312) == 760


def test_narayanan_gpt3_training_time():
    # Narayanan et al. 2021, Sec. 5.1: 8 T P / (n X) = 8 * 300e9 * 175e9 / (1024 * 140e12) s
    # = 2,929,687.5 s = 33.9 days, "about 34 days" for GPT-3 on 1024 A100s at 140 TFLOP/s.
    days = accounting.training_days(175e9, 300e9, 1024, 140e12, 1.0, recompute=True)
    assert days == pytest.approx(33.91, abs=0.01)


# Llama 3 8B by hand (L 32, h 4096, d_kv 1024, d_ff 14336, V 128256): N = 8,030,261,248 (published, above).
# Per layer W = 2 h^2 + 2 h d_kv + 3 h d_ff = 33,554,432 + 8,388,608 + 176,160,768 = 218,103,808 weights.
LLAMA3_8B_FLOPS_PER_TOKEN = {
    None: 6 * 8_030_261_248,  # 6 N = 48,181,567,488
    # 3 (2 L W + 4 L s h + 2 h V) at s = 8192: 3 (13,958,643,712 + 4,294,967,296 + 1,050,673,152) = 57,912,852,480
    8192: 3 * (2 * 32 * 218_103_808 + 4 * 32 * 8192 * 4096 + 2 * 4096 * 128_256),
}


@pytest.mark.parametrize("seq_len", [None, 8192])
def test_mfu_of_llama3_8b_by_hand(seq_len):
    # 1024 H100s (989.5 TFLOP/s dense bf16, the datasheet's 1,979 with sparsity halved) training 3.5M tokens/s.
    # MFU = FLOPs per token x tokens per second / (devices x peak); rel 1e-12: the same product in another order.
    per_token, tokens_per_second, n, peak = LLAMA3_8B_FLOPS_PER_TOKEN[seq_len], 3.5e6, 1024, 989.5e12
    expected = per_token * tokens_per_second / (n * peak)
    assert 0.16 < expected < 0.21  # 16.6 % without attention, 20.0 % with it
    cfg = configs.get_model("llama-3-8b")
    assert accounting.mfu(cfg, tokens_per_second, n, peak, seq_len=seq_len) == pytest.approx(expected, rel=1e-12)
    # The same run's training days, for 15T tokens: 15e12 x per_token / (1024 x 989.5e12 x MFU) / 86400.
    days = 15e12 * per_token / (n * peak * expected) / 86_400
    assert accounting.training_days(cfg, 15e12, n, peak, expected, seq_len=seq_len) == pytest.approx(days, rel=1e-12)
    assert days == pytest.approx(15e12 / 3.5e6 / 86_400, rel=1e-12)  # 49.6 days: tokens / tokens per second


def test_devices_needed_by_hand():
    # Llama 3.1 405B (N = 405,853,388,800, published) on 15.6T tokens in 30 days at 40 % of 989.5 TFLOP/s:
    # 6 N D = 3.7988e25 FLOPs; one GPU does 30 x 86,400 x 395.8e12 = 1.0259e21 in 30 days; 37,028.3, so 37,029.
    cfg = configs.get_model("llama-3.1-405b")
    flops = 6 * 405_853_388_800 * 15.6e12
    assert flops / (30 * 86_400 * 0.4 * 989.5e12) == pytest.approx(37_028.34, abs=0.005)
    assert accounting.devices_needed(cfg, 15.6e12, 30, 989.5e12, 0.4) == 37_029
    # A whole number of devices is not rounded up: 6 x 1e9 x 30.24e12 = 1.8144e23 FLOPs; one device does
    # 30 x 86,400 x 0.4 x 1e15 = 1.0368e21 in 30 days: exactly 175 devices (float division gives 175.00000000000003).
    # A thousand more tokens need a 176th.
    assert accounting.devices_needed(1e9, 30.24e12, 30, 1e15, 0.4) == 175
    assert accounting.devices_needed(1e9, 30.24e12 + 1e3, 30, 1e15, 0.4) == 176
    assert accounting.training_days(1e9, 30.24e12, 175, 1e15, 0.4) == pytest.approx(30, rel=1e-12)


# --------------------------------------------------------------------------------------------- guard rails


def test_accounting_and_configs_import_without_torch():
    package_root = str(Path(scalebook.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
    }
    code = "import sys, scalebook.accounting, scalebook.configs; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == "False"


def test_a_user_defined_model_needs_no_headline_size():
    tiny = dataclasses.replace(configs.get_model("gpt2"), name="tiny", n_layers=1, nominal_params=None)
    assert accounting.param_count(tiny) == 124_439_808 - 11 * (12 * 768**2 + 13 * 768)


# ------------------------------------------------------ activations of a Llama layer; pipeline stage memory
# (Measured against Hugging Face's LlamaDecoderLayer in tests/test_measure.py.)


def test_llama3_8b_layer_saves_41_sbh_not_the_gpt_layers_32():
    llama = configs.get_model("llama-3-8b")  # h 4096, d_kv 1024, d_ff 14336
    s, h = 8192, 4096
    # Fused attention, 16-bit, no dropout: 2 bytes x (6 h + 2 d_kv + 4 d_ff) per token
    # = 2 (24576 + 2048 + 57344) = 167,936 bytes = 41 h.
    per_layer = accounting.activation_bytes(llama, seq_len=s, micro_batch=1, dropout=False, attention="fused") // 32
    assert per_layer == s * 167_936 == 41 * s * h
    # Korthikanti et al.'s GPT constant without dropout would say 32 s b h: 28 % too little.
    assert per_layer / (32 * s * h) == pytest.approx(1.28, abs=0.005)


def test_explicit_attention_keeps_the_scores_and_repeats_k_and_v():
    llama = configs.get_model("llama-3-8b")
    s, a, h, d_kv = 8192, 32, 4096, 1024
    fused = accounting.activation_bytes(llama, seq_len=s, micro_batch=1, dropout=False, attention="fused")
    explicit = accounting.activation_bytes(llama, seq_len=s, micro_batch=1, dropout=False)
    # Per layer: the a s^2 softmax output (2 bytes) and K, V at width h instead of d_kv.
    assert explicit - fused == 32 * (2 * a * s * s + 2 * 2 * s * (h - d_kv))
    # Selective recomputation keeps what the fused kernel keeps.
    assert accounting.activation_bytes(llama, seq_len=s, micro_batch=1, dropout=False, recompute="selective") == fused


def test_fused_attention_and_selective_recomputation_keep_the_same_bytes_for_gpt3():
    for options in (dict(), dict(tp=8), dict(tp=8, sp=True)):
        assert accounting.activation_bytes(GPT3, seq_len=2048, micro_batch=1, attention="fused", **options) == (
            accounting.activation_bytes(GPT3, seq_len=2048, micro_batch=1, recompute="selective", **options)
        )


def test_llama_405b_busiest_pipeline_stage_is_the_second_and_does_not_fit_in_80_gb():
    from scalebook.accounting import pipeline

    cfg = configs.get_model("llama-3.1-405b")
    partition = pipeline.balanced_partition(pipeline.layer_costs(cfg, by="params"), 16)
    assert [len(r) for r in partition] == [7] + [8] * 14 + [7]
    stages = pipeline.stage_memory(cfg, partition, seq_len=8192, microbatches=16, tp=8, dp=128, sp=True,
                                   recompute="selective", dropout=False, zero_stage=1)  # fmt: skip
    # By hand for stage 1: 8 layers of 2 h^2 + 2 h d_kv + 3 h d_ff + 2 h parameters (attention, SwiGLU,
    # two RMSNorm weights), split 8 ways by TP; ZeRO-1 keeps 2 + 2 bytes of each and 12 / 128.
    h, d_kv, d_ff = 16384, 1024, 53248
    params = 8 * (2 * h * h + 2 * h * d_kv + 3 * h * d_ff + 2 * h) // 8
    states = 2 * params + 2 * params + -(-12 * params // 128)  # the largest shard, rounded up
    # Activations: 8 layers x 15 micro-batches in flight (1F1B, P - 1) x s (12 h + 4 d_kv + 8 d_ff) / t.
    activations = 8 * 15 * 8192 * (12 * h + 4 * d_kv + 8 * d_ff) // 8
    busiest = max(stages, key=lambda stage: stage.total)
    assert busiest is stages[1] and busiest.in_flight == 15
    assert busiest.states == states
    assert busiest.activations == activations
    assert stages[0].total < busiest.total and busiest.total > 80e9  # about 90 GB
    # The 7-layer first stage holds 16 micro-batches: 7 x 16 = 112 layer-activations against 8 x 15 = 120.
    assert stages[0].activations == 7 * 16 * 8192 * (12 * h + 4 * d_kv + 8 * d_ff) // 8


def test_one_pipeline_stage_holds_the_whole_model_once():
    from scalebook.accounting import pipeline

    gpt2 = configs.get_model("gpt2")  # tied embedding: one copy when nothing is split
    (stage,) = pipeline.stage_memory(gpt2, [range(12)], seq_len=1024, microbatches=4)
    assert stage.states == accounting.model_state_bytes(gpt2).total
    assert stage.activations == accounting.activation_bytes(gpt2, seq_len=1024, micro_batch=1)
    with pytest.raises(ValueError, match="partition must split the 12 layers"):
        pipeline.stage_memory(gpt2, [range(6), range(7, 12)], seq_len=1024, microbatches=4)


def test_megatrons_gpt3_width_run_is_about_35_percent_mfu_and_needs_about_1100_a100s():
    # Narayanan et al. 2021, Table 1: the 145.6B model (h = 12288, L = 80, V = 51200, s = 2048) ran at
    # 148 TFLOP/s per A100 counted with full recomputation. Their per-iteration counts give the ratio of
    # model to hardware FLOPs by hand: 72 (1 + s/6h + V/12Lh) against 96 (1 + s/6h + V/16Lh).
    h, L, V, s, peak = 12288, 80, 51200, 2048, 312e12
    megatron = configs.gpt_like("m", vocab_size=V, d_model=h, n_layers=L, n_heads=96, max_seq_len=s)
    tokens_per_second = 148e12 / accounting.flops_per_token(megatron, seq_len=s, recompute=True)
    mfu = accounting.mfu(megatron, tokens_per_second, 1, peak, seq_len=s)
    by_hand = 148e12 / peak * 72 * (1 + s / (6 * h) + V / (12 * L * h)) / (96 * (1 + s / (6 * h) + V / (16 * L * h)))
    assert mfu == pytest.approx(by_hand, rel=1e-12)
    assert 0.35 < mfu < 0.36 < 160e12 / peak  # the "160 TFLOP/s" of the 800-GPU estimate is no MFU
    # GPT-3 175B (h = 12288, L = 96, V = 50257) on 300B tokens in 30 days at that MFU, model FLOPs with attention.
    gpt3 = configs.get_model("gpt3-175b")
    flops = 300e9 * 72 * 96 * h * h * (1 + s / (6 * h) + 50257 / (12 * 96 * h))
    expected = -(-flops // (30 * 86400 * peak * mfu))
    assert accounting.devices_needed(gpt3, 300e9, days=30, peak_flops=peak, mfu=mfu, seq_len=s) == expected
    assert 1050 <= expected <= 1150  # "about 1,100", where 160 TFLOP/s gives 760


def test_attention_is_a_small_share_of_the_tiny_gpts_flops():
    # Chapter 1's tiny GPT: h = 128, L = 4, V = 256, s = 128. Per token, forward: 2 * 12 h^2 per layer for
    # the weights, 4 s h per layer for QK^T and PV, 2 h V for the head; training triples each. By hand the
    # attention share is 4 s h L / (24 h^2 L + 4 s h L + 2 h V) = 262,144 / 1,900,544 = 4/29, about 14 %.
    tiny = configs.gpt_like("tiny", vocab_size=256, d_model=128, n_layers=4, n_heads=4, max_seq_len=128)
    attention = 3 * 4 * 128 * 128 * 4
    share = attention / accounting.flops_per_token(tiny, seq_len=128)
    assert share == pytest.approx(4 / 29, rel=1e-12)
    assert share < 0.20  # a minority of the work, not "comparable" to the weight FLOPs


def test_llama_3_1_405b_mlp_is_3_25_h_wide():
    # Llama 3 paper, Table 3: model dimension 16,384, FFN dimension 53,248.
    cfg = configs.get_model("llama-3.1-405b")
    assert cfg.d_ff / cfg.d_model == 3.25
    parts = accounting.param_breakdown(cfg)
    assert parts["MLP weights"] == 126 * 3 * 16384 * 53248
