"""The N-D mesh: coordinates with TP innermost, validated layouts, and DP x TP x PP training equal to one process."""

import pytest

from scalebook.parallel import mesh

# Float32 sums in another order (all-reduces, sharded matmuls): ~5e-7 here on losses of ~5 and ~1e-7 on
# gradients of up to ~0.6, so 1e-5 is a safe bound for both.
TOLERANCE = 1e-5


def test_tp_is_innermost_and_pp_outermost_like_megatron():
    dims = mesh.ParallelDims(16, dp=2, tp=2, pp=2, cp=2)
    # Rank 5 = 0b0101: tp 1, cp 0, dp 1, pp 0.
    assert dims.coordinates(5) == {"pp": 0, "dp": 1, "cp": 0, "tp": 1, "ep": 0}
    assert all(dims.rank_of(**{k: v for k, v in dims.coordinates(r).items() if k != "ep"}) == r for r in range(16))
    assert dims.group_ranks("tp")[:2] == [[0, 1], [2, 3]]
    assert dims.group_ranks("pp")[0] == [0, 8]
    assert sorted(r for g in dims.group_ranks("dp") for r in g) == list(range(16))


def test_expert_groups_are_blocks_of_data_parallel_ranks():
    dims = mesh.ParallelDims(8, dp=4, tp=2, ep=2)
    assert dims.group_ranks("dp")[0] == [0, 2, 4, 6]
    assert dims.group_ranks("ep")[:2] == [[0, 2], [4, 6]]


def test_bad_layouts_raise_one_error_naming_the_fix():
    with pytest.raises(ValueError, match="must equal the world size 8"):
        mesh.ParallelDims(8, dp=2, tp=2, pp=1)
    with pytest.raises(ValueError, match="dp=2"):
        mesh.ParallelDims(8, dp=1, tp=2, pp=2)
    with pytest.raises(ValueError, match="ep \\(3\\) must divide dp"):
        mesh.ParallelDims(4, dp=4, ep=3)
    with pytest.raises(ValueError, match="integer >= 1"):
        mesh.ParallelDims(4, dp=0, tp=4)
    with pytest.raises(ValueError, match="n_layer"):
        mesh.check_3d(1, 1, 3, batch_size=8, microbatches=2, size="tiny", seq_len=32)


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
