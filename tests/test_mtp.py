"""Multi-token prediction (scalebook.mtp): DeepSeek-V3's sequential modules on the book's GPT, against a loss
built by hand with plain torch ops, and its parameters and FLOPs against the accounting's closed forms."""

from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from scalebook import accounting, configs
from scalebook.model import GPT, GPTConfig
from scalebook.mtp import MultiTokenPrediction

CONFIG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)


def _wrapped(depth, weight, config=CONFIG, seed=0):
    torch.manual_seed(seed)
    model = MultiTokenPrediction(GPT(config), depth, weight)
    # Non-trivial norm gains, so a norm that is skipped or swapped would show in the loss.
    with torch.no_grad():
        for module in model.mtp_modules:
            for norm in (module.norm_hidden, module.norm_embedding, module.norm_out):
                norm.weight.uniform_(0.5, 1.5)
    return model


def _sequences(batch=3, length=12, seed=1):
    """Token sequences t_0 .. t_T: the model reads t_0 .. t_{T-1}, and the next tokens are t_1 .. t_T."""
    return torch.randint(CONFIG.vocab_size, (batch, length + 1), generator=torch.Generator().manual_seed(seed))


def _rms(x, weight, eps):
    return weight * x / torch.sqrt((x * x).mean() + eps)


@torch.no_grad()
def _reference_mtp_losses(model, seq, offset):
    """Each depth's loss, position by position: module k at position i reads h^{k-1}_i and Emb(t_{i+k}) and is
    scored against t_{i + offset(k)} (DeepSeek-V3: offset k + 1), the sum divided by all B T positions."""
    gpt, B, T = model.model, seq.size(0), seq.size(1) - 1
    captured = {}
    hook = gpt.ln_f.register_forward_pre_hook(lambda _, args: captured.update(h=args[0]))
    gpt(seq[:, :-1])  # the plain GPT's forward; its final norm's input is h^0
    hook.remove()
    hidden, wte = captured["h"], gpt.wte.weight
    losses = []
    for k, m in enumerate(model.mtp_modules, start=1):
        rows = []
        for b in range(B):
            for i in range(T - k):
                a = _rms(hidden[b, i], m.norm_hidden.weight, m.norm_hidden.eps)
                e = _rms(wte[seq[b, i + k]], m.norm_embedding.weight, m.norm_embedding.eps)
                rows.append(m.proj.weight @ torch.cat([a, e]))
        hidden = m.block(torch.stack(rows).view(B, T - k, -1))
        total = 0.0
        for b in range(B):
            for i in range(T - k):
                z = wte @ _rms(hidden[b, i], m.norm_out.weight, m.norm_out.eps)  # the tied head
                target = seq[b, i + offset(k)]
                total = total - (z[target] - torch.logsumexp(z, dim=0))
        losses.append(total / (B * T))
    return losses


