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


def test_two_ranks_reach_the_single_process_losses():
    # Same global batch of 4 sequences: one process, or two ranks of 2. Summation order differs, so the
    # losses agree to float32 rounding (1e-6 relative), not bit for bit.
    single = train(*SMALL).losses
    ddp = train(*SMALL, "--strategy", "torch-ddp", nproc=2).losses
    fsdp = train(*SMALL, "--strategy", "fsdp", nproc=2).losses
    assert sorted(single) == sorted(ddp) == sorted(fsdp) == list(range(1, 7))
    for step in single:
        assert ddp[step] == pytest.approx(single[step], rel=1e-6)
        assert fsdp[step] == pytest.approx(single[step], rel=1e-6)


def test_resume_after_a_crash_gives_bit_identical_losses(tmp_path):
    reference = train(*SMALL).losses
    ckpt = tmp_path / "ckpt"
    crashed = train(*SMALL, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--simulate-failure-at", "3",
                    check=False)  # fmt: skip
    assert crashed.returncode == 1 and "simulated failure before step 3" in crashed.stderr
    assert checkpoint.latest_step(ckpt) == 2
    resumed = train(*SMALL, "--checkpoint-dir", str(ckpt), "--resume").losses
    assert sorted(resumed) == [3, 4, 5, 6]  # it continued from step 2, not from the start
    for step, loss in resumed.items():
        assert loss == reference[step]  # bit-identical: same data, same state, same arithmetic
    saved = torch.load(checkpoint.step_dir(ckpt, 6) / "rank0.pt", weights_only=True)
    assert saved["losses"].tolist() == [reference[s] for s in range(1, 7)]


def test_sharded_fsdp_checkpoint_resumes_bit_identically(tmp_path):
    reference = train(*SMALL, "--strategy", "fsdp", nproc=2).losses
    ckpt = tmp_path / "ckpt"
    train(*SMALL, "--strategy", "fsdp", "--steps", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
          nproc=2)  # fmt: skip
    assert sorted(p.name for p in checkpoint.step_dir(ckpt, 4).iterdir()) == ["rank0.pt", "rank1.pt"]
    resumed = train(*SMALL, "--strategy", "fsdp", "--checkpoint-dir", str(ckpt), "--resume", nproc=2).losses
    assert sorted(resumed) == [5, 6]
    assert all(resumed[s] == reference[s] for s in resumed)


def test_torchrun_restarts_a_failed_job_from_its_last_checkpoint(tmp_path):
    reference = train(*SMALL, "--strategy", "torch-ddp", nproc=2).losses
    ckpt = tmp_path / "ckpt"
    run = train(*SMALL, "--strategy", "torch-ddp", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                "--resume", "--simulate-failure-at", "3", nproc=2, extra=("--max-restarts=1",))  # fmt: skip
    assert "simulated failure before step 3" in run.stderr  # the first attempt died ...
    assert checkpoint.latest_step(ckpt) == 6  # ... and the restarted one finished
    finished = run.losses
    assert all(finished[s] == reference[s] for s in range(1, 7))


def test_a_sharded_checkpoint_consolidates_into_our_model_and_hf_gpt2(tmp_path):
    from transformers import GPT2LMHeadModel

    from scalebook.model import GPT, GPTConfig

    ckpt, single_ckpt = tmp_path / "fsdp", tmp_path / "single"
    train(*SMALL, "--strategy", "fsdp", "--checkpoint-dir", str(ckpt), nproc=2)
    train(*SMALL, "--checkpoint-dir", str(single_ckpt))
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
