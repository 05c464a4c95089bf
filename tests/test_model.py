"""The from-scratch GPT against Hugging Face's GPT2LMHeadModel, and its own invariants."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from scalebook.model import GPT, GPTConfig

# Float32 logits of two implementations of the same math differ only by summation order: ~1e-7 per
# op here, so 1e-5 absolute leaves a 100x margin while still catching any real mapping mistake
# (a transposed weight or a missing bias changes logits by O(0.1)).
LOGIT_ATOL = 1e-5


def small_hf_gpt2(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=320, n_positions=64, n_embd=64, n_layer=3, n_head=4, bos_token_id=319, eos_token_id=319)
    cfg.update(overrides)
    return GPT2LMHeadModel(GPT2Config(**cfg)).eval()


@pytest.mark.parametrize("attn_impl", ["explicit", "sdpa"])
def test_logits_match_hf_gpt2(attn_impl):
    hf = small_hf_gpt2()
    ours = GPT.from_hf(hf, attn_impl=attn_impl).eval()
    idx = torch.randint(0, 320, (3, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(idx).logits
        logits, _ = ours(idx)
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=LOGIT_ATOL, rtol=0)


def test_loss_and_gradients_match_hf_gpt2():
    hf = small_hf_gpt2(seed=2)
    ours = GPT.from_hf(hf)
    idx = torch.randint(0, 320, (2, 33), generator=torch.Generator().manual_seed(3))
    # HF shifts labels inside the model; ours takes inputs and targets already shifted.
    _, loss = ours(idx[:, :-1], idx[:, 1:])
    hf_loss = hf(idx, labels=idx).loss
    torch.testing.assert_close(loss, hf_loss, atol=1e-6, rtol=0)
    loss.backward()
    hf_loss.backward()
    # Gradients are sums of many float32 products: 1e-6 absolute / 1e-5 relative.
    # HF's Conv1D weights are stored (in, out), ours (out, in): compare the transpose.
    pairs = {
        "wte": (ours.wte.weight, hf.transformer.wte.weight.grad),
        "wpe": (ours.wpe.weight, hf.transformer.wpe.weight.grad),
        "qkv (layer 1)": (ours.blocks[1].attn.c_attn.weight, hf.transformer.h[1].attn.c_attn.weight.grad.t()),
        "mlp out (layer 2)": (ours.blocks[2].mlp.c_proj.weight, hf.transformer.h[2].mlp.c_proj.weight.grad.t()),
        "ln_f": (ours.ln_f.weight, hf.transformer.ln_f.weight.grad),
    }
    for name, (param, hf_grad) in pairs.items():
        torch.testing.assert_close(param.grad, hf_grad, atol=1e-6, rtol=1e-5, msg=name)


def test_export_to_hf_round_trips():
    torch.manual_seed(0)
    ours = GPT(GPTConfig(vocab_size=100, block_size=32, n_layer=2, n_head=2, n_embd=32)).eval()
    hf = ours.to_hf()
    idx = torch.randint(0, 100, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx)[0], atol=LOGIT_ATOL, rtol=0)
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr(), "export must keep the head tied"


def test_param_count_matches_hf_for_gpt2_small_layout():
    cfg = GPTConfig.named("gpt2")
    with torch.device("meta"):
        ours = GPT(cfg)
        hf = GPT2LMHeadModel(GPT2Config())
    # 124,439,808 is the published parameter count of GPT-2 small (the "124M" checkpoint).
    assert ours.num_parameters() == sum(p.numel() for p in hf.parameters()) == 124_439_808


def test_explicit_and_sdpa_attention_agree_in_training_gradients():
    torch.manual_seed(0)
    cfg = GPTConfig.named("tiny", n_layer=2)
    a = GPT(cfg)
    b = GPT(GPTConfig.named("tiny", n_layer=2, attn_impl="sdpa"))
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 256, (2, 65))
    for m in (a, b):
        m(idx[:, :-1], idx[:, 1:])[1].backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_attention_is_causal():
    torch.manual_seed(0)
    model = GPT(GPTConfig.named("tiny", n_layer=2)).eval()
    idx = torch.randint(0, 256, (1, 20))
    changed = idx.clone()
    changed[0, 12:] = (changed[0, 12:] + 1) % 256  # alter the future only
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], atol=0, rtol=0)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_activation_checkpointing_gives_identical_gradients():
    torch.manual_seed(0)
    model = GPT(GPTConfig.named("tiny", n_layer=2))
    idx = torch.randint(0, 256, (2, 33))
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = ckpt
        model(idx[:, :-1], idx[:, 1:])[1].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g0, g1 in zip(*grads, strict=True):
        torch.testing.assert_close(g0, g1, atol=0, rtol=0)


def test_head_is_tied_to_token_embedding():
    model = GPT(GPTConfig.named("tiny"))
    assert model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(n_embd=130, n_head=4), "divisible by n_head"),
        (dict(n_layer=0), "n_layer must be a positive integer"),
        (dict(attn_impl="flash"), "attn_impl must be one of"),
        (dict(dropout=1.0), "dropout must be in [0, 1)"),
    ],
)
def test_bad_config_is_rejected_with_a_clear_message(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        GPTConfig(**kwargs)


def test_unknown_size_names_the_choices():
    with pytest.raises(ValueError, match="choose one of .*tiny"):
        GPTConfig.named("huge")


def test_too_long_input_is_rejected():
    model = GPT(GPTConfig.named("tiny"))
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(torch.zeros(1, 129, dtype=torch.long))
