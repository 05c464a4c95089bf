"""The book's own strategies in `python -m scalebook.train`: Chapter 10's DDP, Chapter 11's ZeRO stages,
Chapter 12's tensor parallelism, Chapter 13's pipeline and Chapter 14's DP x TP x PP train to the
single-process losses and gradient norms (before clipping), resume bit-identically from their checkpoints,
consolidate into the single-process model, and bad layouts fail before any rank starts."""

import functools

import pytest
import torch

from scalebook import checkpoint
from scalebook.cli import LocalRun, build_parser, main, run_local, validate

# One micro-batch of one sequence: the single process accumulates 4 micro-batches per step, each of two
# ranks 2, so gradient accumulation (and no_sync, and ZeRO-2/3's sum of reduce-scattered shards) is used;
# the pipelines run 1F1B over the 4 micro-batches. The gradient norm is 2 to 9 in these steps (measured),
# so the clipping at 1.0 acts on every step.
SMALL = ["--steps", "6", "--micro-batch", "1", "--global-batch", "4", "--seq-len", "32", "--no-progress"]
LAYOUT = {
    "ddp": ["--bucket-cap-mb", "0.5"],  # 0.5 MiB: 7 buckets of the tiny GPT's 3 MiB
    "tp": ["--tp", "2"],
    "pp": ["--pp", "2"],  # 2 layers per stage
    # Each stage tensor-parallel: replicated parameters and the tied embedding's two copies (first and last
    # stage) must each count once in the gradient norm. Data parallelism on top: see test_3d_with_replicas...
    "3d": ["--dp", "1", "--tp", "2", "--pp", "2"],
}
NPROC = {"3d": 4}  # the others run on 2 ranks
STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "tp", "pp", "3d"]


def train(*args: str, nproc: int = 1, check: bool = True) -> LocalRun:
    result = run_local(list(args), nproc=nproc, timeout=120)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def strategy_args(strategy: str) -> list[str]:
    return [*SMALL, "--strategy", strategy, *LAYOUT.get(strategy, [])]


@functools.cache
def uninterrupted(strategy: str) -> LocalRun:
    """A 2-rank (3d: 4-rank) run of ``strategy`` from start to end (run once, shared by the tests)."""
    return train(*strategy_args(strategy), nproc=NPROC.get(strategy, 2))


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[LocalRun, dict[str, torch.Tensor]]:
    """The reference: one process, torch's AdamW, the whole global batch; its run and final weights."""
    ckpt = tmp_path_factory.mktemp("single")
    run = train(*SMALL, "--checkpoint-dir", str(ckpt))
    return run, checkpoint.consolidate(ckpt)[0]


def assert_matches_single(run: LocalRun, reference: LocalRun) -> None:
    """Every step's loss and gradient norm before clipping equal one process's, to float32 rounding.

    The same arithmetic in a different summation order (gradients summed over ranks, norms over shards,
    tensor-parallel partial sums): the losses agree to 1e-6 relative, not bit for bit; the gradient norms
    to ~1e-7 measured, checked at 1e-5. The norm is the stronger check: AdamW divides a constant factor
    on the gradients out of its update, so a missing 1/d (gradients summed over the d data-parallel ranks
    instead of averaged) hides in the losses, but it multiplies the norm by d from step 1 on. The
    ZeRO engines' Adam is torch's AdamW(foreach=False) formula for formula, so it adds no difference.
    """
    assert sorted(run.losses) == sorted(run.grad_norms) == sorted(reference.losses) == list(range(1, 7))
    for step, loss in reference.losses.items():
        assert run.grad_norms[step] == pytest.approx(reference.grad_norms[step], rel=1e-5), ("grad norm", step)
        assert run.losses[step] == pytest.approx(loss, rel=1e-6), ("loss", step)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_reaches_the_single_process_losses_and_gradient_norms(strategy, single):
    reference, _ = single
    assert_matches_single(uninterrupted(strategy), reference)
    losses = uninterrupted(strategy).losses
    assert losses[6] < losses[1] - 0.5  # it learns (and is not a constant that matches by chance)
    assert min(reference.grad_norms.values()) > 1.5  # so clipping at 1.0 acts on every step


def test_3d_with_replicas_reaches_the_single_process_losses_and_gradient_norms(single):
    # DP2 x PP2: each replica pipelines its half of the batch; gradients and losses average over replicas.
    reference, _ = single
    assert_matches_single(train(*SMALL, "--strategy", "3d", "--dp", "2", "--tp", "1", "--pp", "2", nproc=4),
                          reference)  # fmt: skip


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_resumes_bit_identically_and_consolidates(strategy, single, tmp_path):
    args, nproc = strategy_args(strategy), NPROC.get(strategy, 2)
    ckpt = tmp_path / "ckpt"
    crashed = train(*args, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--simulate-failure-at", "5",
                    nproc=nproc, check=False)  # fmt: skip
    assert crashed.returncode != 0 and "simulated failure before step 5" in crashed.stderr
    assert checkpoint.latest_step(ckpt) == 4
    resumed_run = train(*args, "--checkpoint-dir", str(ckpt), "--resume", nproc=nproc)
    resumed = resumed_run.losses
    assert sorted(resumed) == [5, 6]  # it continued from step 4
    # Bit-identical: the resumed steps are those of a run that never stopped, and the final checkpoint
    # carries the losses that the crashed run logged before it saved.
    full_run = uninterrupted(strategy)
    assert [resumed[5], resumed[6]] == [full_run.losses[5], full_run.losses[6]]
    assert [resumed_run.grad_norms[5], resumed_run.grad_norms[6]] == [full_run.grad_norms[5], full_run.grad_norms[6]]
    saved = checkpoint.load_shard(ckpt, 6, 0)["losses"].tolist()
    assert saved == [crashed.losses[s] for s in range(1, 5)] + [resumed[5], resumed[6]]
    # Rank 0's file holds the full model, loadable by GPT and equal to single-process training's weights
    # to float32 rounding after 6 Adam steps (the tolerance of test_cli's FSDP consolidation).
    from scalebook.model import GPT, GPTConfig

    state, meta = checkpoint.consolidate(ckpt)
    assert meta == {"model_size": "tiny", "step": 6, "world_size": nproc}
    GPT(GPTConfig.named("tiny")).load_state_dict(state)  # strict: every key, every shape
    _, reference = single
    for name, tensor in reference.items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-4, atol=1e-5)


