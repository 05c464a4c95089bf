"""The 3-D run: coordinates with TP innermost, refused layouts, and DP x TP x PP training equal to one process."""

import pytest

from scalebook.experiments import mesh
from scalebook.parallel.dims import ParallelDims

# Float32 sums in another order (all-reduces, sharded matmuls): ~5e-7 here on losses of ~5 and ~1e-7 on
# gradients of up to ~0.6, so 1e-5 is a safe bound for both.
TOLERANCE = 1e-5


def test_tp_is_innermost_and_pp_outermost_like_megatron():
    dims = ParallelDims(16, dp=2, tp=2, pp=4)
    # Rank 6 = 0b0110: tp 0, dp 1, pp 1.
    assert dims.coordinates(6) == {"pp": 1, "dp": 1, "cp": 0, "tp": 0, "ep": 0}
    assert all(dims.rank_of(**{k: v for k, v in dims.coordinates(r).items() if k != "ep"}) == r for r in range(16))
    assert dims.group_ranks("tp")[:2] == [[0, 1], [2, 3]]
    # A pipeline's stages are ranks 4 apart: the runtime addresses them by their rank in the pp group.
    assert dims.group_ranks("pp")[0] == [0, 4, 8, 12]
    assert sorted(r for g in dims.group_ranks("dp") for r in g) == list(range(16))


def test_3d_layouts_that_cannot_run_raise_one_error_before_any_process(monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a process was started for an invalid layout")

    monkeypatch.setattr(mesh, "launch", no_launch)
    with pytest.raises(ValueError, match=r"n_layer \(4\) must be divisible by pp \(3\)"):
        mesh.compare_3d_with_single_process(1, 1, 3)
    with pytest.raises(ValueError, match=r"batch_size \(8\) must be divisible by dp \* microbatches \(16\)"):
        mesh.compare_3d_with_single_process(2, 1, 2, microbatches=8)
    with pytest.raises(ValueError, match="n_head"):  # tiny has 4 heads: tp=3 cannot split them
        mesh.compare_3d_with_single_process(1, 3, 1)


def test_dp2_tp2_pp2_on_8_ranks_trains_like_one_process():
    result = mesh.compare_3d_with_single_process(2, 2, 2, steps=3)
    assert result["max_error"] < TOLERANCE, result
    # Losses after AdamW hide a gradient off by a constant factor (Adam divides it out): compare the first
    # step's full gradient, gathered from the TP shards and the stages of every rank, before AdamW.
    assert result["max_grad_error"] < TOLERANCE, result
    assert result["grad_scale"] > 1000 * TOLERANCE  # large enough for a missing 1/dp to show
    assert sorted(tuple(c.values()) for c in result["coords"]) == sorted(
        (p, d, 0, t, 0) for p in range(2) for d in range(2) for t in range(2)
    )
