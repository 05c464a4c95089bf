"""Mixtures of experts counted: Mixtral 8x7B and DeepSeek-V3, total and active, against Hugging Face's classes.

Hugging Face's MixtralForCausalLM and DeepseekV3ForCausalLM are built on the meta device (no weights
allocated, nothing downloaded) from configs written here with the published config.json values, and
their parameters counted: every count is exact, integer for integer.
"""

import dataclasses
import functools
import os

import pytest
import torch
import transformers

from scalebook import accounting, configs
from scalebook.accounting import params

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MOES = ["mixtral-8x7b", "deepseek-v3"]


@pytest.fixture(scope="module")
def hf():
    """(torch, transformers): hard dependencies of the package, imported above (a failed import is an error)."""
    return torch, transformers


def hf_moe(hf, cfg, device="meta", **extra):
    """Hugging Face's model of ``cfg`` (config.json's field names), on the meta device unless told."""
    torch, transformers = hf
    common = dict(**extra,
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tied_embeddings,
    )  # fmt: skip
    if cfg.latent_attention is None:
        hf_config = transformers.MixtralConfig(
            intermediate_size=cfg.expert_d_ff, num_local_experts=cfg.n_experts,
            num_experts_per_tok=cfg.experts_per_token, **common,
        )  # fmt: skip
        build = transformers.MixtralForCausalLM
    else:
        mla = cfg.latent_attention
        hf_config = transformers.DeepseekV3Config(
            intermediate_size=cfg.d_ff, moe_intermediate_size=cfg.expert_d_ff, n_routed_experts=cfg.n_experts,
            num_experts_per_tok=cfg.experts_per_token, n_shared_experts=cfg.n_shared_experts,
            first_k_dense_replace=cfg.n_dense_layers, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
            qk_nope_head_dim=mla.qk_nope_head_dim, qk_rope_head_dim=mla.qk_rope_head_dim,
            v_head_dim=mla.v_head_dim, n_group=1, topk_group=1, **common,  # routing groups hold no parameters
        )  # fmt: skip
        build = transformers.DeepseekV3ForCausalLM
    with torch.device(device):
        return build(hf_config)


def routed_expert_params(model) -> int:
    """Parameters of all routed experts of an HF model: both classes keep them as 3-D (experts, out, in)
    tensors under ".mlp.experts."."""
    return sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)


@functools.cache
def published_on_meta(name: str):
    """The published model ``name`` built by Hugging Face on the meta device, once per test session."""
    return hf_moe((torch, transformers), configs.get_model(name))


@pytest.mark.parametrize("name", MOES)
def test_total_params_match_hf(hf, name):
    cfg = configs.get_model(name)
    model = published_on_meta(name)
    assert accounting.param_count(cfg) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", MOES)
def test_active_params_are_the_total_less_the_experts_a_token_skips(hf, name):
    # HF has no "active" count; from its tensors: every parameter outside the routed experts, plus k of
    # the E experts in each MoE layer. The last layer is always an MoE layer.
    cfg = configs.get_model(name)
    model = published_on_meta(name)
    one_expert = sum(p[0].numel() for p in model.model.layers[-1].mlp.experts.parameters())
    assert one_expert == 3 * cfg.d_model * cfg.expert_d_ff
    other = sum(p.numel() for p in model.parameters()) - routed_expert_params(model)
    assert accounting.active_param_count(cfg) == other + cfg.n_moe_layers * cfg.experts_per_token * one_expert


@pytest.mark.parametrize("name", MOES)
def test_breakdown_matches_hf_groups(hf, name):
    # Group HF's parameter names into param_breakdown's rows; the count of each row is exact.
    from scalebook import measure

    cfg = configs.get_model(name)
    groups = {
        "token embedding": r"embed_tokens",
        "routed experts": r"\.mlp\.experts\.",
        "routers": r"\.mlp\.gate\.weight",
        "norms": r"norm",
        "attention weights": r"self_attn\.",
        "MLP weights": r"\.mlp\.",
        "LM head": r"lm_head",
    }
    formula = {k: v for k, v in accounting.param_breakdown(cfg).items() if v}
    assert measure.parameters_by_group(published_on_meta(name), groups) == {k: formula.get(k, 0) for k in groups}


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [
        # Jiang et al. 2024, Sec. 2: "47B parameters", "13B active parameters" (12.9B with the embedding)
        ("mixtral-8x7b", 46_702_792_704, 12_879_925_248),
        # DeepSeek-V3 report: 671B total, 37B activated per token
        ("deepseek-v3", 671_026_404_352, 37_552_282_624),
    ],
)
def test_published_total_and_active_sizes(name, total, active):
    cfg = configs.get_model(name)
    assert (accounting.param_count(cfg), accounting.active_param_count(cfg)) == (total, active)
    assert round(total / 1e9) == round(cfg.nominal_params / 1e9)
    # The headline active sizes are rounded, and DeepSeek's leaves out the 0.9B embedding (below): 2 %.
    assert active == pytest.approx(cfg.nominal_active_params, rel=0.02)


