"""accounting.parameter_split: what one rank holds when a model is cut over tp x pp GPUs, against hand counts."""

import pytest

from scalebook import configs
from scalebook.accounting import param_count
from scalebook.accounting.model_split import parameter_split


def per_rank(pieces, *stages):
    """Parameters on one rank of a stage that is each of ``stages`` (with pp = 1: both "first" and "last")."""
    return sum(p.per_rank for p in pieces.values() if p.stages in ("every", *stages))


def test_llama3_70b_per_rank_counts_at_tp8_pp8_match_a_hand_count():
    # Llama 3 70B: h = 8192, d_kv = 8 heads x 128 = 1024, d_ff = 28672, L = 80, V = 128256, untied head.
    # One rank, one layer: W_Q and W_O 8192^2/8 = 8,388,608 each; W_K, W_V 8192 x 1024/8 = 1,048,576 each;
    # W_gate, W_up, W_down 8192 x 28672/8 = 29,360,128 each; two RMSNorms 2 x 8192 = 16,384 (replicated).
    one_layer = 2 * 8_388_608 + 2 * 1_048_576 + 3 * 29_360_128 + 16_384
    assert one_layer == 106_971_136
    middle = 10 * one_layer  # 80 layers / 8 stages
    embedding = 131_334_144  # 128256 x 8192 / 8, and the same for the head
    pieces = parameter_split(configs.get_model("llama-3-70b"), tp=8, pp=8)
    assert per_rank(pieces, "first") == middle + embedding == 1_201_045_504
    assert per_rank(pieces, "last") == middle + embedding + 8192 == 1_201_053_696  # + the final norm
    assert {name: p.split for name, p in pieces.items()} == {
        "token embedding": "vocabulary", "W_Q": "columns", "W_K": "columns", "W_V": "columns",
        "W_gate": "columns", "W_up": "columns", "W_O": "rows", "W_down": "rows",
        "norms (two per layer)": "replicated", "final norm": "replicated", "LM head": "vocabulary",
    }  # fmt: skip
    assert sum(p.total for p in pieces.values()) == param_count(configs.get_model("llama-3-70b"))


def test_tied_gpt_at_tp2_matches_a_hand_count():
    # A GPT with h = 8, d_ff = 32, L = 2, V = 16, n_ctx = 4, biases, LayerNorms, tied head; tp = 2, pp = 1.
    cfg = configs.ModelConfig(name="hand", arch="gpt", vocab_size=16, d_model=8, n_layers=2, n_heads=2,
                              n_kv_heads=2, d_ff=32, max_seq_len=4, tied_embeddings=True, bias=True,
                              norm="layernorm", mlp="gelu")  # fmt: skip
    # Per layer on one rank: W_QKV 8 x 24 / 2 = 96, its bias 24/2 = 12, W_1 8 x 32 / 2 = 128, its bias 16,
    # W_O 64/2 = 32 and its bias 8 (replicated), W_2 32 x 8 / 2 = 128 and its bias 8 (replicated),
    # two LayerNorms 2 x 16 = 32: 460. Two layers 920, + wte 16 x 8 / 2 = 64, wpe 4 x 8 = 32, ln_f 16.
    assert per_rank(parameter_split(cfg, tp=2), "first", "last") == 920 + 64 + 32 + 16 == 1032
    # pp = 2: the last stage keeps a copy of the tied matrix as its head: 460 + 16 + 64.
    assert per_rank(parameter_split(cfg, tp=2, pp=2), "last") == 540


@pytest.mark.parametrize("tp, pp", [(3, 1), (1, 3), (128, 1)])
def test_layouts_that_do_not_divide_are_refused(tp, pp):
    # Llama 3 8B: 32 heads and 8 KV heads (tp 3), 32 layers (pp 3), 8 KV heads (tp 128).
    with pytest.raises(ValueError, match="must divide"):
        parameter_split(configs.get_model("llama-3-8b"), tp=tp, pp=pp)