def test_each_module_is_scored_against_the_token_k_plus_one_ahead():
    model, seq = _wrapped(depth=3, weight=0.5), _sequences(batch=2, length=8)
    with torch.no_grad():  # larger logits than at initialization, so that a wrong target moves the loss a lot
        model.model.wte.weight.mul_(50)
    logits, main, mtp = model.losses(seq[:, :-1], seq[:, 1:])
    reference = _reference_mtp_losses(model, seq, offset=lambda k: k + 1)
    # float32, summed in another order over a dozen positions: agreement to ~1e-7 relative; 1e-5 leaves room.
    for got, want in zip(mtp, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    plain_logits, plain_loss = model.model(seq[:, :-1], seq[:, 1:])
    assert torch.equal(logits, plain_logits) and torch.equal(main, plain_loss)
    _, total = model(seq[:, :-1], seq[:, 1:])
    torch.testing.assert_close(total, plain_loss + 0.5 / 3 * sum(reference), rtol=1e-5, atol=1e-6)
    # The reference can tell the offsets apart: scored one token early (t_{i+k}, the module's own input),
    # every depth's loss differs by far more than the tolerance.
    early = _reference_mtp_losses(model, seq, offset=lambda k: k)
    assert all(abs(g.item() - w.item()) > 1e-2 for g, w in zip(mtp, early, strict=True))


def test_mtp_modules_have_the_shapes_of_the_report():
    model = _wrapped(depth=2, weight=0.3)
    d = CONFIG.n_embd
    for module in model.mtp_modules:
        assert module.proj.weight.shape == (d, 2 * d) and module.proj.bias is None  # M_k: 2d -> d
        assert type(module.block) is type(model.model.blocks[0])
    # The embedding and the head are the main model's, not copies.
    names = {name for name, _ in model.named_parameters()}
    assert not any("wte" in name or "lm_head" in name for name in names if name.startswith("mtp_modules"))


def test_the_mtp_loss_reaches_the_shared_embedding_head_and_trunk():
    model, seq = _wrapped(depth=2, weight=0.3), _sequences()
    _, _, mtp = model.losses(seq[:, :-1], seq[:, 1:])
    gpt = model.model
    shared, trunk = gpt.wte.weight, gpt.blocks[0].attn.c_attn.weight
    grads = torch.autograd.grad(sum(mtp), [shared, trunk, *model.mtp_modules.parameters()])
    assert all(g.abs().max() > 0 for g in grads)
    # Rows of tokens that no module reads as input get gradient only through the head: the head is shared too.
    inputs = set(seq[:, 1:-1].flatten().tolist())
    unread = [t for t in range(CONFIG.vocab_size) if t not in inputs]
    assert unread and grads[0][unread].abs().max() > 0


@pytest.mark.parametrize(("depth", "weight"), [(0, 0.3), (2, 0.0)])
def test_depth_zero_or_weight_zero_is_exactly_the_plain_gpt(depth, weight):
    seq = _sequences()
    model = _wrapped(depth, weight)
    torch.manual_seed(0)
    plain = GPT(CONFIG)  # the same initial weights: the modules are built after the GPT
    _, loss = model(seq[:, :-1], seq[:, 1:])
    _, plain_loss = plain(seq[:, :-1], seq[:, 1:])
    loss.backward()
    plain_loss.backward()
    assert torch.equal(loss, plain_loss)
    for (name, p), q in zip(model.model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert all(p.grad is None for p in model.mtp_modules.parameters())


def test_without_targets_only_the_main_model_runs():
    model, seq = _wrapped(depth=2, weight=0.3), _sequences()
    logits, loss = model(seq[:, :-1])
    assert loss is None and torch.equal(logits, model.model(seq[:, :-1])[0])


def test_bad_input_is_one_value_error():
    with pytest.raises(ValueError, match="no target in a sequence of 4 tokens.*depth <= 3"):
        _wrapped(depth=4, weight=0.3)(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"weight \(lambda\) must be a finite number >= 0"):
        MultiTokenPrediction(GPT(CONFIG), 1, -0.1)
    with pytest.raises(ValueError, match=r"depth must be an integer in \[0, block_size - 1 = 15\]"):
        MultiTokenPrediction(GPT(CONFIG), 16, 0.3)
    with pytest.raises(ValueError, match="depth must be.*; weight"):  # both problems, one error
        MultiTokenPrediction(GPT(CONFIG), -1, float("nan"))
    with pytest.raises(ValueError, match="must be a scalebook.model.GPT"):
        MultiTokenPrediction(torch.nn.Linear(2, 2), 1, 0.3)
    with pytest.raises(ValueError, match="targets must have the shape"):
        _wrapped(1, 0.3)(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("bias", [True, False])
def test_mtp_parameters_match_the_closed_form(bias):
    config = replace(CONFIG, bias=bias)
    model = MultiTokenPrediction(GPT(config), 3, 0.3)
    spec = replace(configs.ModelConfig.from_gpt_config(config), n_mtp_layers=3)
    extra = model.num_parameters() - model.model.num_parameters()
    assert extra == accounting.mtp_param_count(spec)
    d = config.n_embd
    # 14 d^2 + 16 d per module with biases (a GPT layer's 12 d^2 + 13 d, M_k's 2 d^2, three RMSNorms' 3 d);
    # without, the layer keeps only its two LayerNorms' gains (2 d): 14 d^2 + 5 d.
    assert extra == 3 * ((14 * d * d + 16 * d) if bias else (14 * d * d + 5 * d))


def test_mtp_flops_match_the_flop_counter():
    seq, depth = _sequences(batch=2, length=10), 3
    B, T = seq.size(0), seq.size(1) - 1

    def counted(model):
        with FlopCounterMode(display=False) as counter:
            model(seq[:, :-1], seq[:, 1:])[1].backward()
        return counter.get_total_flops()

    extra = counted(_wrapped(depth, 0.3)) - counted(_wrapped(0, 0.3))
    spec = configs.ModelConfig.from_gpt_config(CONFIG)
    # Module k scores B (T - k) tokens over T - k positions; every matmul is counted forward and twice backward.
    assert extra == sum(B * (T - k) * accounting.mtp_flops_per_token(spec, seq_len=T - k) for k in range(1, depth + 1))


def test_a_mixture_of_experts_gpt_gets_a_mixture_of_experts_module():
    # DeepSeek-V3's module is one more MoE layer: the wrapper builds its block from the GPT's own block class.
    config = replace(CONFIG, n_experts=4)
    model, seq = MultiTokenPrediction(GPT(config), 1, 0.3), _sequences()
    assert type(model.mtp_modules[0].block.mlp) is type(model.model.blocks[0].mlp)
    assert type(model.mtp_modules[0].block.mlp).__name__ == "MoE"
    _, _, mtp = model.losses(seq[:, :-1], seq[:, 1:])
    grads = torch.autograd.grad(mtp[0], list(model.mtp_modules[0].block.mlp.parameters()), allow_unused=True)
    assert any(g is not None and g.abs().max() > 0 for g in grads)
