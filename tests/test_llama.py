"""The from-scratch Llama (scalebook.llama) against Hugging Face's, and its bytes and FLOPs against accounting.

Hugging Face's LlamaDecoderLayer and LlamaForCausalLM are built from a LlamaConfig (no download) and given
our weights; logits and the gradient of every parameter must agree. Saved activations and FLOPs are measured
(saved-tensor hooks, FlopCounterMode) and compared with scalebook.accounting's closed forms.
"""

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from scalebook import accounting, measure
from scalebook.llama import LlamaBlock, LlamaConfig, LlamaLM
from scalebook.model import lm_loss
from scalebook.positions import rope_cache

CFG = LlamaConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, d_ff=176)
# The same operations in the same order agree bit for bit today; the tolerances leave room for a kernel that sums
# in another order (fp32 rounds at ~6e-8 relative per operation, over sums of a few hundred terms; fp64 at
# ~1e-16), while a wrong weight, head grouping or rotation moves results by 1e-2 or more.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-13)}


def hf_config(cfg: LlamaConfig) -> HFLlamaConfig:
    return LlamaLM(cfg).to_hf().config


def assert_grads_close(ours: torch.nn.Module, theirs: torch.nn.Module, rename, tol) -> None:
    theirs_by_name = dict(theirs.named_parameters())
    names = [name for name, _ in ours.named_parameters()]
    assert len(names) == len(theirs_by_name)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs_by_name[rename(name)].grad, **tol, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_llama_block_matches_hf_decoder_layer(dtype):
    torch.manual_seed(0)
    ours = LlamaBlock(CFG).to(dtype)
    theirs = LlamaDecoderLayer(hf_config(CFG), layer_idx=0).to(dtype)
    for p in ours.parameters():  # the norm weights start at 1: move them, or their gradients test little
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.1)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 16, CFG.n_embd, dtype=dtype)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    cos, sin = (t.to(dtype) for t in rope_cache(16, CFG.head_dim))
    y_ours = ours(x_ours, cos, sin)
    y_theirs = theirs(x_theirs, attention_mask=None, position_embeddings=(cos[None], sin[None]))
    torch.testing.assert_close(y_ours, y_theirs, **TOL[dtype])
    grad_out = torch.randn_like(y_ours)
    y_ours.backward(grad_out)
    y_theirs.backward(grad_out)
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, **TOL[dtype])
    assert_grads_close(ours, theirs, lambda name: name, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_llama_lm_matches_hf_causal_lm_logits_and_gradients(dtype):
    torch.manual_seed(0)
    ours = LlamaLM(CFG).to(dtype)
    theirs = ours.to_hf().train()
    idx, targets = torch.randint(0, CFG.vocab_size, (2, 2, CFG.block_size))
    logits, loss = ours(idx, targets)
    their_logits = theirs(idx).logits
    torch.testing.assert_close(logits, their_logits, **TOL[dtype])
    loss.backward()
    lm_loss(their_logits, targets).backward()
    assert_grads_close(ours, theirs, lambda name: name if name.startswith("lm_head") else "model." + name, TOL[dtype])


def test_weights_round_trip_through_hugging_face():
    for tie in (False, True):
        ours = LlamaLM(LlamaConfig(tie_embeddings=tie))
        back = LlamaLM.from_hf(ours.to_hf())
        assert back.config == ours.config
        assert all(
            torch.equal(a, b) for a, b in zip(ours.state_dict().values(), back.state_dict().values(), strict=True)
        )
        assert (back.lm_head.weight is back.embed_tokens.weight) == tie


def saved_per_layer(model, inputs, layers) -> list[int]:
    return list(measure.saved_activation_bytes(model, inputs, layers=layers).per_layer.values())


def test_activation_bytes_match_measured_llama_layers():
    """accounting.activation_bytes on the same config equals what a Llama layer saves, up to three named extras.

    Extras the formula leaves out on purpose (Korthikanti et al.'s bookkeeping, a fused-norm stack): per layer,
    each RMSNorm's normalized tensor before its weight (an RMSNorm written out in PyTorch is not fused; s b h
    each), each norm's 1/rms per token (s b each) and, with fused attention, the log-sum-exp (a s b).
    """
    torch.manual_seed(0)
    b, s = 2, CFG.block_size
    h, a, L = CFG.n_embd, CFG.n_head, CFG.n_layer
    model = LlamaLM(CFG)
    idx, targets = torch.randint(0, CFG.vocab_size, (2, b, s))
    extras = 4 * (2 * s * b * h + 2 * s * b)  # fp32 normalized tensors and 1/rms of the two norms
    formula = {
        attention: accounting.activation_bytes(CFG.to_model_config(), seq_len=s, micro_batch=b, dtype_bytes=4,
                                               dropout=False, attention=attention) // L
        for attention in accounting.ATTENTION
    }  # fmt: skip
    # Ours runs fused attention (SDPA's flash kernel on CPU): K and V stay n_kv heads wide, no scores.
    assert saved_per_layer(model, (idx, targets), model.layers) == [formula["fused"] + extras + 4 * a * s * b] * L
    # Hugging Face's eager attention is the formula's explicit path: K and V repeated to all heads, the scores.
    theirs = model.to_hf()
    theirs.config._attn_implementation = "eager"
    measured = saved_per_layer(theirs.train(), (idx,), theirs.model.layers)
    rope_tables = 2 * 4 * s * CFG.head_dim  # HF's cos and sin, computed in the forward, first saved by layer 0
    assert measured == [formula["explicit"] + extras + rope_tables] + [formula["explicit"] + extras] * (L - 1)


def test_flops_match_flop_counter():
    """FlopCounterMode's count of a training step is accounting.flops_per_token x tokens, exactly (matmuls only)."""
    torch.manual_seed(0)
    b, s = 2, CFG.block_size
    model = LlamaLM(CFG)
    counted = measure.count_flops(model, tuple(torch.randint(0, CFG.vocab_size, (2, b, s))))
    assert counted.total == accounting.flops_per_token(CFG.to_model_config(), seq_len=s) * b * s
    assert counted.backward == 2 * counted.forward


def test_bad_config_says_what_to_change():
    with pytest.raises(ValueError, match="n_kv_head"):
        LlamaConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="even head size"):
        LlamaConfig(n_embd=60, n_head=4)
    with pytest.raises(ValueError, match="block_size"):
        LlamaLM(LlamaConfig(block_size=8))(torch.zeros(1, 9, dtype=torch.long))
