"""Positional encodings: sinusoidal against its closed form and the classic implementation, RoPE against
Hugging Face's Llama and against its defining properties (relative positions, norms), ALiBi against Hugging
Face's BLOOM, learned positions against the accounting."""

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from scalebook import configs
from scalebook.accounting import param_breakdown
from scalebook.model import GPT, GPTConfig
from scalebook.positions import (
    LearnedPositions,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    interleaved_to_half_permutation,
    rope_cache,
    sinusoidal_positions,
)

# float64 sin/cos of the same angle computed by two routes (pow vs exp/log) agree to ~1e-16 relative
# in the angle; at positions up to 512 that is ~1e-13 absolute, so 1e-10 leaves a wide margin.
F64_ATOL = 1e-10


def rotate(x, cos, sin, positions):
    """RoPE on a (n, head_dim) batch of vectors, row t at position positions[t], through the public API."""
    return apply_rope(x[None, None], cos[positions], sin[positions])[0, 0]


def test_sinusoidal_matches_closed_form():
    seq_len, d_model = 50, 16
    table = sinusoidal_positions(seq_len, d_model, dtype=torch.float64)
    for pos in range(seq_len):
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=F64_ATOL)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=F64_ATOL)


def test_sinusoidal_matches_annotated_transformer_implementation():
    # The Annotated Transformer's PositionalEncoding (Harvard NLP): frequencies through exp and log,
    # sines and cosines written into strided column slices.
    seq_len, d_model = 512, 64
    pe = torch.zeros(seq_len, d_model, dtype=torch.float64)
    position = torch.arange(seq_len, dtype=torch.float64).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * -(math.log(10000.0) / d_model))
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    ours = sinusoidal_positions(seq_len, d_model, dtype=torch.float64)
    torch.testing.assert_close(ours, pe, atol=F64_ATOL, rtol=0)
    # float32 tables round the angle pos * theta to 2^-24 relative: ~3e-5 absolute at position 511.
    torch.testing.assert_close(sinusoidal_positions(seq_len, d_model), pe.float(), atol=1e-4, rtol=0)


