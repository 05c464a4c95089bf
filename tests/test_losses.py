"""losses.chunked_cross_entropy equals F.cross_entropy(lm_head(h), y) in loss and gradients, and holds one
chunk's logits at a time; accounting.logits counts the bytes by hand."""

import pytest
import torch
import torch.nn.functional as F

from scalebook.accounting.logits import cross_entropy_peak_bytes, logits_bytes
from scalebook.losses import chunked_cross_entropy
from scalebook.measure import peak_allocated_bytes


def _problem(dtype, *, b=3, s=50, d=24, vocab=700):
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(d, vocab, bias=False, dtype=dtype)
    h = torch.randn(b, s, d, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (b, s))
    targets[0, ::5] = -100  # F.cross_entropy's ignore_index: not counted in the mean
    return lm_head, h, targets


def _loss_and_grads(loss, lm_head, h):
    # 2.5 x the loss: the backward must scale by the gradient it receives, not assume 1
    grad_h, grad_w = torch.autograd.grad(2.5 * loss, (h, lm_head.weight))
    return loss.detach(), grad_h, grad_w


@pytest.mark.parametrize(
    ("dtype", "rtol"),
    [
        # float64: the two sum the same terms in a different order (chunks, logsumexp by hand); 1e-12 is
        # ~10^4 ulps of headroom over sums of ~10^3 terms.
        (torch.float64, 1e-12),
        # float32: the same reordering at eps = 1.2e-7; over sums of ~700 logits and 150 tokens the
        # observed differences are ~1e-6 relative, so 1e-5 fails any real error (a wrong scale, a missed
        # token) but not rounding.
        (torch.float32, 1e-5),
    ],
)
@pytest.mark.parametrize("chunk_size", [32, 150, 1000])  # ragged last chunk (150 = 4 x 32 + 22), exact, one chunk
def test_chunked_cross_entropy_matches_torch(dtype, rtol, chunk_size):
    lm_head, h, targets = _problem(dtype)
    expected = _loss_and_grads(F.cross_entropy(lm_head(h).flatten(0, 1), targets.flatten()), lm_head, h)
    got = _loss_and_grads(chunked_cross_entropy(h, lm_head.weight, targets, chunk_size=chunk_size), lm_head, h)
    for name, ours, theirs in zip(("loss", "grad h", "grad W"), got, expected, strict=True):
        scale = theirs.abs().max()
        assert (ours - theirs).abs().max() <= rtol * scale, name


def test_peak_allocated_bytes_counts_live_tensors():
    def run():
        a = torch.empty(1000)  # 4,000 bytes
        b = torch.empty(500)  # + 2,000
        del a  # 2,000 held
        c = torch.empty(2000)  # + 8,000: the peak, 10,000
        return b, c

    assert peak_allocated_bytes(run) == 10_000


def test_chunked_loss_holds_one_chunk_of_logits():
    n, d, vocab, chunk = 512, 16, 4096, 64
    torch.manual_seed(0)
    h = torch.randn(n, d, requires_grad=True)
    weight = torch.randn(vocab, d, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))

    def unchunked():
        F.cross_entropy(h @ weight.T, targets).backward()

    def chunked():
        chunked_cross_entropy(h, weight, targets, chunk_size=chunk).backward()

    # By hand: three fp32 copies of the 512 x 4096 logits; one 64 x 4096 chunk plus the weight's gradient
    # (4096 x 16), h's gradient (512 x 16), a chunk times the weight (64 x 16) and the saved logsumexps.
    assert cross_entropy_peak_bytes(vocab, n, d) == 3 * 512 * 4096 * 4
    predicted = cross_entropy_peak_bytes(vocab, n, d, chunk_tokens=chunk)
    assert predicted == 4 * (64 * 4096 + 4096 * 16 + 512 * 16 + 64 * 16 + 512)
    # Measured: the formulas leave out scalars and boolean masks, 8 bytes and 1 kB here; 32 kB leaves room for
    # reduction buffers on other CPUs and is still far below the 1 MB a second live chunk would add.
    assert 0 <= peak_allocated_bytes(unchunked) - 3 * 512 * 4096 * 4 < 32 * 1024
    h.grad = weight.grad = None
    assert 0 <= peak_allocated_bytes(chunked) - predicted < 32 * 1024


def test_logits_bytes_llama3_8b_by_hand():
    # 8,192 tokens x 128,256 vocabulary entries x 4 bytes = 4.2 GB; t = 8 ranks hold 16,032 columns each.
    assert logits_bytes(128256, 8192) == 4_202_692_608
    assert logits_bytes(128256, 8192, tp=8) == 8192 * 16032 * 4
    with pytest.raises(ValueError, match="padded_vocab_size"):
        logits_bytes(50257, 8192, tp=8)


@pytest.mark.parametrize(
    ("h_shape", "w_shape", "t_shape", "chunk", "match"),
    [
        ((4, 8), (10, 7), (4,), 2, "same d"),
        ((4, 8), (10, 8), (5,), 2, "targets"),
        ((4, 8), (10, 8), (4,), 0, "chunk_size"),
    ],
)
def test_bad_input_says_what_to_change(h_shape, w_shape, t_shape, chunk, match):
    with pytest.raises(ValueError, match=match):
        chunked_cross_entropy(torch.zeros(h_shape), torch.zeros(w_shape), torch.zeros(t_shape, dtype=torch.long),
                              chunk_size=chunk)


def test_bf16_inputs_give_bf16_gradients_within_bf16_rounding():
    lm_head, h, targets = _problem(torch.bfloat16)
    loss = chunked_cross_entropy(h, lm_head.weight, targets, chunk_size=32)
    grads = torch.autograd.grad(loss, (h, lm_head.weight))
    assert loss.dtype == torch.float32 and [g.dtype for g in grads] == [torch.bfloat16] * 2
    # Reference: the same bf16 values in float64. The logits are rounded to bf16 (8 bits: 2^-8 = 0.4 %
    # relative) before the fp32 softmax and the gradients on the way out, so 2 % fails a real error only.
    h64 = h.detach().double().requires_grad_()
    w64 = lm_head.weight.detach().double().requires_grad_()
    exact = F.cross_entropy((h64 @ w64.T).flatten(0, 1), targets.flatten())
    for ours, theirs in zip((loss, *grads), (exact, *torch.autograd.grad(exact, (h64, w64))), strict=True):
        assert (ours.double() - theirs).abs().max() <= 0.02 * theirs.abs().max()
