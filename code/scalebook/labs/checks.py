"""The tools the labs share: one checksum per rank (labs 3 and 4), and the check of a lab's variants.

A checksum is a float64 position-weighted sum of a rank's tensors; gathering one number per rank shows at
once whether replicas agree (data-parallel parameters, tensor-parallel replicated weights) or whether
shards differ (each data-parallel rank's batch). Sending one number per rank costs nothing, so it can run
every N steps in production.

Source: PyTorch documentation, "torch.distributed" (``all_gather``); Chapter 16's labs 3 and 4.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from scalebook import compat as _compat  # noqa: F401  (all_gather_single on a PyTorch before 2.13)


def check_variants(variants, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """``variants`` as a tuple, or a ValueError naming the allowed ones if it is empty or has others."""
    variants = tuple(variants)
    unknown = [v for v in variants if v not in allowed]
    if not variants or unknown:
        raise ValueError(f"variants must be a non-empty selection of {allowed}, got {variants}")
    return variants


def checksum(tensors) -> float:
    """A float64 fingerprint of ``tensors``: a position-weighted sum, so permuted values change it too."""
    total = torch.zeros((), dtype=torch.float64)
    for t in tensors:
        flat = t.detach().reshape(-1).to(torch.float64)
        total += flat @ torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64)
    return total.item()


def rank_checksums(tensors, group=None) -> list[float]:
    """Every rank's :func:`checksum` of its ``tensors``, in rank order (a collective: all ranks call it).

    Replicas (data-parallel parameters, tensor-parallel replicated weights) must give identical
    checksums; data shards must give different ones. Sending one number per rank costs nothing, so it
    can run every N steps in production.
    """
    mine = torch.tensor([checksum(tensors)], dtype=torch.float64)
    out = torch.empty(dist.get_world_size(group), dtype=torch.float64)
    dist.all_gather_single(out, mine, group=group)
    return out.tolist()


def spread(checksums: list[float]) -> float:
    """Relative spread ``(max - min) / |mean|`` of per-rank checksums: 0 for identical replicas."""
    mean = sum(checksums) / len(checksums)
    return (max(checksums) - min(checksums)) / max(abs(mean), 1e-300)