def test_deepseek_v3_activated_params_without_the_embedding_are_its_36_6b():
    # README_WEIGHTS.md: "Activation parameters: 36.6B (including 0.9B for the output Head)": the embedding
    # table is looked up, not multiplied, so DeepSeek leaves it out of the activated count.
    cfg = configs.get_model("deepseek-v3")
    without_embedding = accounting.active_param_count(cfg) - accounting.param_breakdown(cfg)["token embedding"]
    assert round(without_embedding / 1e8) == 366


def test_the_hubs_685b_is_the_671b_model_plus_the_mtp_module():
    # README: "685B, which includes 671B of the Main Model weights and 14B of the MTP Module weights";
    # README_WEIGHTS.md: 11.5B unique MTP parameters, the embedding and head (0.9B each) stored again.
    cfg = configs.get_model("deepseek-v3")
    unique, stored = params.mtp_param_count(cfg), params.mtp_param_count(cfg, with_shared=True)
    assert stored - unique == 2 * cfg.vocab_size * cfg.d_model
    assert unique == pytest.approx(11.5e9, rel=0.01)  # 11.61B: README_WEIGHTS rounds it to 11.5B
    assert round(stored / 1e9) == 13  # the README's "14B" is 685 - 671
    # The Hub's 685B also counts the fp8 checkpoint's per-block scales (one fp32 per 128 x 128 block).
    assert accounting.param_count(cfg) + stored == pytest.approx(685e9, rel=1e-3)
    assert params.mtp_param_count(configs.get_model("mixtral-8x7b")) == 0


def test_mtp_module_is_one_more_moe_layer(hf):
    # The MTP module's layer has the shape of the model's MoE layers: HF's last layer, counted.
    cfg = configs.get_model("deepseek-v3")
    layer = published_on_meta("deepseek-v3").model.layers[-1]
    extra = 2 * cfg.d_model + 2 * cfg.d_model**2 + cfg.d_model  # enorm, hnorm, eh_proj, the head's norm
    assert params.mtp_param_count(cfg) == sum(p.numel() for p in layer.parameters()) + extra


@pytest.mark.parametrize("name", MOES)
def test_closed_form_omits_only_the_norms(name):
    cfg = configs.get_model(name)
    omitted = accounting.param_count(cfg) - accounting.param_count_closed_form(cfg)
    assert omitted == accounting.param_breakdown(cfg)["norms"]


def test_layer_weights_sum_to_the_matrix_counts():
    # Dense layers, then MoE layers: summed over layers they are the attention, MLP, expert and router rows.
    for name in [*MOES, "llama-3-8b"]:
        cfg = configs.get_model(name)
        parts = accounting.param_breakdown(cfg)
        matrices = sum(parts.get(k, 0) for k in ("attention weights", "MLP weights", "routed experts", "routers"))
        assert sum(accounting.layer_weights(cfg, i) for i in range(cfg.n_layers)) == matrices
        active = sum(accounting.layer_weights(cfg, i, active=True) for i in range(cfg.n_layers))
        outside = parts["token embedding"] + parts["LM head"] + parts["norms"]
        assert active + outside == accounting.active_param_count(cfg)


def test_training_flops_use_the_active_count():
    # 6 N_active D: DeepSeek-V3 on its 14.8T tokens is 6 * 37.6e9 * 14.8e12 ~ 3.3e24 FLOPs, 18x fewer than
    # a dense model of its total size would take.
    cfg = configs.get_model("deepseek-v3")
    flops = accounting.training_flops(cfg, 14.8e12)
    assert flops == 6 * accounting.active_param_count(cfg) * 14.8e12
    assert flops == pytest.approx(3.33e24, rel=0.01)
    dense = accounting.training_flops(accounting.param_count(cfg), 14.8e12)
    assert dense / flops == pytest.approx(671.0 / 37.55, rel=1e-3)


def test_attention_aware_flops_of_an_moe_add_scores_and_the_head():
    # Per token: 3 (2 W_active_layers + 2 L s n_h (d_qk + d_v) + 2 h V); MLA's d_qk = 192, d_v = 128.
    cfg, s = configs.get_model("deepseek-v3"), 4096
    parts = accounting.param_breakdown(cfg)
    weights = accounting.active_param_count(cfg) - parts["token embedding"] - parts["LM head"] - parts["norms"]
    expected = 3 * (2 * weights + 2 * 61 * s * 128 * (192 + 128) + 2 * 7168 * 129280)
    assert accounting.flops_per_token(cfg, seq_len=s) == expected


