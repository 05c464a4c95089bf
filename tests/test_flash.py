"""scalebook.flash: FlashAttention-2's tiled forward and recomputing backward against PyTorch's attention."""

import pytest
import torch
import torch.nn.functional as F

from scalebook import configs
from scalebook.attention import attention_saved_bytes, saved_for_backward, scaled_dot_product_attention
from scalebook.flash import (
    HBMTraffic,
    attention_hbm_bytes,
    flash_attention,
    flash_attention_forward,
    flash_block_sizes,
    online_softmax_stats,
)

# fp32: the tiled loop adds the same s terms as SDPA in another order (block by block, each block rescaled
# by exp(m_old - m_new)), so results differ by reassociation only: a few ulps per sum, measured <= 8e-7
# relative here. 1e-5 leaves 10x margin; a wrong rescaling or a missed tile errs by 1e-2 to 1.
# fp64: the same reassociation at eps = 2.2e-16 gives ~1e-15; 1e-12 is tight and still 1000x the noise.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}

# (batch, heads, s, d, block_q, block_k): tiles that divide s, tiles that do not (uneven, Br != Bc), a tile
# larger than s, and head dims 16 to 128.
SHAPES = [
    (2, 3, 64, 32, 16, 16),
    (1, 2, 37, 16, 8, 5),
    (2, 1, 50, 64, 64, 7),
    (1, 1, 19, 128, 4, 32),
]


def _qkv(batch, heads, s, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, s, d, generator=gen, dtype=dtype, requires_grad=True) for _ in range(3)]


def _max_relative_error(ours, reference):
    return ((ours - reference).abs().max() / reference.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("batch", "heads", "s", "d", "block_q", "block_k"), SHAPES)
def test_flash_attention_matches_sdpa_outputs_and_gradients(dtype, causal, batch, heads, s, d, block_q, block_k):
    q, k, v = _qkv(batch, heads, s, d, dtype)
    grad_out = torch.randn(batch, heads, s, d, generator=torch.Generator().manual_seed(1), dtype=dtype)
    ours = flash_attention(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    ours_grads = torch.autograd.grad(ours, (q, k, v), grad_out)
    reference_grads = torch.autograd.grad(reference, (q, k, v), grad_out)
    for name, a, b in zip(("O", "dq", "dk", "dv"), (ours, *ours_grads), (reference, *reference_grads), strict=True):
        assert _max_relative_error(a, b) < TOLERANCE[dtype], name


def test_autograd_function_passes_gradcheck_in_fp64():
    # Finite differences of the tiled forward against the recomputing backward: no reference involved.
    q, k, v = (t.detach()[:, :, :9, :4].requires_grad_() for t in _qkv(1, 2, 9, 4, torch.float64))
    assert torch.autograd.gradcheck(lambda *qkv: flash_attention(*qkv, causal=True, block_q=4, block_k=3), (q, k, v))


def test_a_custom_scale_and_cross_attention_lengths_match_sdpa():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 11, 8, generator=gen, dtype=torch.float64)
    k, v = (
        torch.randn(2, 23, 8, generator=gen, dtype=torch.float64),
        torch.randn(2, 23, 6, generator=gen, dtype=torch.float64),
    )
    ours = flash_attention(q, k, v, block_q=4, block_k=6, scale=0.3)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, scale=0.3), rtol=1e-12, atol=1e-12)


