"""Published model shapes and hardware numbers, each with the document it comes from.

Three registries, each a frozen dataclass per entry:

- models (:class:`ModelConfig`): the GPT-2 family, the eight rows of GPT-3's Table 2.1, Llama 2, Llama
  3/3.1, and two mixtures of experts: Mixtral 8x7B and DeepSeek-V3 (with its multi-head latent
  attention, :class:`LatentAttention`). ``nominal_params`` is the headline size the paper prints
  (``175e9``); the exact count follows from the shape (``scalebook.accounting.param_count``).
  ``batch_sequences`` is the pre-training batch in sequences of ``max_seq_len`` tokens, where the paper
  gives it: GPT-3's Table 2.1 prints tokens (0.5M, 1M, 2M, 3.2M), which are 256, 512, 1,024 and 1,536
  sequences of 2,048; the last is 1,536 x 2,048 = 3,145,728 tokens, which the table prints as 3.2M, and
  Megatron-LM's GPT-3 175B recipe (``examples/gpt3/train_gpt3_175b_distributed.sh``,
  ``--global-batch-size 1536``) uses the same.
- accelerators (:class:`Hardware`): dense peak FLOP/s per dtype (no 2:4 sparsity), HBM capacity and
  bandwidth, and the intra-node link each GPU has.
- links (:class:`Link`): NVLink generations, InfiniBand, PCIe, RoCE.
- reported bus bandwidths (:class:`ReportedBusBandwidth`): nccl-tests' all-reduce busbw on DGX-class
  systems as NVIDIA's NCCL engineers reported it, with the link that bounds it.

Units are SI: bytes, bytes per second, FLOP per second; "GB" means 1e9 bytes, as on the datasheets.

Source: Radford et al. 2019 (GPT-2), Table 2; Brown et al. 2020 (GPT-3), Table 2.1; Touvron et al.
2023 (Llama 2), Table 1; Grattafiori et al. 2024 (The Llama 3 Herd of Models), Table 3; Jiang et al. 2024
(Mixtral of Experts); DeepSeek-AI 2024 (DeepSeek-V3 Technical Report), Sec. 2 and 4.2; the
Hugging Face ``config.json`` of each released checkpoint; NVIDIA and AMD datasheets named per entry; NVIDIA's
nccl and nccl-tests issue threads named per reported bus bandwidth.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

ARCHS = ("gpt", "llama")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")

GB = 10**9
TB = 10**12
KIB = 2**10  # shared memory is quoted in binary kilobytes
TFLOPS = 1e12


@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek's multi-head latent attention (MLA): keys and values pass through a low-rank latent.

    Per layer, width d and n_h heads: queries are ``W_DQ`` (d -> q_lora_rank), an RMSNorm, ``W_UQ``
    (q_lora_rank -> n_h (qk_nope + qk_rope)); keys and values share one down-projection ``W_DKV``
    (d -> kv_lora_rank + qk_rope, the rope part a single key shared by all heads), an RMSNorm on the
    latent, and ``W_UKV`` (kv_lora_rank -> n_h (qk_nope + v)); the output projection is n_h v -> d.
    ``q_lora_rank=0`` means queries are projected directly, d -> n_h (qk_nope + qk_rope).
    """

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def problems(self) -> list[str]:
        fields = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        found = [f"{a} must be a positive integer, got {getattr(self, a)!r}" for a in fields
                 if not _is_positive_int(getattr(self, a))]  # fmt: skip
        if self.q_lora_rank != 0 and not _is_positive_int(self.q_lora_rank):
            found.append(f"q_lora_rank must be 0 (no query latent) or a positive integer, got {self.q_lora_rank!r}")
        return found


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _moe_problems(cfg: ModelConfig) -> list[str]:
    """What is wrong with the mixture-of-experts and latent-attention fields of ``cfg``."""
    problems = []
    for attr in ("n_experts", "experts_per_token", "n_shared_experts", "n_dense_layers", "n_mtp_layers"):
        value = getattr(cfg, attr)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            problems.append(f"{attr} must be an integer >= 0, got {value!r}")
    if problems:
        return problems
    if cfg.n_experts == 0:
        if cfg.experts_per_token or cfg.n_shared_experts or cfg.n_dense_layers or cfg.d_ff_expert is not None:
            problems.append(
                "experts_per_token, n_shared_experts, n_dense_layers and d_ff_expert describe "
                "mixture-of-experts layers: set n_experts (routed experts per layer) too"
            )
    else:
        if not 1 <= cfg.experts_per_token <= cfg.n_experts:
            problems.append(
                f"experts_per_token must be in [1, n_experts = {cfg.n_experts}], got {cfg.experts_per_token!r}"
            )
        if cfg.n_dense_layers >= cfg.n_layers:
            problems.append(
                f"n_dense_layers ({cfg.n_dense_layers}) must leave at least one MoE layer of the {cfg.n_layers}"
            )
        if cfg.d_ff_expert is not None and not _is_positive_int(cfg.d_ff_expert):
            problems.append(f"d_ff_expert must be a positive integer or None (= d_ff), got {cfg.d_ff_expert!r}")
    if cfg.latent_attention is not None:
        if not isinstance(cfg.latent_attention, LatentAttention):
            problems.append("latent_attention must be a LatentAttention or None")
        elif cfg.arch != "llama" or cfg.bias:
            problems.append("latent_attention needs the Llama layout (arch='llama', no biases)")
        else:
            problems.extend(cfg.latent_attention.problems())
    return problems


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only Transformer: everything that sets its parameter count and FLOPs.

    ``arch="gpt"`` means learned absolute position embeddings (``max_seq_len`` rows); ``"llama"``
    means rotary positions, which have no parameters.

    A mixture of experts (``n_experts`` > 0) replaces the MLP of every layer after the first
    ``n_dense_layers`` by ``n_experts`` routed experts of width ``d_ff_expert`` (``d_ff`` if None), of
    which a router sends each token to ``experts_per_token``, plus ``n_shared_experts`` that every
    token passes through; ``d_ff`` stays the width of the dense layers' MLP. ``n_mtp_layers``
    multi-token-prediction modules ship beside the model but are not part of it (not counted).
    """

    name: str
    arch: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_seq_len: int
    tied_embeddings: bool
    bias: bool
    norm: str
    mlp: str
    source: str = "user-defined"
    nominal_params: float | None = None
    batch_sequences: int | None = None  # the published pre-training batch, in sequences of max_seq_len
    nominal_active_params: float | None = None  # a mixture of experts' headline active size (13e9)
    n_experts: int = 0  # routed experts per MoE layer; 0: a dense model
    experts_per_token: int = 0  # routed experts each token goes to (top-k)
    n_shared_experts: int = 0  # experts every token goes through (DeepSeekMoE)
    d_ff_expert: int | None = None  # one expert's MLP width; None: d_ff
    n_dense_layers: int = 0  # leading layers that keep a dense MLP of width d_ff
    latent_attention: LatentAttention | None = None  # DeepSeek's MLA; None: (grouped-query) attention
    n_mtp_layers: int = 0  # multi-token-prediction modules shipped beside the model, not counted in it

    def __post_init__(self):
        problems = []
        for attr in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            value = getattr(self, attr)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{attr} must be a positive integer, got {value!r}")
        for attr, choices in (("arch", ARCHS), ("norm", NORMS), ("mlp", MLPS)):
            if getattr(self, attr) not in choices:
                problems.append(f"{attr} must be one of {choices}, got {getattr(self, attr)!r}")
        if not problems:
            if self.d_model % self.n_heads:
                problems.append(
                    f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}); change one of them"
                )
            if self.n_heads % self.n_kv_heads:
                problems.append(
                    f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}) "
                    "so that every key/value head serves the same number of query heads"
                )
        if self.nominal_params is not None and not self.nominal_params > 0:
            problems.append(f"nominal_params must be positive, got {self.nominal_params!r}")
        if self.batch_sequences is not None and (
            not isinstance(self.batch_sequences, int)
            or isinstance(self.batch_sequences, bool)
            or self.batch_sequences < 1
        ):
            problems.append(f"batch_sequences must be a positive integer or None, got {self.batch_sequences!r}")
        problems.extend(_moe_problems(self))
        if problems:
            raise ValueError(f"invalid ModelConfig {self.name!r}: " + "; ".join(problems))

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_kv(self) -> int:
        """Width of the key (and of the value) projection: n_kv_heads * d_head (d_model without GQA)."""
        return self.n_kv_heads * self.d_head

    @property
    def batch_tokens(self) -> int:
        """Tokens per optimizer step of the published pre-training batch: batch_sequences * max_seq_len."""
        if self.batch_sequences is None:
            raise ValueError(f"{self.name!r} has no published batch size (batch_sequences is None)")
        return self.batch_sequences * self.max_seq_len

    @property
    def learned_positions(self) -> bool:
        return self.arch == "gpt"

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def n_moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts (0 for a dense model)."""
        return self.n_layers - self.n_dense_layers if self.is_moe else 0

    @property
    def expert_d_ff(self) -> int:
        """MLP width of one expert (routed or shared)."""
        return self.d_ff if self.d_ff_expert is None else self.d_ff_expert

    def gpt_config_kwargs(self) -> dict:
        """Keyword arguments for ``scalebook.model.GPTConfig`` describing the same network."""
        if self.arch != "gpt" or self.d_ff != 4 * self.d_model or self.n_kv_heads != self.n_heads:
            raise ValueError(
                f"{self.name!r} is not a GPT-2-layout model (arch='gpt', d_ff = 4 * d_model, n_kv_heads = "
                "n_heads), which is the only layout scalebook.model.GPT builds; pick a gpt2* or gpt3* config"
            )
        return dict(
            vocab_size=self.vocab_size,
            block_size=self.max_seq_len,
            n_layer=self.n_layers,
            n_head=self.n_heads,
            n_embd=self.d_model,
            bias=self.bias,
        )

    @classmethod
    def from_gpt_config(cls, config, name: str = "scalebook GPT") -> ModelConfig:
        """The ModelConfig of a ``scalebook.model.GPTConfig`` (read by attribute: torch stays unimported)."""
        return gpt_like(
            name,
            vocab_size=config.vocab_size,
            d_model=config.n_embd,
            n_layers=config.n_layer,
            n_heads=config.n_head,
            max_seq_len=config.block_size,
            bias=config.bias,
            source="built from a scalebook.model.GPTConfig",
        )


