"""The measured counterparts of scalebook.accounting: parameters, model states, saved activations, FLOPs.

Each measurement is checked against the closed-form formula and against a count done by hand.
"""

import pytest
import torch
import transformers
from torch.utils.checkpoint import set_checkpoint_early_stop

from scalebook import accounting, configs, measure
from scalebook.model import GPT, GPTConfig
from scalebook.train import TrainConfig, make_optimizer


def test_shared_storage_is_counted_once():
    base = torch.zeros(10, 10)
    assert measure.tensor_bytes([base, base.t(), base[2:5]]) == 400
    assert measure.tensor_bytes([base, torch.zeros(3, dtype=torch.float16)]) == 406


def test_tied_embedding_is_counted_once():
    model = GPT(GPTConfig.named("tiny"))
    held = measure.model_state_bytes(model)
    assert held.params == 4 * model.num_parameters()
    assert held.grads == 0 and held.optimizer == 0


def test_fp32_adam_states_equal_the_formula_after_a_step():
    model = GPT(GPTConfig.named("tiny", n_layer=2))
    opt = make_optimizer(model, TrainConfig())
    idx = torch.randint(0, 256, (2, 33))
    model(idx[:, :-1], idx[:, 1:])[1].backward()
    opt.step()
    held = measure.model_state_bytes(model, opt)
    predicted = accounting.model_state_bytes(model.num_parameters(), precision="fp32", optimizer="adam")
    assert held == measure.StateBytes(predicted.params, predicted.grads, predicted.optimizer)
    assert held.total == predicted.total == 16 * model.num_parameters()


@pytest.mark.parametrize(("optimizer", "torch_optimizer"), [
    ("sgd", lambda params: torch.optim.SGD(params, lr=0.1)),
    ("sgd-momentum", lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)),
])  # fmt: skip
def test_fp32_sgd_states_equal_the_formula_after_a_step(optimizer, torch_optimizer):
    model = GPT(GPTConfig.named("tiny", n_layer=2))
    opt = torch_optimizer(model.parameters())
    idx = torch.randint(0, 256, (2, 33))
    model(idx[:, :-1], idx[:, 1:])[1].backward()
    opt.step()
    held = measure.model_state_bytes(model, opt)
    predicted = accounting.model_state_bytes(model.num_parameters(), precision="fp32", optimizer=optimizer)
    assert held == measure.StateBytes(predicted.params, predicted.grads, predicted.optimizer)


# ------------------------------------------------------------------------------------------------ parameters


@pytest.mark.parametrize("name", ["tiny", "small", "gpt2", "gpt2-xl"])
def test_param_count_equals_the_instantiated_gpt(name):
    cfg = GPTConfig.named(name)
    with torch.device("meta"):  # no weights are allocated; shapes, and so numel(), are real
        model = GPT(cfg)
    assert accounting.param_count(configs.ModelConfig.from_gpt_config(cfg)) == model.num_parameters()


def test_param_count_equals_the_instantiated_gpt3_175b():
    published = configs.get_model("gpt3-175b")
    with torch.device("meta"):
        model = GPT(GPTConfig(**published.gpt_config_kwargs()))
    assert accounting.param_count(published) == model.num_parameters()


# Component of each parameter, by name, in our GPT and in Hugging Face's GPT2LMHeadModel alike.
GPT_GROUPS = {
    "token embedding": r"wte\.",
    "position embedding": r"wpe\.",
    "attention weights": r"attn\.c_(attn|proj)\.weight",
    "attention biases": r"attn\.c_(attn|proj)\.bias",
    "MLP weights": r"mlp\.c_(fc|proj)\.weight",
    "MLP biases": r"mlp\.c_(fc|proj)\.bias",
    "norms": r"ln_",
    "LM head": r"lm_head",
}


@pytest.mark.parametrize("name", ["tiny", "gpt2"])
def test_parameters_by_group_of_our_gpt_equal_the_breakdown(name):
    cfg = GPTConfig.named(name)
    with torch.device("meta"):
        model = GPT(cfg)
    expected = accounting.param_breakdown(configs.ModelConfig.from_gpt_config(cfg))
    assert measure.parameters_by_group(model, GPT_GROUPS) == expected