def test_sinusoidal_shift_by_k_is_a_fixed_rotation():
    # Vaswani et al.: PE(pos + k) is a linear function of PE(pos), the same for every pos. Each
    # (sin, cos) pair at frequency w turns by the angle k w.
    seq_len, d_model, k = 200, 32, 7
    table = sinusoidal_positions(seq_len + k, d_model, dtype=torch.float64)
    rotation = torch.zeros(d_model, d_model, dtype=torch.float64)
    for i in range(d_model // 2):
        a = k / 10000 ** (2 * i / d_model)
        # [sin(x + a), cos(x + a)] = [[cos a, sin a], [-sin a, cos a]] @ [sin x, cos x]
        rotation[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor(
            [[math.cos(a), math.sin(a)], [-math.sin(a), math.cos(a)]], dtype=torch.float64
        )
    torch.testing.assert_close(table[k:], table[:seq_len] @ rotation.T, atol=F64_ATOL, rtol=0)


def test_rope_dot_product_depends_only_on_relative_position():
    gen = torch.Generator().manual_seed(0)
    n, head_dim, max_pos = 500, 64, 4096
    q = torch.randn(n, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(n, head_dim, generator=gen, dtype=torch.float64)
    m, pos_n, c = (torch.randint(0, max_pos, (n,), generator=gen) for _ in range(3))
    cos, sin = rope_cache(2 * max_pos, head_dim, dtype=torch.float64)
    before = (rotate(q, cos, sin, m) * rotate(k, cos, sin, pos_n)).sum(-1)
    shifted = (rotate(q, cos, sin, m + c) * rotate(k, cos, sin, pos_n + c)).sum(-1)
    # float64: dot products of size ~|q||k| = 64 carry ~1e-12 of rounding at positions up to 8192.
    torch.testing.assert_close(shifted, before, atol=1e-9, rtol=0)
    # Not a tautology: the score does change with the distance m - n.
    moved = (rotate(q, cos, sin, m + 1) * rotate(k, cos, sin, pos_n)).sum(-1)
    assert (moved - before).abs().max() > 0.1


def test_rope_relative_property_holds_in_float32_to_1e_5():
    # Unit vectors make the score a cosine in [-1, 1]. float32 angles m * theta are rounded to 2^-24
    # relative, ~6e-5 rad at position 1023, of which the cosine sees ~2e-6: 1e-5 keeps a 4x margin.
    gen = torch.Generator().manual_seed(1)
    n, head_dim, max_pos = 2000, 64, 512
    q = torch.nn.functional.normalize(torch.randn(n, head_dim, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(n, head_dim, generator=gen), dim=-1)
    m, pos_n, c = (torch.randint(0, max_pos, (n,), generator=gen) for _ in range(3))
    cos, sin = rope_cache(2 * max_pos, head_dim)
    before = (rotate(q, cos, sin, m) * rotate(k, cos, sin, pos_n)).sum(-1)
    shifted = (rotate(q, cos, sin, m + c) * rotate(k, cos, sin, pos_n + c)).sum(-1)
    torch.testing.assert_close(shifted, before, atol=1e-5, rtol=0)


def test_rope_preserves_norms():
    x = torch.randn(2, 3, 300, 32, generator=torch.Generator().manual_seed(2))
    cos, sin = rope_cache(300, 32)
    # A rotation changes each norm (~5.7 here) only by float32 rounding: 1e-5 relative.
    torch.testing.assert_close(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1), atol=0, rtol=1e-5)


@pytest.mark.parametrize("base", [10000.0, 500000.0])  # Llama 2 and Llama 3 (rope_theta)
def test_rope_matches_hf_llama(base):
    n_heads, n_kv_heads, head_dim, seq_len = 4, 2, 32, 300
    config = LlamaConfig(
        hidden_size=n_heads * head_dim,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": base},
    )
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, n_heads, seq_len, head_dim, generator=gen)
    k = torch.randn(2, n_kv_heads, seq_len, head_dim, generator=gen)
    position_ids = torch.arange(seq_len).expand(2, seq_len)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(q, position_ids)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    cos, sin = rope_cache(seq_len, head_dim, base=base)
    # Same float32 angles, same formula: agreement to 1e-6 (in practice bit for bit).
    torch.testing.assert_close(apply_rope(q, cos, sin), hf_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(apply_rope(k, cos, sin), hf_k, atol=1e-6, rtol=0)


def interleaved_rope_reference(x, base=10000.0):
    """RoPE as RoFormer and Meta's original Llama code write it: dimension pairs (2j, 2j+1) are complex
    numbers, multiplied by exp(i * pos * theta_j)."""
    seq_len, head_dim = x.shape[-2:]
    theta = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), theta)
    rotations = torch.polar(torch.ones_like(angles), angles)
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], head_dim // 2, 2))
    return torch.view_as_real(pairs * rotations).flatten(-2)