def gpt_like(
    name: str,
    *,
    vocab_size: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    max_seq_len: int,
    nominal_params: float | None = None,
    source: str = "user-defined",
    bias: bool = True,
    batch_sequences: int | None = None,
) -> ModelConfig:
    """A GPT-2-layout model: learned positions, LayerNorm, 4x GELU MLP, biases, tied LM head."""
    return ModelConfig(
        name=name,
        arch="gpt",
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_heads,
        d_ff=4 * d_model,
        max_seq_len=max_seq_len,
        tied_embeddings=True,
        bias=bias,
        norm="layernorm",
        mlp="gelu",
        source=source,
        nominal_params=nominal_params,
        batch_sequences=batch_sequences,
    )


def llama_like(
    name: str,
    *,
    vocab_size: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    d_ff: int,
    max_seq_len: int,
    nominal_params: float | None = None,
    source: str = "user-defined",
    tied_embeddings: bool = False,
    batch_sequences: int | None = None,
    **moe,
) -> ModelConfig:
    """A Llama-layout model: rotary positions, RMSNorm, SwiGLU MLP, no biases, untied LM head.

    ``moe``: the mixture-of-experts and latent-attention fields of :class:`ModelConfig`
    (``n_experts``, ``experts_per_token``, ...), each expert a SwiGLU MLP.
    """
    return ModelConfig(
        name=name,
        arch="llama",
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_ff=d_ff,
        max_seq_len=max_seq_len,
        tied_embeddings=tied_embeddings,
        bias=False,
        norm="rmsnorm",
        mlp="swiglu",
        source=source,
        nominal_params=nominal_params,
        batch_sequences=batch_sequences,
        **moe,
    )


