"""A checkpoint written in one layout resumes in another (issue 21): saved under ZeRO-3 on 4 ranks at step 3,
resumed under the book's DDP, ZeRO-1, tensor and pipeline parallelism on 2 ranks and on one process, each
continued run gives the losses and the gradient norms (before clipping) of the run that never stopped. The check
can fail: a load that drops the optimizer's moments, or that does not restore the data generator, is caught.

One 4-rank launch trains ZeRO-3 for 6 steps, saving at steps 3 and 6 (its steps 4-6 are the reference); one
2-rank launch resumes the step-3 checkpoint in four layouts, one after the other; one process resumes it here,
with ``torch.nn.utils.get_total_norm`` computed beside the layout's own norm, and twice more with a bad load.
"""

import argparse
import shutil

import pytest
import torch
import torch.distributed as dist

from scalebook.comm import launch
from scalebook.parallel.parallelize import ParallelModel
from scalebook.train import checkpoint, cli

# The tiny GPT, 8 sequences of 32 tokens a step: ZeRO-3 x 4 gives each rank 2 (one micro-batch of 2), the
# 2-rank layouts 4 or 8 per replica (2 or 4 micro-batches), so every layout cuts the batch differently.
RUN = ["--steps", "6", "--micro-batch", "2", "--global-batch", "8", "--seq-len", "32", "--no-progress",
       "--log-every", "100", "--checkpoint-every", "3"]  # fmt: skip
TWO_RANKS = {
    "ddp x 2": ["--strategy", "ddp"],
    "zero1 x 2": ["--strategy", "zero1", "--async-save"],  # the flat optimizer shards; saves in the background
    "tp 2": ["--strategy", "tp", "--tp", "2"],  # column/row shards, and the fused QKV's three row ranges
    "pp 2": ["--strategy", "pp", "--pp", "2"],  # each stage reads its own blocks, the last the tied embedding
}


def args_of(argv: list[str], **changes) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(cli.build_parser().parse_args(argv)), **changes})


def steps(records) -> list[tuple[float, float]]:
    """(loss, gradient norm before clipping) of each step."""
    return [(r.loss, r.grad_norm) for r in records]


def train_zero3(root: str) -> list[tuple[float, float]] | None:
    """Worker: ZeRO-3 for 6 steps with checkpoints at 3 and 6; rank 0 returns every step's loss and norm."""
    records = cli.run(args_of([*RUN, "--strategy", "zero3"], checkpoint_dir=root))
    return steps(records) if dist.get_rank() == 0 else None


def resume_in(layouts: dict[str, list[str]], checkpoints: dict[str, str]) -> dict[str, list[tuple[float, float]]]:
    """Worker: each layout resumed from its copy of the step-3 checkpoint; rank 0 returns its losses and norms."""
    results = {}
    for name, argv in layouts.items():
        records = cli.run(args_of([*RUN, *argv], checkpoint_dir=checkpoints[name], resume=True))
        results[name] = steps(records)
        dist.barrier()  # rank 0 published the last save before returning; every rank looks after that
        assert checkpoint.newest_intact(checkpoints[name]) == (6, []), name  # asynchronous saves too
    return results if dist.get_rank() == 0 else {}


def step_3_copy(saved: str, to: str) -> str:
    """A copy of the ZeRO-3 checkpoint as if the run had died after saving step 3."""
    shutil.copytree(saved, to)
    shutil.rmtree(checkpoint.step_dir(to, 6))
    checkpoint.mark_complete(to, 3)
    return to