def problems(*argv: str, world_size: int) -> str:
    with pytest.raises(ValueError) as error:
        validate(build_parser().parse_args(list(argv)), world_size)
    return str(error.value)


def test_bad_layouts_of_the_new_strategies_fail_with_one_message_before_any_work(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--strategy", "zero2", "--bucket-cap-mb", "4", "--tp", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--bucket-cap-mb sizes the gradient buckets of ddp and torch-ddp; drop it for --strategy zero2" in err
    assert "--strategy zero2 has no TP dimension; leave --tp at 1" in err
    message = problems("--strategy", "tp", "--tp", "2", world_size=4)
    assert "--strategy tp splits every layer over all ranks and has no data-parallel dimension: set --tp to " \
           "the 4 ranks started (got --tp 2, dp 2)" in message  # fmt: skip
    message = problems("--strategy", "tp", "--tp", "3", world_size=3)
    assert "--strategy tp --tp 3: invalid tensor-parallel layout: n_head (4) must be divisible by tp (3)" in message
    assert "dp x tp x pp x cp" not in message  # 3 ranks for --tp 3: the layout itself is consistent
    assert "--bucket-cap-mb must be > 0, got 0.0" in problems("--strategy", "ddp", "--bucket-cap-mb", "0", world_size=2)
    assert "--strategy ddp has no PP dimension; leave --pp at 1" in problems("--strategy", "ddp", "--pp", "2",
                                                                             world_size=2)  # fmt: skip


def test_bad_pipeline_layouts_fail_with_one_message_before_any_work(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--strategy", "3d", "--tp", "3", "--pp", "8", "--cp", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--strategy 3d has no CP dimension; leave --cp at 1" in err
    assert "--strategy 3d --tp 3: invalid tensor-parallel layout: n_head (4) must be divisible by tp (3)" in err
    assert "--strategy 3d --pp 8: the 4 layers of --model tiny must split evenly over the stages; choose --pp " \
           "from [1, 2, 4]" in err  # fmt: skip
    assert "dp x tp x pp x cp = 1 x 3 x 8 x 2 must equal the 1 ranks started" in err
    message = problems("--strategy", "pp", "--pp", "2", world_size=4)
    assert "--strategy pp runs one pipeline over all ranks and has no data-parallel dimension: set --pp to the 4 " \
           "ranks started (got --pp 2, dp 2), or add data parallelism with --strategy 3d --dp 2 --pp 2" \
           in message  # fmt: skip
    assert "micro-batches" not in message  # counted for a consistent layout only
    assert "--strategy pp needs --pp >= 2 stages" in problems("--strategy", "pp", world_size=2)
    assert "--strategy pp has no TP dimension; leave --tp at 1" in problems("--strategy", "pp", "--pp", "2", "--tp",
                                                                            "2", world_size=4)  # fmt: skip
    assert "choose --pp from [2, 4]" in problems("--strategy", "pp", "--pp", "3", "--global-batch", "12", world_size=3)
    message = problems("--strategy", "3d", "--dp", "2", "--pp", "2", "--global-batch", "8", world_size=4)
    assert message.count("\n") == 1 and "--strategy 3d --pp 2: the 1F1B schedule needs at least as many " \
        "micro-batches per step as stages, got --global-batch / (--micro-batch x dp) = 8 / (4 x 2) = 1; raise " \
        "--global-batch to 16 or lower --micro-batch" in message  # fmt: skip


def test_valid_layouts_of_the_new_strategies_pass():
    layout = validate(build_parser().parse_args(["--strategy", "tp", "--tp", "2", "--global-batch", "8"]), 2)
    assert (layout.dp, layout.grad_accum) == (1, 2)  # tp: both ranks share each micro-batch of 4
    layout = validate(build_parser().parse_args(["--strategy", "zero3", "--global-batch", "16"]), 2)
    assert (layout.dp, layout.grad_accum) == (2, 2)
    layout = validate(build_parser().parse_args(["--strategy", "pp", "--pp", "4", "--global-batch", "16"]), 4)
    assert (layout.dp, layout.grad_accum) == (1, 4)  # 4 micro-batches of 4 through 4 stages
    argv = ["--strategy", "3d", "--tp", "2", "--pp", "2", "--micro-batch", "1", "--global-batch", "4"]
    layout = validate(build_parser().parse_args(argv), 8)
    assert (layout.dp, layout.grad_accum) == (2, 2)  # dp = the ranks left; each replica pipelines 2 micro-batches