def test_rotate_half_equals_interleaved_rope_after_permutation():
    x = torch.randn(2, 3, 64, 16, generator=torch.Generator().manual_seed(4))
    cos, sin = rope_cache(64, 16)
    perm = interleaved_to_half_permutation(16)
    assert perm.tolist() == [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
    reference = interleaved_rope_reference(x)
    # Complex and real arithmetic round differently: a few ulps of values of size ~3.
    torch.testing.assert_close(apply_rope(x[..., perm], cos, sin), reference[..., perm], atol=1e-5, rtol=0)
    # The conventions really differ: without the permutation they disagree at O(1).
    assert (apply_rope(x, cos, sin) - reference).abs().max() > 0.5


def bloom_alibi(n_heads, seq_len):
    """Hugging Face BLOOM's ALiBi for one unpadded sequence, (n_heads, seq_len): slope_k * j for key j. It
    leaves out the -slope_k * i of query i, a constant per row that softmax ignores."""
    return build_alibi_tensor(torch.ones(1, seq_len, dtype=torch.long), n_heads, torch.float32)[:, 0, :]


# 8 heads: a power of two; 6: 4 + 2 heads filled in from the 8-head sequence (BLOOM's rule). Both have slopes
# that are powers of two (2^-1 .. 2^-8), so every product below is exact in float32 and equality is exact.
@pytest.mark.parametrize("n_heads", [8, 6])
def test_alibi_bias_equals_hf_bloom_exactly(n_heads):
    seq_len = 40
    hf = bloom_alibi(n_heads, seq_len)
    slopes = hf[:, 1]  # key 1: slope_k * 1
    assert torch.equal(alibi_slopes(n_heads), slopes)
    i = torch.arange(seq_len)[:, None]
    # HF's slope_k * j, shifted by slope_k * i per query row, is the causal bias -slope_k * (i - j).
    expected = (hf[:, None, :] - slopes[:, None, None] * i).masked_fill(i < torch.arange(seq_len), float("-inf"))
    assert torch.equal(alibi_bias(n_heads, seq_len), expected)


# 12 = 8 + 4 (interleaved from the 16-head sequence) and BLOOM-176B's 112 = 64 + 48. HF raises a float32 base
# 2^(-8/n') to the power k <= 64, carrying the base's rounding k times (up to 64 * 2^-24 ~ 4e-6 relative);
# ours rounds each slope once from float64. Measured: 5e-7 at 112 heads.
@pytest.mark.parametrize("n_heads", [12, 112])
def test_alibi_slopes_match_hf_bloom_for_other_head_counts(n_heads):
    torch.testing.assert_close(alibi_slopes(n_heads), bloom_alibi(n_heads, 2)[:, 1], rtol=5e-6, atol=0)


def test_alibi_attention_equals_hf_bloom_attention():
    # What the bias is for: softmax(scores + bias). HF adds slope * j and masks j > i; softmax is blind to
    # the per-row constant that separates the two biases, but HF's logits reach 0.5 x 63 ~ 32, where float32's
    # spacing is 4e-6: the weights (<= 1) differ by up to ~1.5e-6 (measured over seeds), so 1e-5 absolute.
    n_heads, seq_len = 12, 64
    scores = torch.randn(n_heads, seq_len, seq_len, generator=torch.Generator().manual_seed(5))
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    hf = (scores + bloom_alibi(n_heads, seq_len)[:, None, :]).masked_fill(~causal, float("-inf")).softmax(-1)
    torch.testing.assert_close((scores + alibi_bias(n_heads, seq_len)).softmax(-1), hf, atol=1e-5, rtol=0)


def test_learned_positions_cost_max_seq_len_times_d_model():
    gpt2 = configs.get_model("gpt2")
    table = LearnedPositions(gpt2.max_seq_len, gpt2.d_model)
    n_params = sum(p.numel() for p in table.parameters())
    assert n_params == param_breakdown(gpt2)["position embedding"] == 1024 * 768
    model = GPT(GPTConfig(vocab_size=64, block_size=48, n_layer=1, n_head=2, n_embd=32))
    assert LearnedPositions(48, 32).table.weight.shape == model.wpe.weight.shape
    assert table(10).shape == (10, 768)


@pytest.mark.parametrize(
    "call",
    [
        lambda: rope_cache(16, 63),
        lambda: rope_cache(0, 64),
        lambda: rope_cache(16, 64, base=1.0),
        lambda: sinusoidal_positions(8, 7),
        lambda: apply_rope(torch.zeros(3, 8, 16), *rope_cache(8, 16)),
        lambda: apply_rope(torch.zeros(1, 2, 8, 16), *rope_cache(9, 16)),
        lambda: apply_rope(torch.zeros(1, 2, 8, 15), torch.zeros(8, 15), torch.zeros(8, 15)),
        lambda: LearnedPositions(0, 8),
        lambda: LearnedPositions(16, 8)(17),
        lambda: interleaved_to_half_permutation(5),
        lambda: alibi_slopes(0),
        lambda: alibi_bias(8, 0),
    ],
    ids=[
        "odd head_dim",
        "empty cache",
        "base 1",
        "odd d_model",
        "3-D x",
        "cache too long",
        "odd x head_dim",
        "empty table",
        "past the table",
        "odd permutation",
        "no heads",
        "empty bias",
    ],
)
def test_bad_input_raises_value_error(call):
    with pytest.raises(ValueError):
        call()