_GPT2 = (
    "Radford et al. 2019, 'Language Models are Unsupervised Multitask Learners', Table 2 (headline size), "
    "Sec. 2.3 (batch size 512); "
    "Hugging Face openai-community/{hf} config.json (n_embd, n_layer, n_head; n_positions 1024, "
    "vocab_size 50257)"
)
_GPT3 = (
    "Brown et al. 2020, 'Language Models are Few-Shot Learners', Table 2.1 (n_ctx 2048 for every size; batch "
    "in tokens, here in whole sequences of 2048); "
    "same architecture and 50257-token BPE as GPT-2"
)
_LLAMA2 = (
    "Touvron et al. 2023, 'Llama 2: Open Foundation and Fine-Tuned Chat Models', Table 1 (context 4096, "
    "GQA for 70B); Hugging Face meta-llama/{hf} config.json"
)
_LLAMA3 = (
    "Grattafiori et al. 2024, 'The Llama 3 Herd of Models', Table 3 (vocabulary 128K, 8 KV heads); "
    "Hugging Face meta-llama/{hf} config.json"
)

_MIXTRAL = (
    "Jiang et al. 2024, 'Mixtral of Experts', Sec. 2 (8 experts, top-2, 47B parameters, 13B active); Hugging "
    "Face mistralai/Mixtral-8x7B-v0.1 config.json (hidden_size 4096, intermediate_size 14336, 32 layers, "
    "32 heads, 8 KV heads, num_local_experts 8, num_experts_per_tok 2, vocab_size 32000, "
    "max_position_embeddings 32768)"
)
_DEEPSEEK_V3 = (
    "DeepSeek-AI 2024, 'DeepSeek-V3 Technical Report', Sec. 4.2 (671B total, 37B activated per token; "
    "the Hub's 685B adds the 14B multi-token-prediction module, README_WEIGHTS.md); Hugging Face "
    "deepseek-ai/DeepSeek-V3 config.json (hidden_size 7168, 61 layers, 128 heads, intermediate_size 18432, "
    "moe_intermediate_size 2048, n_routed_experts 256, num_experts_per_tok 8, n_shared_experts 1, "
    "first_k_dense_replace 3, q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim "
    "64, v_head_dim 128, vocab_size 129280, max_position_embeddings 163840, num_nextn_predict_layers 1)"
)

