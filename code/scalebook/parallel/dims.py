"""The layout of a parallel run: degrees of DP x TP x PP x CP (x EP), rank coordinates and process groups.

A layout is a factorization of the world into degrees, ``world = pp * dp * cp * tp``. Ranks are laid
out as in Megatron-LM with tensor parallelism innermost, so that the tp ranks of one group are
consecutive (on one node, where the fast links are), then context, then data, and pipeline outermost:

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

Expert parallelism does not multiply the world: as in torchtitan and Megatron-LM, the experts are
sharded over ``ep`` of the data-parallel ranks (``ep`` must divide ``dp``), which hold different tokens
anyway. For every dimension, the ranks whose other coordinates agree form one process group; every rank
must create every group, in the same order (``torch.distributed.new_group`` is collective).

Source: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Sec. 3 (PTD-P); Megatron-LM ``megatron/core/parallel_state.py`` (rank order
tp-cp-ep-dp-pp); torchtitan ``torchtitan/distributed/parallel_dims.py`` (``ParallelDims`` validation).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import torch.distributed as dist

DIMS = ("pp", "dp", "cp", "tp")  # outermost to innermost


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism for ``world_size`` ranks; checked when built."""

    world_size: int
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self):
        problems = []
        for name in ("world_size", "dp", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be an integer >= 1, got {value!r}")
        if not problems:
            used = self.pp * self.dp * self.cp * self.tp
            if used != self.world_size:
                problems.append(
                    f"pp * dp * cp * tp = {self.pp} * {self.dp} * {self.cp} * {self.tp} = {used} must equal the "
                    f"world size {self.world_size}; change a degree "
                    f"(for example dp={self.world_size // (used // self.dp)}) or the number of ranks"
                    if self.world_size % (used // self.dp) == 0
                    else f"pp * dp * cp * tp = {used} must equal the world size {self.world_size}, and "
                    f"pp * cp * tp = {used // self.dp} does not divide it; change pp, cp or tp"
                )
            if self.dp % self.ep:
                problems.append(
                    f"ep ({self.ep}) must divide dp ({self.dp}): experts are sharded over data-parallel ranks"
                )
        if problems:
            raise ValueError("invalid parallel layout: " + "; ".join(problems))

    def degrees(self) -> dict[str, int]:
        """``{"pp": .., "dp": .., "cp": .., "tp": ..}``, outermost first."""
        return {name: getattr(self, name) for name in DIMS}

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
        """Every group of dimension ``dim`` (``pp``, ``dp``, ``cp``, ``tp`` or ``ep``), as lists of ranks."""
        if dim not in DIMS + ("ep",):
            raise ValueError(f"dim must be one of {DIMS + ('ep',)}, got {dim!r}")
        along = "dp" if dim == "ep" else dim
        others = [name for name in DIMS if name != along]
        groups = []
        for fixed in product(*(range(getattr(self, name)) for name in others)):
            where = dict(zip(others, fixed, strict=True))
            members = [self.rank_of(**where, **{along: i}) for i in range(getattr(self, along))]
            if dim == "ep":  # consecutive blocks of ep data-parallel ranks
                groups += [members[i : i + self.ep] for i in range(0, len(members), self.ep)]
            else:
                groups.append(members)
        return groups


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
        for dim in DIMS + ("ep",):
            for ranks in dims.group_ranks(dim):
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine[dim] = group
        return cls(dims, mine, rank)

    def group(self, dim: str):
        """This rank's process group along ``dim``."""
        return self._groups[dim]

    def neighbour(self, dim: str, step: int) -> int:
        """Global rank of the rank ``step`` positions away along ``dim`` (other coordinates equal)."""
        coords = {name: self.coords[name] for name in DIMS}
        coords[dim] += step
        return self.dims.rank_of(**coords)


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