def one_process(checkpoint_dir: str) -> list:
    """Resume ``checkpoint_dir`` on this one process, with one thread as the ranks have."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return cli.run(args_of(RUN, checkpoint_dir=checkpoint_dir, resume=True))
    finally:
        torch.set_num_threads(threads)


def drop_optimizer_moments(monkeypatch) -> None:
    """A bad load: the model's weights are read, the optimizer's state (AdamW's moments and step) is not."""
    load = ParallelModel.load_state_dict

    def without_moments(self, state):
        load(self, state)
        self.optimizer.state.clear()

    monkeypatch.setattr(ParallelModel, "load_state_dict", without_moments)


def keep_fresh_generator(monkeypatch) -> None:
    """A bad load: the data generator keeps its fresh seed's state instead of the checkpoint's."""
    resume = checkpoint.RunCheckpoints.resume

    def without_generator(self, start):
        fresh = self.generator.get_state()
        losses = resume(self, start)
        self.generator.set_state(fresh)
        return losses

    monkeypatch.setattr(checkpoint.RunCheckpoints, "resume", without_generator)


BAD_LOADS = {"optimizer moments dropped": drop_optimizer_moments, "generator not restored": keep_fresh_generator}


def mismatches(run: list[tuple[float, float]], reference: list[tuple[float, float]]) -> list[tuple]:
    """The (step, quantity, value, reference) of every loss or gradient norm of steps 4 to 6 that is off by more
    than 1e-5 relative; the check of a resumed run is that there are none."""
    assert len(run) == len(reference) == 3
    found = []
    for step, (got, expected) in enumerate(zip(run, reference, strict=True), start=4):
        for quantity, value, ref in zip(("loss", "grad norm"), got, expected, strict=True):
            if abs(value - ref) > 1e-5 * abs(ref):
                found.append((step, quantity, value, ref))
    return found


@pytest.fixture(scope="module")
def zero3(tmp_path_factory) -> tuple[str, list[tuple[float, float]]]:
    root = str(tmp_path_factory.mktemp("zero3") / "ckpt")
    return root, launch(train_zero3, 4, root, timeout=240)[0]


@pytest.fixture(scope="module")
def resumed(zero3, tmp_path_factory) -> dict[str, list[tuple[float, float]]]:
    """Every layout's steps 4 to 6; on one process, also PyTorch's norm of the same gradients (``"torch norm"``)."""
    saved, _ = zero3
    work = tmp_path_factory.mktemp("resumed")
    copies = {name: step_3_copy(saved, str(work / name.replace(" ", "_"))) for name in TWO_RANKS}
    results = launch(resume_in, 2, TWO_RANKS, copies, timeout=240)[0]
    torch_norms = []
    clip = ParallelModel.clip_grad_norm_

    def clip_beside_torch(self, max_norm):  # the layout's own clipping, PyTorch's norm computed before it
        torch_norms.append(torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters()]).item())
        return clip(self, max_norm)

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(ParallelModel, "clip_grad_norm_", clip_beside_torch)
        single = steps(one_process(step_3_copy(saved, str(work / "single"))))
    return {**results, "single": single, "torch norm": torch_norms}


@pytest.fixture(scope="module")
def bad_loads(zero3, tmp_path_factory) -> dict[str, list[tuple[float, float]]]:
    """Steps 4 to 6 on one process after each bad load of the step-3 checkpoint."""
    saved, _ = zero3
    work = tmp_path_factory.mktemp("bad")
    results = {}
    for name, spoil in BAD_LOADS.items():
        with pytest.MonkeyPatch.context() as monkeypatch:
            spoil(monkeypatch)
            results[name] = steps(one_process(step_3_copy(saved, str(work / name.replace(" ", "_")))))
    return results


def test_the_zero3_checkpoint_is_one_file_per_rank_and_an_index(zero3):
    saved, _ = zero3
    files = sorted(p.name for p in checkpoint.step_dir(saved, 3).iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "manifest.json"]
    assert checkpoint.verify(saved, 3)["world_size"] == 4


@pytest.mark.parametrize("layout", [*TWO_RANKS, "single"])
def test_a_zero3_x4_checkpoint_resumes_in_another_layout_as_the_run_that_never_stopped(layout, zero3, resumed):
    """Steps 4 to 6 after loading the step-3 state equal ZeRO-3 x 4's own steps 4 to 6, in the loss and in the
    gradient norm before clipping (AdamW divides a constant factor on the gradients out of its update, so a
    wrong scale hides in the losses but not in the norm). The loaded state is the saved one bit for bit (every
    element is read back into its new place), but each layout then sums the same gradients in a different order
    (4 replicas of 2 sequences, 2 of 4, one of 8; tensor-parallel partial sums), as the strategy tests measure:
    ~1e-7 relative per step, checked at 1e-5 relative."""
    _, reference = zero3
    assert len(reference) == 6 and reference[-1][0] < reference[0][0] - 0.3  # it learns: the state matters
    assert min(norm for _, norm in reference) > 1.0  # so the clipping at 1.0 acts on every step
    found = mismatches(resumed[layout], reference[3:])
    assert not found, (layout, found)


def test_the_layouts_norm_is_pytorchs_on_one_process(resumed):
    """On one process, the norm the loop logs and clips by is ``torch.nn.utils.get_total_norm`` of the gradients."""
    assert resumed["torch norm"] == pytest.approx([norm for _, norm in resumed["single"]], rel=1e-6)


@pytest.mark.parametrize("bad_load", BAD_LOADS)
def test_a_bad_load_is_caught(bad_load, zero3, bad_loads):
    """The check above fails on a resume that loses part of the state. Without AdamW's moments, step 4 (loss and
    norm computed before its update) still matches and the first update differs: step 5 is off. Without the
    data generator's state, step 4 trains on step 1's batch: off at once."""
    _, reference = zero3
    found = mismatches(bad_loads[bad_load], reference[3:])
    assert found, f"{bad_load}: the resumed run matched the reference, the check did not see the bad load"
    first_step = {"optimizer moments dropped": 5, "generator not restored": 4}[bad_load]
    assert found[0][0] == first_step, found