_MODELS = (
    gpt_like("gpt2", vocab_size=50257, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024,
             nominal_params=117e6, source=_GPT2.format(hf="gpt2"), batch_sequences=512),
    gpt_like("gpt2-medium", vocab_size=50257, d_model=1024, n_layers=24, n_heads=16, max_seq_len=1024,
             nominal_params=345e6, source=_GPT2.format(hf="gpt2-medium"), batch_sequences=512),
    gpt_like("gpt2-large", vocab_size=50257, d_model=1280, n_layers=36, n_heads=20, max_seq_len=1024,
             nominal_params=762e6, source=_GPT2.format(hf="gpt2-large"), batch_sequences=512),
    gpt_like("gpt2-xl", vocab_size=50257, d_model=1600, n_layers=48, n_heads=25, max_seq_len=1024,
             nominal_params=1542e6, source=_GPT2.format(hf="gpt2-xl"), batch_sequences=512),
    gpt_like("gpt3-125m", vocab_size=50257, d_model=768, n_layers=12, n_heads=12, max_seq_len=2048,
             nominal_params=125e6, source=_GPT3 + " (GPT-3 Small)", batch_sequences=256),
    gpt_like("gpt3-350m", vocab_size=50257, d_model=1024, n_layers=24, n_heads=16, max_seq_len=2048,
             nominal_params=350e6, source=_GPT3 + " (GPT-3 Medium)", batch_sequences=256),
    gpt_like("gpt3-760m", vocab_size=50257, d_model=1536, n_layers=24, n_heads=16, max_seq_len=2048,
             nominal_params=760e6, source=_GPT3 + " (GPT-3 Large)", batch_sequences=256),
    # Table 2.1 prints 24 heads of d_head 128 for GPT-3 XL, which cannot tile d_model 2048 (24 * 128 =
    # 3072); keeping d_model and d_head gives 16 heads, and d_model alone sets the 1.3B.
    gpt_like("gpt3-1.3b", vocab_size=50257, d_model=2048, n_layers=24, n_heads=16, max_seq_len=2048,
             nominal_params=1.3e9, source=_GPT3 + " (GPT-3 XL; the table's 24 heads x 128 do not make 2048)",
             batch_sequences=512),
    gpt_like("gpt3-2.7b", vocab_size=50257, d_model=2560, n_layers=32, n_heads=32, max_seq_len=2048,
             nominal_params=2.7e9, source=_GPT3, batch_sequences=512),
    gpt_like("gpt3-6.7b", vocab_size=50257, d_model=4096, n_layers=32, n_heads=32, max_seq_len=2048,
             nominal_params=6.7e9, source=_GPT3, batch_sequences=1024),
    # Table 2.1 prints d_model 5140 for 13B, but its 40 heads of d_head 128 make 5120.
    gpt_like("gpt3-13b", vocab_size=50257, d_model=5120, n_layers=40, n_heads=40, max_seq_len=2048,
             nominal_params=13.0e9, source=_GPT3 + " (the table prints d_model 5140; 40 heads x 128 = 5120)",
             batch_sequences=1024),
    gpt_like("gpt3-175b", vocab_size=50257, d_model=12288, n_layers=96, n_heads=96, max_seq_len=2048,
             nominal_params=175.0e9, source=_GPT3, batch_sequences=1536),
    llama_like("llama-2-7b", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
               d_ff=11008, max_seq_len=4096, nominal_params=7e9, source=_LLAMA2.format(hf="Llama-2-7b-hf")),
    llama_like("llama-2-13b", vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, n_kv_heads=40,
               d_ff=13824, max_seq_len=4096, nominal_params=13e9, source=_LLAMA2.format(hf="Llama-2-13b-hf")),
    llama_like("llama-2-70b", vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
               d_ff=28672, max_seq_len=4096, nominal_params=70e9, source=_LLAMA2.format(hf="Llama-2-70b-hf")),
    llama_like("llama-3-8b", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
               d_ff=14336, max_seq_len=8192, nominal_params=8e9, source=_LLAMA3.format(hf="Meta-Llama-3-8B")),
    llama_like("llama-3-70b", vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
               d_ff=28672, max_seq_len=8192, nominal_params=70e9,
               source=_LLAMA3.format(hf="Meta-Llama-3-70B")),
    llama_like("llama-3.1-405b", vocab_size=128256, d_model=16384, n_layers=126, n_heads=128, n_kv_heads=8,
               d_ff=53248, max_seq_len=131072, nominal_params=405e9,
               source=_LLAMA3.format(hf="Llama-3.1-405B")),
    llama_like("mixtral-8x7b", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
               d_ff=14336, max_seq_len=32768, nominal_params=47e9, nominal_active_params=13e9,
               n_experts=8, experts_per_token=2, source=_MIXTRAL),
    llama_like("deepseek-v3", vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, n_kv_heads=128,
               d_ff=18432, max_seq_len=163840, nominal_params=671e9, nominal_active_params=37e9,
               n_experts=256, experts_per_token=8, n_shared_experts=1, d_ff_expert=2048, n_dense_layers=3,
               latent_attention=LatentAttention(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                                qk_rope_head_dim=64, v_head_dim=128),
               n_mtp_layers=1, source=_DEEPSEEK_V3),
)  # fmt: skip
MODELS = MappingProxyType({m.name: m for m in _MODELS})


