"""The layout of a parallel run: degrees of DP x TP x PP x CP (x EP), the data-parallel wrapper, its checks
and its process groups.

A layout is a factorization of the world into degrees, ``world = pp * dp * cp * tp``. Ranks are laid
out as in Megatron-LM with tensor parallelism innermost, so that the tp ranks of one group are
consecutive (on one node, where the fast links are), then context, then data, and pipeline outermost:

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

Expert parallelism does not multiply the world: as in torchtitan and Megatron-LM, the experts are
sharded over ``ep`` of the data-parallel ranks (``ep`` must divide ``dp``), which hold different tokens
anyway. For every dimension, the ranks whose other coordinates agree form one process group; every rank
must create every group, in the same order (``torch.distributed.new_group`` is collective). Two more
groups serve the gradients: ``dp_cp``, the ranks that hold the same parameters and average their
gradients (context-parallel ranks see different tokens of the same sequences, so they average too), and
``edp``, the ranks that hold the same experts.

:meth:`ParallelDims.build` checks a layout against the model and the batch before any process group
exists, and reports every problem at once, each naming the command-line flag that changes it.

Source: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Sec. 3 (PTD-P); Megatron-LM ``megatron/core/parallel_state.py`` (rank order
tp-cp-ep-dp-pp); torchtitan ``torchtitan/distributed/parallel_dims.py`` (``ParallelDims`` validation).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from types import SimpleNamespace

import torch.distributed as dist

DIMS = ("pp", "dp", "cp", "tp")  # outermost to innermost
GROUPS = (*DIMS, "ep", "dp_cp", "edp")
# How the replicas (dp x cp ranks) keep their gradients in step: the book's DDP (Ch. 10), PyTorch's DDP and
# FSDP2, the book's ZeRO stages (Ch. 11).
DATA_PARALLEL = ("ddp", "torch-ddp", "fsdp", "zero1", "zero2", "zero3")
# Wrappers whose gradients end the backward pass sharded over the replicas, not replicated.
SHARDED_GRADIENTS = ("fsdp", "zero2", "zero3")
# The combinations parallelize() does not compose, and why (checked by ParallelDims.build): a data-parallel
# wrapper or a dimension, and a dimension.
_PER_MICRO_BATCH = ("is not composed with the 1F1B schedule here: it reduce-scatters inside every backward pass "
                    "(and ZeRO-3 gathers around every forward), which the schedule interleaves across "
                    "micro-batches; use --strategy ddp or zero1 with --pp, which average once after the "
                    "schedule")  # fmt: skip
_OWN_EXPERTS = ("would average (or shard) each rank's own experts with the other replicas' different ones; use "
                "--strategy ddp with --ep")  # fmt: skip
UNSUPPORTED = {
    ("torch-ddp", "pp"): "PyTorch's DDP averages during the backward pass that runs outside no_sync(), which the "
    "1F1B schedule does not single out; use --strategy ddp, which averages after the schedule",
    ("fsdp", "pp"): "FSDP2 " + _PER_MICRO_BATCH,
    ("zero2", "pp"): "ZeRO-2 " + _PER_MICRO_BATCH,
    ("zero3", "pp"): "ZeRO-3 " + _PER_MICRO_BATCH,
    ("fsdp", "tp"): "FSDP2 composes with DTensor tensor parallelism on a 2-D mesh, and the book's tensor "
    "parallelism is plain tensors; use --strategy ddp or zero1 with --tp",
    ("zero2", "tp"): "gathering the full model would need ZeRO's gather and then the tensor-parallel one, which "
    "is not composed here; use --strategy ddp or zero1 with --tp",
    ("zero3", "tp"): "gathering the full model would need ZeRO's gather and then the tensor-parallel one, which "
    "is not composed here; use --strategy ddp or zero1 with --tp",
    **{(wrapper, "ep"): _OWN_EXPERTS for wrapper in ("torch-ddp", "fsdp", "zero1", "zero2", "zero3")},
    ("tp", "ep"): "tensor parallelism splits the dense MLP, and a mixture-of-experts layer has experts instead; "
    "use --tp 1 with --ep",
    ("cp", "pp"): "the pipeline runtime passes token ids, not their positions, to the first stage, which a "
    "context-parallel rank needs; use --pp 1 with --cp",
    ("sequence_parallel", "pp"): "the pipeline runtime sizes the activations it receives as (B, T, d), and "
    "sequence-parallel stages exchange (B, T / tp, d); drop --sequence-parallel with --pp",
    ("sequence_parallel", "cp"): "both split the sequence, and sequence parallelism's position embedding does not "
    "know the zig-zag positions of a context-parallel rank; drop --sequence-parallel with --cp",
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism for ``world_size`` ranks, the data-parallel wrapper (one of ``DATA_PARALLEL``,
    or None for one replica), the micro-batches each replica runs per optimizer step, and whether tensor
    parallelism splits the sequence too; checked when built."""

    world_size: int
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    data_parallel: str | None = None
    micro_batches: int = 1
    sequence_parallel: bool = False  # tensor parallelism's LayerNorms and residuals on T / tp tokens (Ch. 12)

    def __post_init__(self):
        problems = _degree_problems(self)
        if problems:
            raise ValueError("invalid parallel layout: " + "; ".join(problems))

    @classmethod
    def build(cls, world_size: int, config, *, seq_len: int, global_batch: int, micro_batch: int,
              dp: int | None = None, **degrees) -> ParallelDims:  # fmt: skip
        """The layout of ``world_size`` ranks for a model of ``config`` (a GPTConfig) trained on ``global_batch``
        sequences of ``seq_len`` tokens per step in micro-batches of ``micro_batch``, or one ValueError listing
        every problem, each naming the flag to change. ``dp`` defaults to the ranks that tp x pp x cp leave;
        ``degrees``: tp, pp, cp, ep, data_parallel, sequence_parallel."""
        split = degrees.get("tp", 1) * degrees.get("pp", 1) * degrees.get("cp", 1)
        if dp is None:
            dp = max(1, world_size // split) if isinstance(split, int) and split >= 1 else 1
        per_step = micro_batch * dp
        micro_batches = global_batch // per_step if per_step >= 1 and global_batch % per_step == 0 else 1
        # Not a ParallelDims yet, whose constructor would stop at the first problem: every check runs first.
        dims = SimpleNamespace(**{**dict(tp=1, pp=1, cp=1, ep=1, data_parallel=None, sequence_parallel=False),
                                  **degrees},
                               world_size=world_size, dp=dp, micro_batches=micro_batches)  # fmt: skip
        problems = _degree_problems(dims)
        if all(isinstance(getattr(dims, d), int) and getattr(dims, d) >= 1 for d in ("tp", "pp", "cp", "ep")):
            problems += _model_problems(dims, config, seq_len)
        if dims.data_parallel is None and dp * dims.cp > 1:
            problems.append(f"dp x cp = {dp} x {dims.cp} replicas need a data-parallel wrapper to average their "
                            f"gradients: choose --strategy from {', '.join(DATA_PARALLEL)}, or lower --dp or "
                            "--cp")  # fmt: skip
        if per_step >= 1 and global_batch % per_step:
            problems.append(
                f"--global-batch ({global_batch}) must be a multiple of --micro-batch x dp = {micro_batch} x {dp} = "
                f"{per_step}; e.g. --global-batch {max(per_step, global_batch // per_step * per_step)}"
            )
        elif dims.pp > 1 and not problems and micro_batches < dims.pp:
            problems.append(
                f"--pp {dims.pp}: the 1F1B schedule needs at least as many micro-batches per step as stages, got "
                f"--global-batch / (--micro-batch x dp) = {global_batch} / ({micro_batch} x {dp}) = {micro_batches};"
                f" raise --global-batch to {dims.pp * per_step} or lower --micro-batch"
            )
        if problems:
            raise ValueError("invalid parallel layout:\n  " + "\n  ".join(problems))
        return cls(
            world_size,
            dp,
            dims.tp,
            dims.pp,
            dims.cp,
            dims.ep,
            dims.data_parallel,
            micro_batches,
            dims.sequence_parallel,
        )

    @property
    def replicas(self) -> int:
        """The ranks that hold the same parameters and average their gradients: dp x cp."""
        return self.dp * self.cp

    def coordinates(self, rank: int) -> dict[str, int]:
        """Rank -> its index along every dimension (tp innermost), plus its ``ep`` index within dp."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an integer in [0, {self.world_size}), got {rank!r}")
        coords, rest = {}, rank
        for name in reversed(DIMS):
            coords[name] = rest % getattr(self, name)
            rest //= getattr(self, name)
        coords = {name: coords[name] for name in DIMS}
        coords["ep"] = coords["dp"] % self.ep
        return coords

    def rank_of(self, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """Coordinates -> rank (the inverse of :meth:`coordinates`)."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def group_ranks(self, dim: str) -> list[list[int]]:
        """Every group of ``dim`` (one of ``GROUPS``), as lists of ranks."""
        if dim not in GROUPS:
            raise ValueError(f"dim must be one of {GROUPS}, got {dim!r}")
        along = {"ep": ("dp",), "edp": ("dp", "cp"), "dp_cp": ("dp", "cp")}.get(dim, (dim,))
        others = [name for name in DIMS if name not in along]
        groups = []
        for fixed in product(*(range(getattr(self, name)) for name in others)):
            where = dict(zip(others, fixed, strict=True))
            members = [self.rank_of(**where, **dict(zip(along, i, strict=True)))
                       for i in product(*(range(getattr(self, name)) for name in along))]  # fmt: skip
            if dim == "ep":  # consecutive blocks of ep data-parallel ranks
                groups += [members[i : i + self.ep] for i in range(0, len(members), self.ep)]
            elif dim == "edp":  # the data-parallel ranks with the same ep index, every cp rank of each
                groups += [[r for r in members if self.coordinates(r)["ep"] == e] for e in range(self.ep)]
            else:
                groups.append(members)
        return groups


def _degree_problems(dims: ParallelDims | SimpleNamespace) -> list[str]:
    """What is wrong with the degrees and the wrapper alone (no model needed)."""
    problems = []
    for name in ("world_size", "dp", "tp", "pp", "cp", "ep", "micro_batches"):
        value = getattr(dims, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            flag = {"world_size": "the number of ranks", "micro_batches": "micro_batches"}.get(name, f"--{name}")
            problems.append(f"{flag} must be an integer >= 1, got {value!r}")
    if problems:
        return problems
    split = dims.pp * dims.cp * dims.tp
    used = dims.dp * split
    if used != dims.world_size:
        fix = (f"e.g. --dp {dims.world_size // split}" if dims.world_size % split == 0
               else f"--tp x --pp x --cp = {split} does not divide it: change --tp, --pp or --cp")  # fmt: skip
        problems.append(f"dp x tp x pp x cp = {dims.dp} x {dims.tp} x {dims.pp} x {dims.cp} = {used} must equal the "
                        f"{dims.world_size} ranks started; {fix}, or start {used} ranks")  # fmt: skip
    if dims.dp % dims.ep:
        problems.append(f"--ep {dims.ep} must divide the data-parallel degree dp = {dims.dp}: the experts are "
                        f"sharded over data-parallel ranks; choose --ep from {_divisors(dims.dp)}")  # fmt: skip
    if dims.data_parallel is not None and dims.data_parallel not in DATA_PARALLEL:
        problems.append(f"data_parallel must be one of {DATA_PARALLEL} or None, got {dims.data_parallel!r}")
    flags = {dims.data_parallel: f"--strategy {dims.data_parallel}"}
    flags |= {dim: f"--{dim} {getattr(dims, dim)}" for dim in DIMS if getattr(dims, dim) > 1}
    if dims.sequence_parallel:
        flags["sequence_parallel"] = "--sequence-parallel"
        if dims.tp == 1:
            problems.append("--sequence-parallel splits the sequence over the tensor-parallel ranks: add --tp")
    for (first, dim), why in UNSUPPORTED.items():
        if getattr(dims, dim) > 1 and first in flags:
            problems.append(f"{flags[first]} with --{dim} {getattr(dims, dim)}: {why}")
    return problems


def _model_problems(dims: SimpleNamespace, config, seq_len: int) -> list[str]:
    """What is wrong with the layout for this model and sequence length (each owner's own validator)."""
    from scalebook.parallel.context import validate_context_parallel
    from scalebook.parallel.tensor import validate_tensor_parallel

    problems = []
    if seq_len > config.block_size:
        problems.append(f"--seq-len {seq_len} exceeds the model's context of {config.block_size} tokens")
    sp = {"sequence_parallel": True, "seq_len": seq_len} if dims.sequence_parallel else {}
    checks = [("tp", lambda: validate_tensor_parallel(config, dims.tp, **sp)),
              ("cp", lambda: validate_context_parallel(seq_len, dims.cp))]  # fmt: skip
    for flag, check in checks:
        if getattr(dims, flag) > 1:
            try:
                check()
            except ValueError as error:
                problems.append(f"--{flag} {getattr(dims, flag)}: {error}")
    if config.n_layer % dims.pp:
        problems.append(f"--pp {dims.pp}: the {config.n_layer} layers must split evenly over the stages; choose "
                        f"--pp from {_divisors(config.n_layer)}")  # fmt: skip
    experts = getattr(config, "n_experts", 0)
    if dims.ep > 1 and not experts:
        problems.append(f"--ep {dims.ep} shards the experts of a mixture-of-experts model: add --moe-experts")
    elif experts % dims.ep:
        problems.append(f"--ep {dims.ep}: the {experts} experts must split evenly over the expert-parallel "
                        f"ranks; choose --ep from {_divisors(experts)} (dividing dp)")  # fmt: skip
    return problems


class DeviceMesh:
    """This rank's process group along every dimension, built by :meth:`build` on all ranks at once."""

    def __init__(self, dims: ParallelDims, groups: dict[str, object], rank: int):
        self.dims, self.rank = dims, rank
        self.coords = dims.coordinates(rank)
        self._groups = groups

    @classmethod
    def build(cls, dims: ParallelDims) -> DeviceMesh:
        """Create every group of every dimension (collective: every rank calls it) and keep this rank's."""
        if dist.get_world_size() != dims.world_size:
            raise ValueError(f"the layout is for {dims.world_size} ranks but the job has {dist.get_world_size()}")
        rank, mine = dist.get_rank(), {}
        for dim in GROUPS:
            for ranks in dims.group_ranks(dim):
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine[dim] = group
        mesh = cls(dims, mine, rank)
        mine["tied"] = tied_embedding_group(mesh)
        return mesh

    def group(self, dim: str):
        """This rank's process group along ``dim`` (one of ``GROUPS``, or ``"tied"``, see
        :func:`tied_embedding_group`)."""
        return self._groups[dim]


def tied_embedding_group(mesh: DeviceMesh):
    """This rank's group of the first and the last pipeline stage at its (dp, cp, tp) coordinates, which hold
    the tied embedding's two copies (None on the other stages). Collective: every rank calls it."""
    dims, mine = mesh.dims, None
    for d, c, t in product(range(dims.dp), range(dims.cp), range(dims.tp)):
        ranks = sorted({dims.rank_of(pp=0, dp=d, cp=c, tp=t), dims.rank_of(pp=dims.pp - 1, dp=d, cp=c, tp=t)})
        group = dist.new_group(ranks)
        if mesh.rank in ranks:
            mine = group
    return mine