def test_parameters_by_group_refuses_to_drop_a_parameter():
    with pytest.raises(ValueError, match=r"no group matches \['wte.weight'"):
        measure.parameters_by_group(GPT(GPTConfig.named("tiny", n_layer=1)), {"attention": "attn"})


# ------------------------------------------------------------------------------------------ saved activations

# (seq_len, micro_batch, d_model, n_heads): short and long sequences, narrow and wide layers, b = 1 to 4.
SHAPES = [(64, 2, 128, 4), (128, 1, 64, 2), (256, 3, 128, 8), (32, 4, 256, 4)]


def gpt_and_tokens(s, b, h, a, *, attn_impl="explicit", n_layer=2, seed=0):
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=256, block_size=256, n_layer=n_layer, n_head=a, n_embd=h, attn_impl=attn_impl)
    idx = torch.randint(0, 256, (b, s))
    return GPT(cfg).train(), (idx, idx), configs.ModelConfig.from_gpt_config(cfg)


@pytest.mark.parametrize(("s", "b", "h", "a"), SHAPES)
def test_saved_activations_of_explicit_attention_match_korthikanti_within_5_percent(s, b, h, a):
    model, inputs, cfg = gpt_and_tokens(s, b, h, a)
    saved = measure.saved_activation_bytes(model, inputs, layers=model.blocks)
    # Korthikanti et al.'s layer in our model's settings, fp32 and no dropout: 4 (16 s b h + a s^2 b).
    formula = accounting.activation_bytes(cfg, seq_len=s, micro_batch=b, dtype_bytes=4, dropout=False)
    assert saved.in_layers == pytest.approx(formula, rel=0.05)
    # The remainder, counted by hand: each LayerNorm also keeps its mean and 1/std (2 s b fp32 values,
    # two norms per layer: 16 s b bytes), and masked_fill keeps the s x s boolean causal mask.
    assert saved.per_layer == {name: formula // 2 + 16 * s * b + s * s for name in ("blocks.0", "blocks.1")}


@pytest.mark.parametrize(("s", "b", "h", "a"), SHAPES)
def test_sdpa_attention_saves_no_score_matrix(s, b, h, a):
    model, inputs, cfg = gpt_and_tokens(s, b, h, a, attn_impl="sdpa")
    saved = measure.saved_activation_bytes(model, inputs, layers=model.blocks)
    # The fused kernel keeps Q, K, V, its output and one log-sum-exp per row (a s b fp32 values) instead
    # of the a s^2 b softmax output: the formula without its score term ("selective"), plus those rows.
    no_scores = accounting.activation_bytes(
        cfg, seq_len=s, micro_batch=b, dtype_bytes=4, dropout=False, recompute="selective"
    )
    assert saved.in_layers == no_scores + 2 * (4 * a * s * b + 16 * s * b)


def test_bf16_autocast_halves_all_but_the_residual_stream():
    s, b, h, a = 128, 2, 128, 4
    model, inputs, cfg = gpt_and_tokens(s, b, h, a)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved = measure.saved_activation_bytes(model, inputs, layers=model.blocks)
    sixteen_bit = accounting.activation_bytes(cfg, seq_len=s, micro_batch=b, dtype_bytes=2, dropout=False)
    # Autocast runs LayerNorm in fp32, so the two LayerNorm inputs (the residual stream) stay 4 bytes
    # (2 extra bytes each), beside the norms' statistics and the causal mask counted above.
    extra = 2 * (2 * s * b * h) + 16 * s * b + s * s
    assert saved.per_layer == {name: sixteen_bit // 2 + extra for name in ("blocks.0", "blocks.1")}
    # The bf16 copies of the matmul weights (12 h^2 per layer, and the tied V x h head) are model state.
    assert saved.parameter_copy_bytes == 2 * (cfg.n_layers * 12 * h * h + cfg.vocab_size * h)


@pytest.mark.parametrize(("s", "b", "h", "a"), SHAPES[:2])
def test_checkpointing_keeps_only_each_layers_input(s, b, h, a):
    model, inputs, cfg = gpt_and_tokens(s, b, h, a)
    plain = measure.saved_activation_bytes(model, inputs, layers=model.blocks)
    model.gradient_checkpointing = True
    checkpointed = measure.saved_activation_bytes(model, inputs, layers=model.blocks)
    full_recompute = accounting.activation_bytes(
        cfg, seq_len=s, micro_batch=b, dtype_bytes=4, recompute="full"
    )
    assert checkpointed.total - plain.outside_layers == full_recompute  # L s b h fp32 values


def test_parameters_are_not_counted_as_activations():
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    saved = measure.saved_activation_bytes(layer, x)
    # addmm saves its input (3 x 8 fp32) and W.t(), a view of the parameter.
    assert [t.shape for t in saved.tensors] == [(3, 8)]
    assert saved.total == saved.outside_layers == 3 * 8 * 4


def test_an_activation_saved_twice_is_counted_once():
    x = torch.randn(5, 6, requires_grad=True)
    y = torch.randn(6, 7)
    # softmax saves its output, and the matmul saves the same tensor again as its left operand.
    saved = measure.saved_activation_bytes(torch.nn.Softmax(dim=-1), (x,))
    assert saved.total == 5 * 6 * 4
    twice = measure.saved_activation_bytes(SoftmaxThenMatmul(y), (x,))
    assert [t.nbytes for t in twice.tensors] == [5 * 6 * 4, 0]


class SoftmaxThenMatmul(torch.nn.Module):
    def __init__(self, right):
        super().__init__()
        self.right = torch.nn.Parameter(right)

    def forward(self, x):
        return torch.softmax(x, dim=-1) @ self.right


# ------------------------------------------------------------------------------------------------------ FLOPs


@pytest.mark.parametrize(
    ("attn_impl", "s", "b", "h", "a"),
    [("explicit", *shape) for shape in SHAPES[:3]] + [("sdpa", *SHAPES[0])],
)
def test_counted_flops_equal_the_attention_aware_formula(attn_impl, s, b, h, a):
    model, inputs, cfg = gpt_and_tokens(s, b, h, a, attn_impl=attn_impl)
    counted = measure.count_flops(model, inputs)
    # Every matmul of the model is in the formula (weights, Q K^T, scores V, the LM head; attention over
    # all s x s positions, as computed), and nothing else is a matmul, so the two agree exactly.
    assert counted.total == accounting.flops_per_token(cfg, seq_len=s) * b * s
    assert counted.backward == 2 * counted.forward


def test_recomputation_flops_with_and_without_early_stop():
    model, inputs, cfg = gpt_and_tokens(64, 2, 128, 4)
    model.gradient_checkpointing = True
    with set_checkpoint_early_stop(False):
        rerun_all = measure.count_flops(model, inputs)
    assert rerun_all.total == accounting.flops_per_token(cfg, seq_len=64, recompute=True) * 2 * 64
    # PyTorch stops recomputing a layer once every saved tensor is back: the MLP's output projection
    # (4 h^2 weights, 2 FLOPs each per token) is never rerun.
    early = measure.count_flops(model, inputs)
    assert rerun_all.total - early.total == cfg.n_layers * 2 * 4 * 128**2 * 2 * 64


def test_a_linear_layer_costs_2mkn_forward_and_2mkn_for_the_weight_gradient():
    layer = torch.nn.Linear(8, 4, bias=False)
    x = torch.randn(3, 8)  # no grad for the input: backward computes only dL/dW
    counted = measure.count_flops(layer, x, loss_fn=lambda y: y.sum())
    assert (counted.forward, counted.backward) == (2 * 3 * 8 * 4, 2 * 3 * 8 * 4)
    assert dict(counted.by_operator) == {"mm": 4 * 3 * 8 * 4}


def test_count_flops_leaves_the_gradients_alone():
    model, inputs, _ = gpt_and_tokens(32, 1, 64, 2)
    measure.count_flops(model, inputs)
    assert all(p.grad is None for p in model.parameters())


def test_peak_matmul_flops_is_a_plausible_rate():
    # A 256^3 product is 33.6 MFLOP; any CPU this runs on sustains far more than 1e8 FLOP/s, and no
    # 2-core CPU reaches 1e13 in fp32.
    assert 1e8 < measure.peak_matmul_flops(256, repeats=3) < 1e13


@pytest.mark.parametrize(("call", "message"), [
    (lambda: measure.saved_activation_bytes(torch.nn.Linear(2, 2), "tokens"), "inputs must be a tensor"),
    (lambda: measure.saved_activation_bytes(torch.nn.Linear(2, 2), torch.ones(2), layers=[torch.nn.ReLU()]),
     "layers must be sub-modules of the model"),
    (lambda: measure.saved_activation_bytes(lambda x: x, torch.ones(2)), "model must be a torch.nn.Module"),
    (lambda: measure.count_flops(torch.nn.Linear(2, 2), torch.ones(3, 2)), "could not find the loss"),
    (lambda: measure.count_flops(torch.nn.Linear(2, 2).requires_grad_(False), torch.ones(3, 2)),
     "no parameter that requires grad"),
    (lambda: measure.peak_matmul_flops(0), "size must be an integer >= 1"),
    (lambda: measure.peak_matmul_flops(64, repeats=0), "repeats must be an integer >= 1"),
])  # fmt: skip
def test_bad_input_raises_one_value_error_that_says_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------------------- a Llama layer (Hugging Face)

# (seq_len, micro_batch, d_model, n_heads, n_kv_heads, d_ff): grouped-query (4 and 2 query heads per
# key/value head) and plain multi-head attention, SwiGLU widths that are not a multiple of h.
LLAMA_SHAPES = [(64, 2, 128, 8, 2, 352), (32, 3, 64, 4, 4, 176), (128, 1, 128, 4, 2, 320)]


def hf_llama_and_tokens(s, b, h, a, n_kv, d_ff, attn_implementation, n_layers=2):
    """Hugging Face's LlamaForCausalLM built from a small LlamaConfig (nothing downloaded), and its config."""
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=h, intermediate_size=d_ff, num_hidden_layers=n_layers, num_attention_heads=a,
        num_key_value_heads=n_kv, max_position_embeddings=256, attn_implementation=attn_implementation,
    )  # fmt: skip
    cfg = configs.llama_like("hf-llama", vocab_size=256, d_model=h, n_layers=n_layers, n_heads=a, n_kv_heads=n_kv,
                             d_ff=d_ff, max_seq_len=256)  # fmt: skip
    return transformers.LlamaForCausalLM(hf_cfg).train(), torch.randint(0, 256, (b, s)), cfg


@pytest.mark.parametrize(("s", "b", "h", "a", "n_kv", "d_ff"), LLAMA_SHAPES)
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_a_hugging_face_llama_layer_saves_what_the_llama_formula_says(s, b, h, a, n_kv, d_ff, attn_implementation):
    model, idx, cfg = hf_llama_and_tokens(s, b, h, a, n_kv, d_ff, attn_implementation)
    saved = measure.saved_activation_bytes(model, (idx,), layers=model.model.layers)
    attention = "fused" if attn_implementation == "sdpa" else "explicit"
    formula = accounting.activation_bytes(cfg, seq_len=s, micro_batch=b, dtype_bytes=4, dropout=False,
                                          attention=attention) // cfg.n_layers  # fmt: skip
    # Counted by hand, fp32, per layer: the norm inputs, the QKV input, Q, the attention output and the
    # MLP input (6 s b h); K and V (2 s b d_kv with GQA in the fused kernel, repeated to 2 s b h by the
    # eager path); gate, up, SiLU output and product (4 s b d_ff); the eager path's a s^2 b softmax.
    d_kv = n_kv * h // a
    by_hand = 6 * s * b * h + (2 * s * b * d_kv if attention == "fused" else 2 * s * b * h + a * s * s * b)
    assert formula == 4 * (by_hand + 4 * s * b * d_ff)
    # What the formula leaves out, as for the GPT layer: each RMSNorm's 1/rms (s b values) and, in Hugging
    # Face's unfused RMSNorm, the normalised input before the weight multiplies it (s b h); the fused
    # kernel's log-sum-exp (a s b); the rotary tables cos and sin (s d_h each), saved once, by layer 0.
    extras = 4 * (2 * (s * b + s * b * h) + (a * s * b if attention == "fused" else 0))
    rope_tables = 4 * 2 * s * (h // a)
    assert saved.per_layer == {"model.layers.0": formula + extras + rope_tables, "model.layers.1": formula + extras}
