"""The published model shapes, accelerators and links in scalebook.configs, checked against their sources."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from scalebook import accounting, configs

GPT2_FAMILY = ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]
GPT3_TABLE_2_1 = [f"gpt3-{size}" for size in ("125m", "350m", "760m", "1.3b", "2.7b", "6.7b", "13b", "175b")]
LLAMAS = ["llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b", "llama-3.1-405b"]
MOES = ["mixtral-8x7b", "deepseek-v3"]


def _models(names):
    return [(name, configs.get_model(name)) for name in names]


def test_every_published_family_is_listed():
    assert configs.list_models() == GPT2_FAMILY + GPT3_TABLE_2_1 + LLAMAS + MOES


@pytest.mark.parametrize("name", GPT2_FAMILY + GPT3_TABLE_2_1 + LLAMAS + MOES)
def test_every_model_cites_its_source_and_headline_size(name):
    cfg = configs.get_model(name)
    assert cfg.name == name
    assert any(paper in cfg.source for paper in ("Radford", "Brown", "Touvron", "Grattafiori", "Jiang", "DeepSeek"))
    assert cfg.nominal_params > 0


@pytest.mark.parametrize("name", GPT2_FAMILY + GPT3_TABLE_2_1 + LLAMAS + MOES)
def test_every_shape_lands_within_7_percent_of_its_headline_size(name):
    # A typo in a width or a layer count moves the exact count far from the paper's "175B".
    # (The widest gap is GPT-2 small: the paper says 117M, the released model has 124M.)
    cfg = configs.get_model(name)
    assert accounting.param_count(cfg) == pytest.approx(cfg.nominal_params, rel=0.07)


def test_gpt2_shapes_match_hf_config_json():
    # openai-community/gpt2*/config.json: n_embd, n_layer, n_head; n_positions 1024, vocab_size 50257.
    shapes = {name: (cfg.d_model, cfg.n_layers, cfg.n_heads) for name, cfg in _models(GPT2_FAMILY)}
    assert shapes == {
        "gpt2": (768, 12, 12),
        "gpt2-medium": (1024, 24, 16),
        "gpt2-large": (1280, 36, 20),
        "gpt2-xl": (1600, 48, 25),
    }
    for name in GPT2_FAMILY:
        cfg = configs.get_model(name)
        assert (cfg.vocab_size, cfg.max_seq_len, cfg.tied_embeddings, cfg.bias) == (50257, 1024, True, True)


def test_gpt3_175b_is_table_2_1s_last_row():
    cfg = configs.get_model("gpt3-175b")
    # Brown et al. 2020, Table 2.1: n_layers 96, d_model 12288, n_heads 96, d_head 128, n_ctx 2048.
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_head, cfg.max_seq_len) == (96, 12288, 96, 128, 2048)
    assert (cfg.vocab_size, cfg.d_ff, cfg.nominal_params) == (50257, 4 * 12288, 175e9)


def test_gpt3_table_rows_keep_the_printed_d_head():
    # Table 2.1's d_head column: 64, 64, 96, 128, 80, 128, 128, 128.
    assert [configs.get_model(n).d_head for n in GPT3_TABLE_2_1] == [64, 64, 96, 128, 80, 128, 128, 128]


def test_llama_shapes_match_hf_config_json():
    # meta-llama config.json: vocab_size, hidden_size, num_hidden_layers, num_attention_heads,
    # num_key_value_heads, intermediate_size.
    shapes = {
        name: (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff)
        for name, cfg in _models(LLAMAS)
    }
    assert shapes == {
        "llama-2-7b": (32000, 4096, 32, 32, 32, 11008),
        "llama-2-13b": (32000, 5120, 40, 40, 40, 13824),
        "llama-2-70b": (32000, 8192, 80, 64, 8, 28672),
        "llama-3-8b": (128256, 4096, 32, 32, 8, 14336),
        "llama-3-70b": (128256, 8192, 80, 64, 8, 28672),
        "llama-3.1-405b": (128256, 16384, 126, 128, 8, 53248),
    }
    for name in LLAMAS:
        cfg = configs.get_model(name)
        assert (cfg.norm, cfg.mlp, cfg.bias, cfg.tied_embeddings) == ("rmsnorm", "swiglu", False, False)


def test_moe_shapes_match_hf_config_json():
    # mistralai/Mixtral-8x7B-v0.1 and deepseek-ai/DeepSeek-V3 config.json: num_local_experts /
    # n_routed_experts, num_experts_per_tok, n_shared_experts, moe_intermediate_size, first_k_dense_replace.
    mixtral, deepseek = configs.get_model("mixtral-8x7b"), configs.get_model("deepseek-v3")
    moe = [(c.n_experts, c.experts_per_token, c.n_shared_experts, c.expert_d_ff, c.n_dense_layers, c.n_moe_layers)
           for c in (mixtral, deepseek)]  # fmt: skip
    assert moe == [(8, 2, 0, 14336, 0, 32), (256, 8, 1, 2048, 3, 58)]
    assert (mixtral.vocab_size, mixtral.d_model, mixtral.n_layers, mixtral.n_heads, mixtral.n_kv_heads) == (
        32000, 4096, 32, 32, 8)  # fmt: skip
    assert (deepseek.vocab_size, deepseek.d_model, deepseek.n_layers, deepseek.n_heads, deepseek.d_ff) == (
        129280, 7168, 61, 128, 18432)  # fmt: skip
    assert deepseek.latent_attention == configs.LatentAttention(1536, 512, 128, 64, 128)
    assert (deepseek.n_mtp_layers, mixtral.latent_attention) == (1, None)


def test_model_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        configs.get_model("gpt2").n_layers = 2


def test_gpt_config_kwargs_build_the_books_gpt_with_hf_gpt2s_parameter_count():
    from scalebook.model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(**configs.get_model("gpt2").gpt_config_kwargs()))
    assert sum(p.numel() for p in model.parameters()) == 124_439_808


def test_from_gpt_config_reads_a_gpt_config_back():
    cfg = configs.get_model("gpt2-medium")
    back = configs.ModelConfig.from_gpt_config(SimpleNamespace(**cfg.gpt_config_kwargs()), name="gpt2-medium")
    # The published size and batch are not part of the shape a GPTConfig carries.
    assert (
        dataclasses.replace(
            back, source=cfg.source, nominal_params=cfg.nominal_params, batch_sequences=cfg.batch_sequences
        )
        == cfg
    )


def test_gpt_config_kwargs_refuse_a_llama():
    with pytest.raises(ValueError, match="gpt2"):
        configs.get_model("llama-3-8b").gpt_config_kwargs()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(d_model=0), "d_model must be a positive integer"),
        (dict(n_layers=-2), "n_layers must be a positive integer"),
        (dict(vocab_size=50257.0), "vocab_size must be a positive integer"),
        (dict(arch="bert"), "arch must be one of ('gpt', 'llama')"),
        (dict(norm="batchnorm"), "norm must be one of ('layernorm', 'rmsnorm')"),
        (dict(mlp="relu"), "mlp must be one of ('gelu', 'swiglu')"),
        (dict(n_heads=7), "d_model (768) must be divisible by n_heads (7)"),
        (dict(n_kv_heads=5), "must be a multiple of n_kv_heads (5)"),
        (dict(nominal_params=-1), "nominal_params must be positive"),
        (dict(experts_per_token=2), "set n_experts (routed experts per layer) too"),
        (dict(n_experts=8, experts_per_token=9), "experts_per_token must be in [1, n_experts = 8]"),
        (dict(n_experts=8, experts_per_token=2, n_dense_layers=12), "must leave at least one MoE layer"),
        (dict(n_experts=-1), "n_experts must be an integer >= 0"),
        (dict(latent_attention=configs.LatentAttention(0, 512, 128, 64, 128)), "needs the Llama layout"),
    ],
)
def test_bad_model_config_says_what_to_change(change, message):
    with pytest.raises(ValueError, match="invalid ModelConfig") as error:
        dataclasses.replace(configs.get_model("gpt2"), **change)
    assert message in str(error.value)


def test_bad_latent_attention_says_what_to_change():
    with pytest.raises(ValueError, match="kv_lora_rank must be a positive integer, got 0") as error:
        dataclasses.replace(
            configs.get_model("deepseek-v3"), latent_attention=configs.LatentAttention(-1, 0, 128, 64, 128)
        )
    assert "q_lora_rank must be 0 (no query latent) or a positive integer, got -1" in str(error.value)


def test_every_problem_of_a_model_config_is_reported_at_once():
    with pytest.raises(ValueError) as error:
        dataclasses.replace(configs.get_model("gpt2"), d_model=-1, arch="rnn")
    assert "d_model" in str(error.value) and "arch" in str(error.value)


@pytest.mark.parametrize(
    ("lookup", "choice"),
    [(configs.get_model, "llama-3-8b"), (configs.get_hardware, "h100-sxm"), (configs.get_link, "nvlink-4")],
)
def test_unknown_names_list_the_valid_choices(lookup, choice):
    with pytest.raises(ValueError, match="choose one of") as error:
        lookup("gpt-5")
    assert choice in str(error.value)


def test_required_hardware_is_listed():
    assert set(configs.list_hardware()) >= {
        "v100-sxm2-32gb", "a100-sxm4-40gb", "a100-sxm4-80gb", "h100-sxm", "h200", "b200", "mi300x"
    }  # fmt: skip


@pytest.mark.parametrize("name", ["p100-sxm2-16gb", "v100-sxm2-16gb", "v100-sxm2-32gb", "a100-sxm4-40gb",
                                  "a100-sxm4-80gb", "a800-sxm4-80gb", "h100-sxm", "h800-sxm", "h200", "b200",
                                  "mi300x"])  # fmt: skip
def test_hardware_cites_a_datasheet_and_knows_its_link(name):
    hw = configs.get_hardware(name)
    assert "datasheet" in hw.source
    assert set(hw.peak_flops) <= set(configs.DTYPES)
    assert hw.hbm_bytes > 0 and hw.hbm_bandwidth > 0
    assert hw.intra_node_bandwidth == configs.get_link(hw.intra_node_link).bandwidth


@pytest.mark.parametrize("name", ["a100-sxm4-80gb", "h100-sxm", "h200", "b200", "mi300x"])
def test_dense_tensor_peaks_double_with_each_halving_of_precision(name):
    # A sparse figure slipped in among dense ones would break this ladder.
    peak = configs.get_hardware(name).peak_flops
    assert peak["bf16"] == pytest.approx(2 * peak["tf32"], rel=1e-3)
    assert peak["fp16"] == peak["bf16"]
    if "fp8" in peak:
        assert peak["fp8"] == pytest.approx(2 * peak["bf16"], rel=1e-3)


def test_datasheet_numbers():
    a100, h100, mi300x = (configs.get_hardware(n) for n in ("a100-sxm4-80gb", "h100-sxm", "mi300x"))
    # A100 datasheet: BF16 312 TFLOPS dense, 80 GB HBM2e at 2,039 GB/s.
    assert (a100.peak("bf16"), a100.hbm_bytes, a100.hbm_bandwidth) == (312e12, 80e9, 2039e9)
    # H100 SXM datasheet: BF16 1,979 TFLOPS with sparsity, 80 GB HBM3 at 3.35 TB/s.
    assert (h100.peak("bf16"), h100.hbm_bytes, h100.hbm_bandwidth) == (1979e12 / 2, 80e9, 3.35e12)
    # MI300X datasheet: BF16 1,307.4 TFLOPS dense, 192 GB HBM3 at 5.3 TB/s.
    assert (mi300x.peak("bf16"), mi300x.hbm_bytes, mi300x.hbm_bandwidth) == (1307.4e12, 192e9, 5.3e12)
    assert configs.get_hardware("h100-sxm").intra_node_bandwidth == 450e9


def test_the_lecture_notes_gpu_memory_table():
    # The lecture notes' table (P100 16 GB ... H800 80 GB), with the two sizes of V100 and A100, and the
    # chips after it; B200's 192 GB chip is sold in 8-GPU systems that expose 180 GB each.
    hbm_gb = {name: configs.get_hardware(name).hbm_bytes / 1e9 for name in configs.list_hardware()}
    assert hbm_gb == {"p100-sxm2-16gb": 16, "v100-sxm2-16gb": 16, "v100-sxm2-32gb": 32, "a100-sxm4-40gb": 40,
                      "a100-sxm4-80gb": 80, "a800-sxm4-80gb": 80, "h100-sxm": 80, "h800-sxm": 80, "h200": 141,
                      "b200": 180, "mi300x": 192}  # fmt: skip


def test_every_gpu_has_a_year_and_the_registry_runs_in_time_order_up_to_b200():
    years = [configs.get_hardware(name).year for name in configs.list_hardware()]
    assert years[:-1] == sorted(years[:-1]) and years[0] == 2016 and years[-2] == 2025  # MI300X (2023) last


def test_export_versions_differ_only_in_nvlink():
    for export, original in (("a800-sxm4-80gb", "a100-sxm4-80gb"), ("h800-sxm", "h100-sxm")):
        a, b = configs.get_hardware(export), configs.get_hardware(original)
        assert (dict(a.peak_flops), a.hbm_bytes, a.hbm_bandwidth) == (dict(b.peak_flops), b.hbm_bytes, b.hbm_bandwidth)
        assert a.intra_node_bandwidth == 200e9 < b.intra_node_bandwidth  # 400 GB/s both directions


def test_shared_memory_per_sm_from_the_architecture_whitepapers():
    # Pascal 64 KB, Volta 96 KB, Ampere 164 KB, Hopper 228 KB of shared memory per SM (binary KB).
    smem = {name: (hw.sm_count, hw.smem_per_sm_bytes) for name in configs.list_hardware()
            if (hw := configs.get_hardware(name)).smem_per_sm_bytes}  # fmt: skip
    assert smem["p100-sxm2-16gb"] == (56, 64 * 1024)
    assert smem["v100-sxm2-32gb"] == (80, 96 * 1024)
    assert smem["a100-sxm4-80gb"] == (108, 164 * 1024)
    assert smem["h100-sxm"] == smem["h200"] == (132, 228 * 1024)
    assert smem["mi300x"] == (304, 64 * 1024)  # CDNA 3: local data share per compute unit


def test_a_dtype_the_chip_lacks_names_the_ones_it_has():
    with pytest.raises(ValueError, match=r"no 'bf16' peak; choose one of \('fp32', 'fp16'\)"):
        configs.get_hardware("v100-sxm2-32gb").peak("bf16")


def test_nvlink_generations_as_the_lecture_notes_quote_them():
    # NVLink 3.0 600 GB/s (2020), 4.0 900 GB/s (2022), 5.0 1.8 TB/s (2025), 6.0 3.6 TB/s (2026):
    # vendor figures add both directions.
    bidirectional = [configs.get_link(f"nvlink-{g}").bidirectional_bandwidth for g in (1, 2, 3, 4, 5, 6)]
    assert bidirectional == [160e9, 300e9, 600e9, 900e9, 1.8e12, 3.6e12]


def test_network_ports_are_per_direction_and_pcie_is_both():
    assert configs.get_link("infiniband-ndr").bandwidth == 400e9 / 8  # 400 Gb/s each way
    assert configs.get_link("roce-400gbe").bandwidth == 50e9
    assert configs.get_link("pcie-5-x16").bidirectional_bandwidth == 128e9
    assert configs.get_link("pcie-5-x16").bandwidth == 64e9


def test_required_links_are_listed():
    assert set(configs.list_links()) >= {
        "nvlink-3", "nvlink-4", "nvlink-5", "nvlink-6", "infiniband-hdr", "infiniband-ndr", "infiniband-xdr",
        "pcie-4-x16", "pcie-5-x16", "roce-400gbe",
    }  # fmt: skip


# ------------------------------------------------------------------------------------ published batch sizes


def test_gpt3_batches_are_whole_sequences_of_2048():
    # Brown et al. 2020, Table 2.1, batch in tokens: 0.5M, 0.5M, 0.5M, 1M, 1M, 2M, 2M, 3.2M.
    gpt3_names = [name for name in configs.list_models() if name.startswith("gpt3")]
    batches = {name: configs.get_model(name).batch_sequences for name in gpt3_names}
    assert batches == {"gpt3-125m": 256, "gpt3-350m": 256, "gpt3-760m": 256, "gpt3-1.3b": 512, "gpt3-2.7b": 512,
                       "gpt3-6.7b": 1024, "gpt3-13b": 1024, "gpt3-175b": 1536}  # fmt: skip
    gpt3 = configs.get_model("gpt3-175b")
    assert gpt3.batch_tokens == 1536 * 2048 == 3_145_728  # printed "3.2M" in the table
    assert round(300e9 / gpt3.batch_tokens) == 95_367  # optimizer steps for 300B tokens (not 93,750)
    assert configs.get_model("gpt3-125m").batch_tokens == 524_288  # "0.5M"


def test_a_model_without_a_published_batch_says_so():
    assert configs.get_model("llama-3-8b").batch_sequences is None
    with pytest.raises(ValueError, match="no published batch size"):
        _ = configs.get_model("llama-3-8b").batch_tokens
    with pytest.raises(ValueError, match="batch_sequences must be a positive integer"):
        configs.gpt_like("x", vocab_size=8, d_model=8, n_layers=1, n_heads=1, max_seq_len=8, batch_sequences=0)