@dataclass(frozen=True)
class Link:
    """A point-to-point interconnect.

    ``bandwidth`` is per direction: the bytes per second one GPU can send while it also receives at
    the same rate, which is what a ring step of a collective sees. Vendors quote NVLink and PCIe as the
    sum of both directions (``bidirectional_bandwidth``) and network ports (InfiniBand, Ethernet) per
    direction in bits per second.
    """

    name: str
    bandwidth: float
    source: str

    @property
    def bidirectional_bandwidth(self) -> float:
        return 2 * self.bandwidth


_LINKS = (
    Link("nvlink-1", 160 * GB / 2, "NVIDIA Tesla P100 datasheet: NVLink 160 GB/s, both directions (2016)"),
    Link("nvlink-2", 300 * GB / 2, "NVIDIA Tesla V100 datasheet: NVLink 300 GB/s, both directions (2017)"),
    Link("nvlink-3", 600 * GB / 2, "NVIDIA A100 datasheet: NVLink 600 GB/s, both directions (2020)"),
    Link("nvlink-4", 900 * GB / 2, "NVIDIA H100 datasheet: NVLink 900 GB/s, both directions (2022)"),
    Link("nvlink-5", 1.8 * TB / 2, "NVIDIA Blackwell (HGX B200) specifications: NVLink 1.8 TB/s per GPU, "
         "both directions (2025)"),
    Link("nvlink-6", 3.6 * TB / 2, "NVIDIA Vera Rubin announcement: NVLink 6 3.6 TB/s per GPU, "
         "both directions (2026)"),
    Link("nvlink-a800-h800", 400 * GB / 2, "NVIDIA A800 and H800 datasheets: NVLink 400 GB/s, both directions "
         "(the export versions of the A100 and H100)"),
    Link("infinity-fabric-mi300x", 896 * GB / 2, "AMD Instinct MI300X datasheet: 7 Infinity Fabric links, "
         "896 GB/s aggregate, both directions"),
    Link("infiniband-hdr", 200e9 / 8, "NVIDIA ConnectX-6 HDR InfiniBand: 200 Gb/s per port, per direction"),
    Link("infiniband-ndr", 400e9 / 8, "NVIDIA ConnectX-7 NDR InfiniBand: 400 Gb/s per port, per direction"),
    Link("infiniband-xdr", 800e9 / 8, "NVIDIA ConnectX-8 XDR InfiniBand: 800 Gb/s per port, per direction"),
    Link("roce-400gbe", 400e9 / 8, "NVIDIA ConnectX-7 400GbE (RoCE): 400 Gb/s per port, per direction"),
    Link("pcie-4-x16", 64 * GB / 2, "PCI-SIG PCIe 4.0: 16 GT/s x 16 lanes = 64 GB/s both directions "
         "(31.5 GB/s per direction after 128b/130b encoding)"),
    Link("pcie-5-x16", 128 * GB / 2, "PCI-SIG PCIe 5.0: 32 GT/s x 16 lanes = 128 GB/s both directions "
         "(63 GB/s per direction after 128b/130b encoding)"),
)  # fmt: skip
LINKS = MappingProxyType({link.name: link for link in _LINKS})