def test_bf16_inputs_keep_float32_statistics():
    # bf16 has 8 bits of precision (relative step 2^-8 = 0.4 %): O is rounded once, at the end, so it sits
    # within 1 % of the float32 result of the same bf16 inputs; the log-sum-exp stays float32, as in the kernels.
    q, k, v = (t.detach().to(torch.bfloat16) for t in _qkv(1, 2, 40, 16, torch.float32))
    o, lse = flash_attention_forward(q, k, v, causal=True, block_q=16, block_k=16)
    assert (o.dtype, lse.dtype) == (torch.bfloat16, torch.float32)
    reference, weights = scaled_dot_product_attention(*(t.float() for t in (q, k, v)), causal=True)
    assert _max_relative_error(o.float(), reference) < 1e-2
    scores = q.float() @ k.float().transpose(-2, -1) / 4 + torch.full((40, 40), float("-inf")).triu(1)
    torch.testing.assert_close(lse, scores.logsumexp(dim=-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [1, 3, 16, 100])
def test_online_softmax_stats_give_softmax_and_logsumexp(block):
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 20  # large scores
    m, ell = online_softmax_stats(x, block)
    torch.testing.assert_close(torch.exp(x - m[:, None]) / ell[:, None], torch.softmax(x, dim=-1), rtol=1e-14, atol=0)
    torch.testing.assert_close(m + torch.log(ell), torch.logsumexp(x, dim=-1), rtol=1e-14, atol=0)


@pytest.mark.parametrize("s", [64, 128, 256])
def test_saved_for_backward_is_q_k_v_o_and_one_logsumexp_per_row(s):
    # O(s): 4 b h s d numbers plus b h s float32 L's, the same terms as PyTorch's fused kernel keeps.
    b, h, d = 2, 2, 16
    q, k, v = _qkv(b, h, s, d, torch.float32)
    saved = saved_for_backward(lambda *qkv: flash_attention(*qkv, causal=True, block_q=32, block_k=32), q, k, v)
    assert saved.total_bytes == 4 * b * h * s * (4 * d + 1)
    assert saved.total_bytes == sum(attention_saved_bytes(b, s, h, d, impl="sdpa").values())
    # The explicit path of the same call keeps P, b h s^2 numbers, on top of q, k, v (and the s x s mask).
    explicit = saved_for_backward(lambda *qkv: scaled_dot_product_attention(*qkv, causal=True)[0], q, k, v)
    assert explicit.total_bytes == 4 * b * h * s * (3 * d + s) + s * s


@pytest.mark.parametrize(("s", "d", "block_q", "block_k"), [(128, 16, 32, 32), (100, 8, 24, 10)])
def test_forward_reads_and_writes_what_attention_hbm_bytes_counts(s, d, block_q, block_k):
    q, k, v = (t.detach()[0, 0] for t in _qkv(1, 1, s, d, torch.float32))
    traffic = HBMTraffic()
    flash_attention_forward(q, k, v, block_q=block_q, block_k=block_k, traffic=traffic)
    assert traffic.total == attention_hbm_bytes(s, d, impl="flash", block_q=block_q, dtype_bytes=4)


def test_causal_forward_skips_the_tiles_above_the_diagonal():
    s, d, block = 128, 16, 32
    q, k, v = (t.detach()[0, 0] for t in _qkv(1, 1, s, d, torch.float32))
    full, causal = HBMTraffic(), HBMTraffic()
    flash_attention_forward(q, k, v, block_q=block, block_k=block, traffic=full)
    flash_attention_forward(q, k, v, block_q=block, block_k=block, traffic=causal, causal=True)
    tiles = s // block
    kv_tile_bytes = 2 * block * d * 4
    # Query tile i reads key tiles 0..i: 1 + 2 + 3 + 4 = 10 of the 16.
    assert full.total - causal.total == (tiles * tiles - tiles * (tiles + 1) // 2) * kv_tile_bytes


def test_h100_tile_sizes_from_its_shared_memory():
    h100 = configs.get_hardware("h100-sxm")
    # 228 KB = 233,472 bytes = 116,736 bf16 numbers; B_c = floor(M / 4d), B_r = min(B_c, d).
    assert flash_block_sizes(h100, 128) == (128, 228)
    assert flash_block_sizes(h100, 64) == (64, 456)
    assert flash_block_sizes(h100, 128, dtype_bytes=4) == (114, 114)


@pytest.mark.parametrize("d", [64, 128])
def test_flash_with_query_tiles_of_d_rows_moves_half_the_bytes_of_standard_attention(d):
    """FlashAttention-2's loop with the query tile of Algorithm 1 (B_r = min(M / 4d, d) = d here, the 128-row
    tile the released kernels use for d = 128): K and V pass the chip once per query tile, 2 n^2 d / B_r = 2 n^2
    numbers, against standard attention's 4 n^2 (Algorithm 0)."""
    h100 = configs.get_hardware("h100-sxm")
    block, _ = flash_block_sizes(h100, d)
    assert block == d
    for n in (4096, 16384, 65536):
        flash = attention_hbm_bytes(n, d, impl="flash", block_q=block)
        standard = attention_hbm_bytes(n, d, impl="standard")
        assert standard == 2 * (4 * n * d + 4 * n * n)  # Algorithm 0, bf16
        assert flash == 2 * (2 * n * d + 2 * n * n) + 4 * n  # Q read, O written, K and V n / d times, float32 L's
        assert 1.9 < standard / flash < 2  # 4 n^2 + 4 n d over 2 n^2 + 2 n d + 2 n (the L's): just under 2


def test_flash_with_the_sram_limited_tile_of_a_wide_head_moves_more_than_standard_attention():
    """At d = 256 an H100's SRAM holds M / 4d = 114 rows per tile: K and V pass n / 114 times, 2 n^2 256 / 114
    = 4.5 n^2 numbers, more than standard attention's 4 n^2 (Chapter 4, Exercise 7)."""
    h100 = configs.get_hardware("h100-sxm")
    block, _ = flash_block_sizes(h100, 256)
    assert block == 114
    n = 16384
    assert attention_hbm_bytes(n, 256, impl="flash", block_q=block) > attention_hbm_bytes(n, 256, impl="standard")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda q: flash_attention(q, q, q, block_q=0), "block_q must be an integer >= 1"),
        (lambda q: flash_attention(q, q, q, block_k=2.5), "block_k must be an integer >= 1"),
        (lambda q: flash_attention(q, q[..., :5, :], q[..., :5, :], causal=True), "causal=True needs as many"),
        (lambda q: flash_attention(q, q.double(), q), "share one floating dtype"),
        (lambda q: flash_attention(q, q[..., :3], q), "same feature size"),
        (lambda q: flash_block_sizes(configs.get_hardware("b200"), 128), "has no smem_per_sm_bytes"),
        (lambda q: flash_block_sizes(configs.get_hardware("h100-sxm"), 100_000), "too wide"),
        (lambda q: attention_hbm_bytes(64, 16, impl="paged"), "impl must be one of"),
        (lambda q: attention_hbm_bytes(64, 16, impl="flash"), "block_q"),
        (lambda q: online_softmax_stats(q, 0), "block must be an integer >= 1"),
    ],
)
def test_bad_input_says_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.randn(1, 8, 4))
