"""The 3-D run: coordinates with TP innermost, refused layouts, and DP x TP x PP training equal to one plain
PyTorch process, both as Chapter 14 writes the composition out (``experiments.mesh.train_3d``) and as
``python -m scalebook.train --strategy 3d`` builds it (``parallel.parallelize`` and its ``ParallelModel``)."""

import pytest
import torch

from scalebook import data
from scalebook.comm import launch
from scalebook.experiments import mesh
from scalebook.model import GPT, GPTConfig
from scalebook.parallel import tensor
from scalebook.parallel.dims import ParallelDims
from scalebook.parallel.parallelize import parallelize
from scalebook.parity import max_relative_difference

# Losses relative to the reference's, gradients per tensor relative to the tensor's largest reference entry
# (parity.max_relative_difference). Float32 sums in another order (all-reduces, sharded matmuls, micro-batches):
# measured at most 1.8e-7 on the losses, 7.7e-7 on the first step's gradients and 1.1e-6 on the gradient norms.
# 1e-5 leaves headroom over that; a missing 1/dp or 1/micro-batches, or a tied embedding's gradient not summed,
# moves the tensor it touches (and the norm) by 50% or more.
TOLERANCE = 1e-5
STEPS, BATCH, SEQ_LEN, MICRO_BATCHES, LR, MAX_NORM = 3, 8, 32, 2, 1e-3, 1.0


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


def batches():
    """The global batches of every step, the same on every rank and in the reference."""
    gen, tokens = torch.Generator().manual_seed(0), data.corpus_tokens()
    return [data.get_batch(tokens, BATCH, SEQ_LEN, gen) for _ in range(STEPS)]


def parallelize_3d(dp: int, tp: int, pp: int) -> dict:
    """On every rank: the tiny GPT made DP x TP x PP by ``parallelize`` (the book's DDP over the replicas, 1F1B
    over ``MICRO_BATCHES`` micro-batches), driven as the CLI's loop drives it: ``forward_backward`` on this
    replica's rows, ``clip_grad_norm_``, ``step``. Returns the loss and the gradient norm before clipping of every
    step, and the first step's gradients of this rank's stage, unsharded, before clipping."""
    dims = ParallelDims(dp * tp * pp, dp=dp, tp=tp, pp=pp, data_parallel="ddp", micro_batches=MICRO_BATCHES)
    torch.manual_seed(0)
    model = parallelize(GPT(GPTConfig.named("tiny")), dims, lr=LR)
    rows = slice(model.coords["dp"] * BATCH // dp, (model.coords["dp"] + 1) * BATCH // dp)
    losses, norms, first_grads = [], [], None
    for idx, targets in batches():
        model.zero_grad()
        losses.append(model.forward_backward(idx[rows], targets[rows]).item())
        if first_grads is None:
            first_grads = tensor.full_gradients(model.model, model.group("tp"))
        norms.append(model.clip_grad_norm_(MAX_NORM).item())
        model.step()
    return {"coords": model.coords, "losses": losses, "norms": norms, "first_grads": first_grads}


def three_d_on_8_ranks() -> dict:
    """One 8-rank launch, both compositions of dp2 x tp2 x pp2."""
    return {
        "train_3d": mesh.train_3d(
            dp=2, tp=2, pp=2, steps=STEPS, batch_size=BATCH, seq_len=SEQ_LEN, microbatches=MICRO_BATCHES, lr=LR
        ),
        "parallelize": parallelize_3d(2, 2, 2),
    }


def plain_pytorch(clip: bool) -> dict:
    """The reference: the tiny GPT, the whole global batch of each step and AdamW in one process, with
    ``torch.nn.utils.clip_grad_norm_`` if ``clip``; the losses, the norms and the first step's gradients."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig.named("tiny"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        losses, norms, first_grads = [], [], None
        for idx, targets in batches():
            optimizer.zero_grad()
            _, loss = model(idx, targets)
            loss.backward()
            if first_grads is None:
                first_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
            if clip:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
            optimizer.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    return {"losses": losses, "norms": norms, "first_grads": first_grads}


@pytest.fixture(scope="module")
def launched() -> list[dict]:
    return launch(three_d_on_8_ranks, 8, timeout=300)


def relative(values: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(values, reference, strict=True))


def stage_errors(per_rank: list[dict], reference: dict[str, torch.Tensor]) -> float:
    """Every rank's first-step gradients against the reference's, per tensor; together the stages must cover
    every parameter. The last stage's copy of the tied matrix holds, once summed with the first stage's, the
    tied gradient."""
    stages = [{"wte.weight" if name == "lm_head.weight" else name: g for name, g in r.items()} for r in per_rank]
    assert set().union(*stages) == set(reference)
    return max(max_relative_difference(stage, {name: reference[name] for name in stage}) for stage in stages)


@pytest.mark.parametrize("composition", ["train_3d", "parallelize"])
def test_dp2_tp2_pp2_on_8_ranks_trains_like_one_process(composition, launched):
    """Losses of 3 steps, and the first step's gradient of every tensor before AdamW (losses after AdamW hide a
    gradient off by a constant factor: Adam divides it out). Through ``parallelize``, also every step's gradient
    norm before clipping, the ParallelModel's ``clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_``:
    the CLI clips at 1.0, so the norm is the value that shows a wrong scale."""
    runs = [r[composition] for r in launched]
    reference = plain_pytorch(clip=composition == "parallelize")
    assert reference["losses"][-1] < reference["losses"][0] - 0.05  # it learns: the updates matter
    assert all(relative(r["losses"], reference["losses"]) < TOLERANCE for r in runs), [r["losses"] for r in runs]
    grad_error = stage_errors([r["first_grads"] for r in runs], reference["first_grads"])
    assert grad_error < TOLERANCE, ("first step's gradients", grad_error)
    if composition == "parallelize":
        assert min(reference["norms"]) > MAX_NORM  # the clipping acts on every step
        assert all(relative(r["norms"], reference["norms"]) < TOLERANCE for r in runs), [r["norms"] for r in runs]
    assert sorted(tuple(r["coords"].values()) for r in runs) == sorted(
        (p, d, 0, t, 0) for p in range(2) for d in range(2) for t in range(2)
    )