@dataclass(frozen=True)
class ReportedBusBandwidth:
    """A collective's bus bandwidth on a real system, as NVIDIA's NCCL engineers reported it (vendor-reported).

    ``busbw`` (and ``algbw`` where given) are nccl-tests' columns, bytes per second
    (:func:`scalebook.accounting.comm.busbw`). ``gpus`` is the number of ranks measured (None: several nodes,
    count not given). The bound they are compared with is ``links`` times the per-direction bandwidth of
    ``link``: a GPU's NVLink entry is already its total to the switch (``links=1``); a ring across nodes
    crosses the network once per node on each of the node's ports, which NCCL drives as parallel rings,
    so its busbw is bounded by the node's ports together (``links`` = ports per node).
    """

    name: str
    system: str
    op: str
    gpus: int | None
    algorithm: str  # "ring", or "nvls" (NVLink SHARP: the NVSwitch adds)
    busbw: float
    link: str
    links: int
    source: str
    algbw: float | None = None

    @property
    def bound(self) -> float:
        """The datasheet bandwidth per direction that busbw is compared with: ``links`` times the link's."""
        return self.links * LINKS[self.link].bandwidth


_NCCL_TESTS_212 = (
    "NVIDIA/nccl-tests issue #212 (2024-05-06), S. Jeaugey (NVIDIA, NCCL): 450 GB/s is the NVLink line rate; "
    "with ~20 % protocol overhead NCCL reaches ~370 GB/s busbw with NCCL_ALGO=RING or for non-allreduce "
    "operations; all-reduce uses NVLink SHARP by default and peaks near 480 GB/s busbw (algbw ~275 GB/s) on "
    "8 GPUs, where neither number is the bandwidth on the wire"
)
_REPORTED_BUSBW = (
    ReportedBusBandwidth(
        "a100-nvlink-ring", "8x A100 SXM4 80GB in one node (NVLink 3 through NVSwitch)", "all_reduce", 8, "ring",
        230 * GB, "nvlink-3", 1,
        "NVIDIA/nccl-tests issue #149 (2023-07-05), S. Jeaugey (NVIDIA, NCCL): 12 NVLinks of 25 GB/s line rate "
        "each way give ~20 GB/s effective each with 128-byte payloads, 240 GB/s in all, and other bottlenecks "
        "on the GPU limit all_reduce_perf to ~230 GB/s busbw"),
    ReportedBusBandwidth(
        "h100-nvlink-ring", "8x H100 SXM in one node (NVLink 4 through NVSwitch), NCCL_ALGO=RING", "all_reduce",
        8, "ring", 370 * GB, "nvlink-4", 1, _NCCL_TESTS_212),
    ReportedBusBandwidth(
        "h100-nvlink-nvls", "8x H100 SXM in one node, NVLink SHARP (NCCL's default all-reduce there)",
        "all_reduce", 8, "nvls", 480 * GB, "nvlink-4", 1, _NCCL_TESTS_212, algbw=275 * GB),
    ReportedBusBandwidth(
        "a100-infiniband-hdr-ring", "DGX A100 nodes, 8x 200 Gb/s HDR InfiniBand per node, across nodes",
        "all_reduce", None, "ring", 192 * GB, "infiniband-hdr", 8,
        "NVIDIA/nccl issue #812 (2023-03-31), NVIDIA NCCL team (AddyLaddy): on DGX A100 systems with "
        "8x 200 Gb/s IB cards, 192 GB/s all-reduce busbw measured"),
)  # fmt: skip
REPORTED_BUSBW = MappingProxyType({r.name: r for r in _REPORTED_BUSBW})


@dataclass(frozen=True)
class Hardware:
    """One accelerator as its datasheet describes it.

    ``peak_flops`` maps a dtype to dense peak FLOP/s: tensor-core (matrix) throughput for tf32, bf16,
    fp16 and fp8, and ordinary (non-tensor) throughput for fp32. Datasheets print the tensor-core
    figures "with sparsity" (2:4 structured), twice the dense rate; the values here are halved. A
    dtype the chip cannot run on its matrix units is absent. ``hbm_bytes`` is the datasheet capacity
    in decimal GB (the chips hold GiB, about 7 % more, minus what the driver reserves). ``year`` is the
    year the chip shipped; ``sm_count`` and ``smem_per_sm_bytes`` (the largest shared memory one streaming
    multiprocessor can give its thread blocks, binary KB) size a FlashAttention tile, where the vendor
    publishes them.
    """

    name: str
    peak_flops: Mapping[str, float] = field(hash=False)  # a read-only mapping: entries are shared
    hbm_bytes: int
    hbm_bandwidth: float
    intra_node_link: str
    source: str
    year: int | None = None
    sm_count: int | None = None
    smem_per_sm_bytes: int | None = None

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s in ``dtype``."""
        if dtype not in self.peak_flops:
            raise ValueError(f"{self.name} has no {dtype!r} peak; choose one of {tuple(self.peak_flops)}")
        return self.peak_flops[dtype]

    @property
    def intra_node_bandwidth(self) -> float:
        """Per-direction bandwidth of this GPU's link to its node peers, B/s."""
        return LINKS[self.intra_node_link].bandwidth


