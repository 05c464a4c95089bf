"""`python -m scalebook.train` as a user runs it: every flag documented, a crash resumed bit-identically,
torchrun's restarts, consolidation into our GPT and Hugging Face's, and no rank left behind after a timeout.

(Every layout's equality with one process runs in-process, in ``tests/test_cli_strategies.py``.)"""

import argparse
import os
import subprocess
import sys

import pytest
import torch

from scalebook.train import checkpoint, cli

PY = sys.executable
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
SMALL = ["--steps", "6", "--micro-batch", "2", "--global-batch", "4", "--seq-len", "32", "--no-progress"]


def train(*args: str, nproc: int = 1, check: bool = True, extra: tuple[str, ...] = ()) -> cli.LocalRun:
    result = cli.run_local(list(args), nproc=nproc, torchrun_args=extra, timeout=120)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict[int, float], dict[int, float], dict]:
    """SMALL on one process, in this process with one thread (as the subprocesses below): losses and gradient
    norms by step, and the final weights."""
    ckpt = tmp_path_factory.mktemp("reference")
    args = argparse.Namespace(**{**vars(cli.build_parser().parse_args(SMALL)), "checkpoint_dir": str(ckpt)})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        records = cli.run(args)
    finally:
        torch.set_num_threads(threads)
    losses = {r.step: r.loss for r in records}
    return losses, {r.step: r.grad_norm for r in records}, checkpoint.consolidate(ckpt)[0]


def test_every_flag_is_documented():
    for action in cli.build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"
    result = subprocess.run([PY, "-m", "scalebook.train", "--help"], capture_output=True, text=True, env=ENV)
    assert result.returncode == 0 and "--checkpoint-dir" in result.stdout and "--strategy" in result.stdout
    assert "--cp" in result.stdout and "--ep" in result.stdout and "--moe-experts" in result.stdout


def test_the_logged_gradient_norm_is_the_norm_before_clipping(reference):
    # Step 1's gradient recomputed here, in one process on the step's whole batch, without the CLI's loop:
    # the same initial weights (seed 0) and the same first draw of the data generator.
    from scalebook import data
    from scalebook.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.named("tiny"))
    x, y = data.get_batch(data.tokenize(data.load_text()), 4, 32, torch.Generator().manual_seed(0))
    model(x, y)[1].backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    assert expected > 1.5  # the clipping at 1.0 acts: a norm logged after clipping would read 1.0
    # Two micro-batches of 2 against one batch of 4: float32 sums in another order (1e-7 measured).
    assert reference[1][1] == pytest.approx(expected, rel=1e-5)


def test_resume_after_a_crash_gives_bit_identical_losses(tmp_path, reference):
    losses, norms, _ = reference
    ckpt = tmp_path / "ckpt"
    crashed = train(*SMALL, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--simulate-failure-at", "3",
                    check=False)  # fmt: skip
    assert crashed.returncode == 1 and "simulated failure before step 3" in crashed.stderr
    assert checkpoint.latest_step(ckpt) == 2
    resumed = train(*SMALL, "--checkpoint-dir", str(ckpt), "--resume")
    assert sorted(resumed.losses) == [3, 4, 5, 6]  # it continued from step 2, not from the start
    for step, loss in resumed.losses.items():
        # Bit-identical: same data, same state, same arithmetic, one thread.
        assert loss == losses[step] and resumed.grad_norms[step] == norms[step]
    saved = {"train.losses": torch.empty(6, dtype=torch.float64)}  # DCP fills the tensors it is given
    checkpoint.Checkpointer(ckpt, {}).load(saved, 6)
    assert saved["train.losses"].tolist() == [losses[s] for s in range(1, 7)]


def test_torchrun_restarts_a_failed_job_from_its_last_checkpoint(tmp_path, reference):
    losses = reference[0]
    ckpt = tmp_path / "ckpt"
    run = train(*SMALL, "--strategy", "torch-ddp", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                "--resume", "--simulate-failure-at", "3", nproc=2, extra=("--max-restarts=1",))  # fmt: skip
    assert "simulated failure before step 3" in run.stderr  # the first attempt died ...
    assert checkpoint.latest_step(ckpt) == 6  # ... and the restarted one finished
    assert sorted(run.losses) == list(range(1, 7))
    for step, loss in run.losses.items():
        # Two replicas of one micro-batch of 2 against one process's two: float32 summation order (1e-7).
        assert loss == pytest.approx(losses[step], rel=1e-6)


def test_a_checkpoint_consolidates_into_our_model_and_hf_gpt2(tmp_path, reference):
    from transformers import GPT2LMHeadModel

    from scalebook.model import GPT, GPTConfig

    ckpt = tmp_path / "ckpt"
    train(*SMALL, "--strategy", "fsdp", "--checkpoint-dir", str(ckpt), nproc=2)
    out, hf_dir = tmp_path / "model.pt", tmp_path / "hf"
    result = subprocess.run([PY, "-m", "scalebook.train.checkpoint", str(ckpt), str(out), "--hf", str(hf_dir)],
                            env=ENV, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "step 6 of a 2-rank run" in result.stdout
    ours = GPT(GPTConfig.named("tiny"))
    ours.load_state_dict(torch.load(out, weights_only=True))
    # The same training on one process: equal up to float32 summation order after 6 Adam steps.
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(tensor, reference[2][name], rtol=1e-4, atol=1e-5)
    hf = GPT2LMHeadModel.from_pretrained(hf_dir)
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours.eval()(x)[0], rtol=1e-5, atol=1e-5)


def test_a_timed_out_run_leaves_no_rank_behind(tmp_path):
    marker = f"--metrics={tmp_path / 'never.jsonl'}"  # a unique argument to find the ranks by
    with pytest.raises(subprocess.TimeoutExpired):
        cli.run_local([*SMALL, "--strategy", "torch-ddp", "--steps", "100000", marker], nproc=2, timeout=8)
    survivors = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert survivors == []
