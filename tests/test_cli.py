"""`python -m scalebook.train`: arguments checked up front, the same losses on 1 and 2 ranks, bit-identical
resume after a crash, and recovery by torchrun's restarts."""

import os
import subprocess
import sys

import pytest
import torch

from scalebook import checkpoint
from scalebook.cli import LocalRun, build_parser, main, run_local

PY = sys.executable
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
SMALL = ["--steps", "6", "--micro-batch", "2", "--global-batch", "4", "--seq-len", "32", "--no-progress"]


def train(*args: str, nproc: int = 1, check: bool = True, extra: tuple[str, ...] = ()) -> LocalRun:
    result = run_local(list(args), nproc=nproc, torchrun_args=extra, timeout=120)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_every_flag_is_documented():
    for action in build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"
    result = subprocess.run([PY, "-m", "scalebook.train", "--help"], capture_output=True, text=True, env=ENV)
    assert result.returncode == 0 and "--checkpoint-dir" in result.stdout and "--strategy" in result.stdout


def test_invalid_combinations_fail_with_one_message_before_any_work(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--strategy", "single", "--tp", "2", "--global-batch", "7", "--resume"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "leave --tp at 1" in err
    assert "--global-batch (7) must be a multiple of --micro-batch x dp = 4" in err
    assert "--resume needs --checkpoint-dir" in err


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, tuple[LocalRun, object]]:
    """One run per PyTorch strategy, 6 steps, checkpointed at the end: the references the tests share."""
    runs = {}
    for strategy, nproc in [("single", 1), ("torch-ddp", 2), ("fsdp", 2)]:
        ckpt = tmp_path_factory.mktemp(strategy)
        runs[strategy] = train(*SMALL, "--strategy", strategy, "--checkpoint-dir", str(ckpt), nproc=nproc), ckpt
    return runs


def test_the_logged_gradient_norm_is_the_norm_before_clipping(uninterrupted):
    # Step 1's gradient recomputed here, in one process on the step's whole batch, without the CLI's loop:
    # the same initial weights (seed 0) and the same first draw of the data generator.
    from scalebook import data
    from scalebook.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.named("tiny"))
    x, y = data.get_batch(data.tokenize(data.load_text()), 4, 32, torch.Generator().manual_seed(0))
    model(x, y)[1].backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    logged = uninterrupted["single"][0].grad_norms[1]
    assert expected > 1.5  # the clipping at 1.0 acts: a norm logged after clipping would read 1.0
    # Two micro-batches of 2 against one batch of 4: float32 sums in another order (1e-7 measured).
    assert logged == pytest.approx(expected, rel=1e-5)


def test_two_ranks_reach_the_single_process_losses_and_gradient_norms(uninterrupted):
    # Same global batch of 4 sequences: one process, or two ranks of 2. Summation order differs, so the
    # losses agree to float32 rounding (1e-6 relative), not bit for bit. The gradient norm before clipping
    # is compared too, from step 1: AdamW divides a constant factor on the gradients out of the update, so a
    # missing 1/d (gradients summed over the d ranks instead of averaged) barely moves the losses, but it
    # multiplies this norm by d = 2. Measured deviation ~1e-7; 1e-5 leaves a margin of 100 and is five
    # orders of magnitude below that factor.
    single = uninterrupted["single"][0]
    for strategy in ("torch-ddp", "fsdp"):
        run = uninterrupted[strategy][0]
        assert sorted(run.losses) == sorted(run.grad_norms) == list(range(1, 7))  # no step missing
        for step in single.losses:
            assert run.losses[step] == pytest.approx(single.losses[step], rel=1e-6), (strategy, step)
            assert run.grad_norms[step] == pytest.approx(single.grad_norms[step], rel=1e-5), (strategy, step)


def test_resume_after_a_crash_gives_bit_identical_losses(tmp_path, uninterrupted):
    reference = uninterrupted["single"][0]
    ckpt = tmp_path / "ckpt"
    crashed = train(*SMALL, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--simulate-failure-at", "3",
                    check=False)  # fmt: skip
    assert crashed.returncode == 1 and "simulated failure before step 3" in crashed.stderr
    assert checkpoint.latest_step(ckpt) == 2
    resumed = train(*SMALL, "--checkpoint-dir", str(ckpt), "--resume")
    assert sorted(resumed.losses) == [3, 4, 5, 6]  # it continued from step 2, not from the start
    for step, loss in resumed.losses.items():
        # Bit-identical: same data, same state, same arithmetic.
        assert loss == reference.losses[step] and resumed.grad_norms[step] == reference.grad_norms[step]
    saved = torch.load(checkpoint.step_dir(ckpt, 6) / "rank0.pt", weights_only=True)
    assert saved["losses"].tolist() == [reference.losses[s] for s in range(1, 7)]


def test_sharded_fsdp_checkpoint_resumes_bit_identically(tmp_path, uninterrupted):
    reference = uninterrupted["fsdp"][0].losses
    ckpt = tmp_path / "ckpt"
    train(*SMALL, "--strategy", "fsdp", "--steps", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
          nproc=2)  # fmt: skip
    assert sorted(p.name for p in checkpoint.step_dir(ckpt, 4).iterdir()) == ["rank0.pt", "rank1.pt"]
    resumed = train(*SMALL, "--strategy", "fsdp", "--checkpoint-dir", str(ckpt), "--resume", nproc=2).losses
    assert sorted(resumed) == [5, 6]
    assert all(resumed[s] == reference[s] for s in resumed)


def test_torchrun_restarts_a_failed_job_from_its_last_checkpoint(tmp_path, uninterrupted):
    reference = uninterrupted["torch-ddp"][0].losses
    ckpt = tmp_path / "ckpt"
    run = train(*SMALL, "--strategy", "torch-ddp", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                "--resume", "--simulate-failure-at", "3", nproc=2, extra=("--max-restarts=1",))  # fmt: skip
    assert "simulated failure before step 3" in run.stderr  # the first attempt died ...
    assert checkpoint.latest_step(ckpt) == 6  # ... and the restarted one finished
    finished = run.losses
    assert all(finished[s] == reference[s] for s in range(1, 7))


def test_a_sharded_checkpoint_consolidates_into_our_model_and_hf_gpt2(tmp_path, uninterrupted):
    from transformers import GPT2LMHeadModel

    from scalebook.model import GPT, GPTConfig

    ckpt, single_ckpt = uninterrupted["fsdp"][1], uninterrupted["single"][1]
    out, hf_dir = tmp_path / "model.pt", tmp_path / "hf"
    result = subprocess.run([PY, "-m", "scalebook.checkpoint", str(ckpt), str(out), "--hf", str(hf_dir)],
                            env=ENV, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "step 6 of a 2-rank run" in result.stdout
    ours = GPT(GPTConfig.named("tiny"))
    ours.load_state_dict(torch.load(out, weights_only=True))
    # The same training on one process: equal up to float32 summation order after 6 Adam steps.
    reference = checkpoint.load_shard(single_ckpt, 6, 0)["model"]
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-4, atol=1e-5)
    hf = GPT2LMHeadModel.from_pretrained(hf_dir)
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours.eval()(x)[0], rtol=1e-5, atol=1e-5)


def test_a_timed_out_run_leaves_no_rank_behind(tmp_path):
    marker = f"--metrics={tmp_path / 'never.jsonl'}"  # a unique argument to find the ranks by
    with pytest.raises(subprocess.TimeoutExpired):
        run_local([*SMALL, "--strategy", "torch-ddp", "--steps", "100000", marker], nproc=2, timeout=8)
    survivors = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert survivors == []