def _hardware(name, peaks, hbm_gb, hbm_bandwidth, link, source, *, year, sms=None, smem_kib=None) -> Hardware:
    smem = None if smem_kib is None else smem_kib * KIB
    return Hardware(name, MappingProxyType(peaks), int(hbm_gb * GB), hbm_bandwidth, link, source, year, sms, smem)


_HARDWARE = (
    _hardware("p100-sxm2-16gb", {"fp32": 10.6 * TFLOPS, "fp16": 21.2 * TFLOPS}, 16, 732 * GB, "nvlink-1",
              "NVIDIA Tesla P100 datasheet (SXM2): FP32 10.6, FP16 21.2 TFLOPS (packed half2 on the CUDA cores: "
              "no tensor cores yet), 16 GB HBM2 at 732 GB/s, NVLink 160 GB/s; Pascal GP100 whitepaper: 56 SMs, "
              "64 KB shared memory per SM", year=2016, sms=56, smem_kib=64),
    _hardware("v100-sxm2-16gb", {"fp32": 15.7 * TFLOPS, "fp16": 125 * TFLOPS}, 16, 900 * GB, "nvlink-2",
              "NVIDIA Tesla V100 datasheet (SXM2): FP32 15.7 TFLOPS, Tensor 125 TFLOPS (FP16, no sparsity "
              "support), 16 GB HBM2 at 900 GB/s, NVLink 300 GB/s; Volta GV100 whitepaper: 80 SMs, up to 96 KB "
              "shared memory per SM", year=2017, sms=80, smem_kib=96),
    _hardware("v100-sxm2-32gb", {"fp32": 15.7 * TFLOPS, "fp16": 125 * TFLOPS}, 32, 900 * GB, "nvlink-2",
              "NVIDIA Tesla V100 datasheet (SXM2): FP32 15.7 TFLOPS, Tensor 125 TFLOPS (FP16, no sparsity "
              "support), 32 GB HBM2 at 900 GB/s, NVLink 300 GB/s; Volta GV100 whitepaper: 80 SMs, up to 96 KB "
              "shared memory per SM (the 32 GB card shipped in 2018)", year=2018, sms=80, smem_kib=96),
    _hardware("a100-sxm4-40gb",
              {"fp32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS, "bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS},
              40, 1555 * GB, "nvlink-3",
              "NVIDIA A100 Tensor Core GPU datasheet (SXM): FP32 19.5, TF32 156 (312 sparse), BF16/FP16 312 "
              "(624 sparse) TFLOPS; 40 GB HBM2 at 1,555 GB/s; NVLink 600 GB/s; Ampere GA100 whitepaper: 108 SMs, "
              "up to 164 KB shared memory per SM", year=2020, sms=108, smem_kib=164),
    _hardware("a100-sxm4-80gb",
              {"fp32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS, "bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS},
              80, 2039 * GB, "nvlink-3",
              "NVIDIA A100 Tensor Core GPU datasheet (SXM): FP32 19.5, TF32 156 (312 sparse), BF16/FP16 312 "
              "(624 sparse) TFLOPS; 80 GB HBM2e at 2,039 GB/s; NVLink 600 GB/s; Ampere GA100 whitepaper: 108 SMs, "
              "up to 164 KB shared memory per SM", year=2020, sms=108, smem_kib=164),
    _hardware("a800-sxm4-80gb",
              {"fp32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS, "bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS},
              80, 2039 * GB, "nvlink-a800-h800",
              "NVIDIA A800 Tensor Core GPU datasheet (SXM): the A100 80 GB's compute and memory (BF16/FP16 312 "
              "TFLOPS dense, 80 GB HBM2e at 2,039 GB/s) with NVLink cut to 400 GB/s for export", year=2022),
    _hardware("h100-sxm",
              {"fp32": 67 * TFLOPS, "tf32": 989 / 2 * TFLOPS, "bf16": 1979 / 2 * TFLOPS,
               "fp16": 1979 / 2 * TFLOPS, "fp8": 3958 / 2 * TFLOPS},
              80, 3.35 * TB, "nvlink-4",
              "NVIDIA H100 Tensor Core GPU datasheet (SXM): FP32 67, TF32 989, BF16/FP16 1,979, FP8 3,958 "
              "TFLOPS with sparsity (dense is half); 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s; NVIDIA H100 "
              "Tensor Core GPU Architecture whitepaper: 132 SMs (SXM5), up to 228 KB shared memory per SM",
              year=2022, sms=132, smem_kib=228),
    _hardware("h800-sxm",
              {"fp32": 67 * TFLOPS, "tf32": 989 / 2 * TFLOPS, "bf16": 1979 / 2 * TFLOPS,
               "fp16": 1979 / 2 * TFLOPS, "fp8": 3958 / 2 * TFLOPS},
              80, 3.35 * TB, "nvlink-a800-h800",
              "NVIDIA H800 Tensor Core GPU datasheet (SXM): the H100 SXM's tensor throughput and 80 GB HBM3 at "
              "3.35 TB/s, with NVLink cut to 400 GB/s for export; DeepSeek-V3 (DeepSeek-AI 2024, Sec. 3.1) "
              "trained on 2,048 of them", year=2023),
    _hardware("h200",
              {"fp32": 67 * TFLOPS, "tf32": 989 / 2 * TFLOPS, "bf16": 1979 / 2 * TFLOPS,
               "fp16": 1979 / 2 * TFLOPS, "fp8": 3958 / 2 * TFLOPS},
              141, 4.8 * TB, "nvlink-4",
              "NVIDIA H200 Tensor Core GPU datasheet (SXM): FP32 67, TF32 989, BF16/FP16 1,979, FP8 3,958 "
              "TFLOPS with sparsity (dense is half); 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s; the same GH100 "
              "chip as the H100 (132 SMs, up to 228 KB shared memory per SM)", year=2024, sms=132, smem_kib=228),
    _hardware("b200",
              {"tf32": 18e15 / 8 / 2, "bf16": 36e15 / 8 / 2, "fp16": 36e15 / 8 / 2, "fp8": 72e15 / 8 / 2},
              1440 / 8, 64 * TB / 8, "nvlink-5",
              "NVIDIA DGX B200 datasheet / HGX B200 specifications, 8 GPUs: TF32 18, BF16/FP16 36, FP8 72 "
              "PFLOPS with sparsity; 1,440 GB HBM3e at 64 TB/s; NVLink 1.8 TB/s per GPU. Per GPU: total / 8, "
              "dense = half (the chip carries 192 GB, of which these systems expose 180 GB)", year=2025),
    _hardware("mi300x",
              {"fp32": 163.4 * TFLOPS, "tf32": 653.7 * TFLOPS, "bf16": 1307.4 * TFLOPS,
               "fp16": 1307.4 * TFLOPS, "fp8": 2614.9 * TFLOPS},
              192, 5.3 * TB, "infinity-fabric-mi300x",
              "AMD Instinct MI300X datasheet: FP32 163.4, TF32 653.7, BF16/FP16 1,307.4, FP8 2,614.9 TFLOPS "
              "dense (sparsity doubles them); 192 GB HBM3 at 5.3 TB/s; Infinity Fabric 896 GB/s; AMD CDNA 3 "
              "whitepaper: 304 compute units, 64 KB local data share per CU", year=2023, sms=304, smem_kib=64),
)  # fmt: skip
HARDWARE = MappingProxyType({h.name: h for h in _HARDWARE})