def test_memory_calculator_holds_every_experts_state():
    # Mixed-precision Adam keeps 16 bytes per parameter, for all experts, though a token uses a few:
    # Mixtral's 46.7B need 747 GB of model states, not the 206 GB of its 12.9B active parameters.
    from scalebook import widgets

    cfg = configs.get_model("mixtral-8x7b")
    assert accounting.model_state_bytes(cfg).total == 16 * 46_702_792_704
    estimate = widgets.memory_per_gpu("mixtral-8x7b", seq_len=4096)
    states = sum(nbytes for what, nbytes in estimate.rows if what != "activations")
    assert states == 16 * accounting.param_count(cfg)


def test_moe_layers_refuse_the_single_layer_weight_count():
    with pytest.raises(ValueError, match="use accounting.layer_weights"):
        params.layer_matmul_weights(configs.get_model("mixtral-8x7b"))
    with pytest.raises(ValueError, match=r"layer must be an integer in \[0, 32\)"):
        accounting.layer_weights(configs.get_model("mixtral-8x7b"), 32)


def test_a_dense_model_is_all_active():
    # Llama 3 70B by hand (h 8192, L 80, 64 query and 8 key/value heads of 128, d_ff 28672, V 128256, untied):
    # a layer holds q and o (2 h^2 = 134,217,728), k and v (2 h 1024 = 16,777,216), the SwiGLU MLP
    # (3 h d_ff = 704,643,072) and two RMSNorms (2 h = 16,384): 855,654,400; 80 layers 68,452,352,000; the embedding
    # and the head 2 V h = 2,101,346,304; the final norm 8,192. N = 70,553,706,496, meta-llama/Meta-Llama-3-70B's
    # "70.6B params". Every one of them is active, and training costs 6 N FLOPs per token.
    n = 80 * (2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192) + 2 * 128_256 * 8192 + 8192
    assert n == 70_553_706_496
    cfg = configs.get_model("llama-3-70b")
    assert accounting.active_param_count(cfg) == accounting.param_count(cfg) == n
    assert "routed experts" not in accounting.param_breakdown(cfg)
    assert accounting.flops_per_token(cfg) == 6 * n
    assert accounting.flops_per_token(cfg, recompute=True) == 8 * n  # the forward pass once more: 2 N


def test_a_small_moe_built_here_matches_hf_without_latent_attention_queries(hf):
    # q_lora_rank = 0: queries projected directly (DeepSeek-V2-Lite's choice); one dense layer, 4 experts.
    mla = configs.LatentAttention(
        q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16
    )
    cfg = dataclasses.replace(
        configs.get_model("deepseek-v3"), name="tiny", vocab_size=100, d_model=64, n_layers=3, n_heads=4,
        n_kv_heads=4, d_ff=96, max_seq_len=128, n_experts=4, experts_per_token=2, d_ff_expert=32,
        n_dense_layers=1, latent_attention=mla,
    )  # fmt: skip
    torch, transformers = hf
    hf_config = transformers.DeepseekV3Config(
        vocab_size=100, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1, max_position_embeddings=128,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(hf_config)
    assert accounting.param_count(cfg) == sum(p.numel() for p in model.parameters())


TINY = {
    # Small shapes of the two layouts: GQA with 8 experts top-2; MLA, a dense first layer, a shared expert.
    "mixtral-8x7b": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64),
    "deepseek-v3": dict(
        vocab_size=256,
        d_model=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=4,
        d_ff=96,
        max_seq_len=64,
        n_experts=8,
        experts_per_token=2,
        d_ff_expert=32,
        n_dense_layers=1,
        latent_attention=configs.LatentAttention(24, 16, 8, 4, 8),
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", MOES)
def test_training_flops_per_token_match_flop_counter_on_hf_models(hf, name):
    # FlopCounterMode counts the matmuls HF runs; with the eager experts (a loop over the experts hit,
    # each multiplying only its tokens) that is k experts per token: the active count. (The default
    # grouped kernels are invisible to the counter.) Forward = flops_per_token / 3, backward twice that,
    # exactly: the router, the shared expert, MLA's scores over d_nope + d_rope and d_v all included.
    from scalebook import measure

    torch, transformers = hf
    cfg = dataclasses.replace(configs.get_model(name), name="tiny", **TINY[name])
    torch.manual_seed(0)
    model = hf_moe(hf, cfg, device="cpu", experts_implementation="eager").train()  # routing needs real weights
    b, s = 2, 32
    idx = torch.randint(0, cfg.vocab_size, (b, s))
    counted = measure.count_flops(model, (idx,), loss_fn=lambda out: out.logits.float().square().mean())
    assert counted.forward * 3 == accounting.flops_per_token(cfg, seq_len=s) * b * s
    assert counted.backward == 2 * counted.forward