def _lookup(registry, kind: str, name: str):
    if not isinstance(name, str) or name.lower() not in registry:
        raise ValueError(f"unknown {kind} {name!r}; choose one of {', '.join(registry)}")
    return registry[name.lower()]


def get_model(name: str) -> ModelConfig:
    """The published configuration called ``name`` (see :func:`list_models`)."""
    return _lookup(MODELS, "model", name)


def list_models() -> list[str]:
    """Names of every model ``get_model`` knows, in registry order."""
    return list(MODELS)


def get_hardware(name: str) -> Hardware:
    """The accelerator called ``name`` (see :func:`list_hardware`)."""
    return _lookup(HARDWARE, "hardware", name)


def list_hardware() -> list[str]:
    """Names of every accelerator ``get_hardware`` knows, in registry order."""
    return list(HARDWARE)


def get_link(name: str) -> Link:
    """The interconnect called ``name`` (see :func:`list_links`)."""
    return _lookup(LINKS, "link", name)


def list_links() -> list[str]:
    """Names of every interconnect ``get_link`` knows, in registry order."""
    return list(LINKS)


def get_reported_busbw(name: str) -> ReportedBusBandwidth:
    """The vendor-reported bus bandwidth called ``name`` (see :func:`list_reported_busbw`)."""
    return _lookup(REPORTED_BUSBW, "reported bus bandwidth", name)


def list_reported_busbw() -> list[str]:
    """Names of every vendor-reported bus bandwidth, in registry order."""
    return list(REPORTED_BUSBW)
