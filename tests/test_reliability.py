"""Runs that fail loudly and never lose work (issue 20): each numbered failure of the issue that the runtime owns,
reproduced, and what `python -m scalebook.train` does now.

1. a corrupted checkpoint (flipped bytes, truncated, empty) is named and passed over for the previous one;
2. a diverged run (NaN loss) stops naming the last good checkpoint, which stays `latest`;
4. the default --global-batch fits any number of ranks, and an error is printed once, by rank 0, exit code 2;
5. unwritable paths, missing or too little data fail before step 1;
6. a resume that cannot continue names each differing setting instead of a KeyError, and one in another
   layout continues the run (the checkpoint is resharded: tests/test_reshard.py across ranks);
7. --cp runs as --help says.

(Item 3, the data itself, is tests/test_data.py's; item 8, the cluster, tests/test_slurm.py's.)
Most runs are in this process through the CLI's own `main` and `run`, on the tiny GPT for a few steps."""

import argparse
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from scalebook.comm import free_port, launch
from scalebook.train import checkpoint, cli
from scalebook.train.loop import TrainConfig, training_steps
from scalebook.train.preflight import RESUME_SETTINGS, default_global_batch, preflight

SMALL = ["--steps", "4", "--micro-batch", "2", "--global-batch", "4", "--seq-len", "32", "--no-progress",
         "--checkpoint-every", "2", "--log-every", "100"]  # fmt: skip


def args_of(argv: list[str], **changes) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(cli.build_parser().parse_args(argv)), **changes})


def steps(records) -> list[tuple[float, float]]:
    return [(r.loss, r.grad_norm) for r in records]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list]:
    """SMALL trained once with checkpoints at steps 2 and 4; its (loss, grad norm) per step."""
    ckpt = str(tmp_path_factory.mktemp("saved") / "ckpt")
    return ckpt, steps(cli.run(args_of(SMALL, checkpoint_dir=ckpt)))


def copy_of(saved, tmp_path) -> str:
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved[0], ckpt)
    return ckpt


# ----- 1. integrity ------------------------------------------------------------------------------------------


def flip_4_kib(path):
    data = bytearray(path.read_bytes())
    data[100_000:104_096] = bytes(b ^ 0xFF for b in data[100_000:104_096])
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "flipped": (flip_4_kib, "is corrupt: its SHA-256 differs from the one in manifest.json"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:5000]), "is truncated: 5000 bytes, manifest.json says"),
    "empty": (lambda p: p.write_bytes(b""), "is empty: 0 bytes, manifest.json says"),
}


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_a_corrupt_checkpoint_file_is_named_and_the_previous_checkpoint_used(kind, saved, tmp_path):
    ckpt = copy_of(saved, tmp_path)
    bad = checkpoint.step_dir(ckpt, 4) / "__0_0.distcp"  # DCP's file of rank 0
    size = bad.stat().st_size
    corrupt, message = CORRUPTIONS[kind]
    corrupt(bad)
    assert kind != "flipped" or bad.stat().st_size == size  # the same size: only a checksum can tell
    # Before: torch.load resumed from the flipped bytes (loss 5.20 instead of 3.36), or failed deep inside.
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(f"{bad} {message}")):
        checkpoint.verify(ckpt, 4)
    assert checkpoint.newest_intact(ckpt) == (2, [f"{bad} {message}" + ("" if kind == "flipped" else f" {size}")])


def test_resume_passes_over_a_corrupt_checkpoint_saying_so_and_repeats_the_steps_bit_for_bit(saved, tmp_path, capsys):
    ckpt = copy_of(saved, tmp_path)
    flip_4_kib(checkpoint.step_dir(ckpt, 4) / "__0_0.distcp")
    resumed = cli.run(args_of(SMALL, checkpoint_dir=ckpt, resume=True))
    notes = capsys.readouterr().err.strip().splitlines()
    assert notes == [f"--resume: {checkpoint.step_dir(ckpt, 4)}/__0_0.distcp is corrupt: its SHA-256 differs from the "
                     "one in manifest.json; resuming from step 2, the newest intact checkpoint"]  # fmt: skip
    assert steps(resumed) == saved[1][2:]  # steps 3 and 4 again, from step 2's state: the same arithmetic
    assert checkpoint.newest_intact(ckpt) == (4, [])  # and step 4 is written afresh


def _verify_resume_on_each_rank(ckpt: str) -> dict:
    """Worker: this rank's pre-flight as a rank of a launch runs it, then settle_resume; the files each hashed."""
    import torch.distributed as dist

    from scalebook.train.preflight import settle_resume

    hashed, sha256 = [], checkpoint._sha256
    checkpoint._sha256 = lambda path: hashed.append(path.name) or sha256(path)  # this rank's process only
    args = args_of(SMALL, checkpoint_dir=ckpt, resume=True, strategy="ddp")
    plan = preflight(args, 2, verify_checkpoint=False)
    before = (plan.start, list(hashed))
    to_train = settle_resume(args, plan, rank=dist.get_rank(), group=dist.group.WORLD)
    return {"before": before, "start": plan.start, "hashed": hashed, "notes": plan.notes, "to_train": to_train}


def test_the_ranks_of_a_launch_read_the_checkpoint_files_once_in_all_and_fall_back_together(saved, tmp_path):
    """A rank's pre-flight takes ``latest`` without reading a file; settle_resume then splits the reading over
    the ranks (each file of step 4, then of step 2, once in all) and both fall back from the damaged step 4
    with the same note, with steps 3 and 4 still to train although ``latest`` was at --steps (issue 34)."""
    ckpt = copy_of(saved, tmp_path)
    flip_4_kib(checkpoint.step_dir(ckpt, 4) / "__0_0.distcp")
    ranks = launch(_verify_resume_on_each_rank, 2, ckpt, timeout=120)
    assert all(rank["before"] == (4, []) for rank in ranks)  # nothing read before the group exists
    assert {rank["start"] for rank in ranks} == {2} and ranks[0]["notes"] == ranks[1]["notes"] != []
    assert all(rank["to_train"] for rank in ranks)
    files = [*checkpoint.read_manifest(ckpt, 4)["files"], *checkpoint.read_manifest(ckpt, 2)["files"]]
    hashed = [name for rank in ranks for name in rank["hashed"]]
    assert sorted(hashed) == sorted(files)  # each file of both steps once: none twice, none left out


def test_a_damaged_manifest_on_the_ranks_of_a_launch_falls_back_like_a_damaged_file(saved, tmp_path):
    """The rank's pre-flight reads not even the manifest of ``latest``: a manifest cut in half is found by the
    shared verification, which falls back to step 2 on both ranks (before: the pre-flight read it unverified)."""
    ckpt = copy_of(saved, tmp_path)
    manifest = checkpoint.step_dir(ckpt, 4) / checkpoint.MANIFEST
    manifest.write_text(manifest.read_text()[:40])
    ranks = launch(_verify_resume_on_each_rank, 2, ckpt, timeout=120)
    assert all(rank["before"] == (4, []) for rank in ranks)
    assert {rank["start"] for rank in ranks} == {2} and ranks[0]["notes"] == ranks[1]["notes"] != []
    hashed = sorted(name for rank in ranks for name in rank["hashed"])
    assert hashed == sorted(checkpoint.read_manifest(ckpt, 2)["files"])  # step 4 had no file list to read


def test_consolidating_a_corrupt_checkpoint_names_the_file(saved, tmp_path, capsys):
    ckpt = copy_of(saved, tmp_path)
    flip_4_kib(checkpoint.step_dir(ckpt, 4) / "__0_0.distcp")
    with pytest.raises(SystemExit) as exit_info:
        checkpoint.main([ckpt, str(tmp_path / "model.pt")])
    assert exit_info.value.code == 2 and not (tmp_path / "model.pt").exists()
    assert f"{checkpoint.step_dir(ckpt, 4)}/__0_0.distcp is corrupt" in capsys.readouterr().err
    assert checkpoint.main([ckpt, str(tmp_path / "model.pt"), "--step", "2"]) == 0


def test_no_intact_checkpoint_at_all_is_an_error_not_a_fresh_start(saved, tmp_path):
    ckpt = copy_of(saved, tmp_path)
    for step in (2, 4):
        (checkpoint.step_dir(ckpt, step) / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(ValueError, match="--resume: no intact checkpoint under .*drop --resume to start from step 0"):
        preflight(args_of(SMALL, checkpoint_dir=ckpt, resume=True), 1)


# ----- 2. divergence -----------------------------------------------------------------------------------------


def test_a_diverged_run_stops_naming_the_last_good_checkpoint_which_stays_latest(tmp_path, capsys):
    # --lr 1e6: the loss is 5.5, then 1e12, then NaN at step 3 (measured). Before: exit 0, and a checkpoint of
    # 53 NaN parameters became `latest`.
    ckpt = tmp_path / "ckpt"
    argv = [*SMALL, "--steps", "6", "--checkpoint-every", "1", "--lr", "1e6", "--checkpoint-dir", str(ckpt)]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "python -m scalebook.train: step 3: loss nan, gradient norm nan, not finite: training diverged and stopped; "
        f"the last good checkpoint is step 2 in {ckpt}. Resume with a lower --lr, or let --skip-nonfinite N skip "
        "up to N such steps"
    ]
    assert checkpoint.latest_step(ckpt) == 2 and not checkpoint.step_dir(ckpt, 3).exists()
    assert all(torch.isfinite(t).all() for t in checkpoint.consolidate(ckpt)[0].values())


def test_skip_nonfinite_skips_that_many_steps_then_stops(tmp_path, capsys):
    argv = [*SMALL, "--steps", "8", "--lr", "1e6", "--skip-nonfinite", "2"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "step 3: loss nan, gradient norm nan, not finite: its update skipped (1 of --skip-nonfinite 2)"
    assert err[1].startswith("step 4: loss nan") and err[1].endswith("(2 of --skip-nonfinite 2)")
    assert err[2].startswith("python -m scalebook.train: step 5: loss nan") and "no checkpoint was saved" in err[2]
    assert len(err) == 3


def diverge_on_every_rank(root: str) -> str:
    """Worker: the diverging run of ZeRO-1 on this rank (its step is a collective); what stopped it."""
    argv = [*SMALL, "--steps", "6", "--checkpoint-every", "1", "--lr", "1e6", "--skip-nonfinite", "1"]
    try:
        cli.run(args_of([*argv, "--strategy", "zero1"], checkpoint_dir=root))
    except cli.TrainingDiverged as error:
        return str(error)
    return "it did not stop"


def test_every_rank_skips_and_stops_at_the_same_step_so_none_hangs(tmp_path):
    # The loss and the gradient norm are all-reduced, so every rank sees the same NaN and makes the same choice;
    # one rank stepping ZeRO-1's collectives alone would hang the run.
    messages = launch(diverge_on_every_rank, 2, str(tmp_path), timeout=120)
    assert messages[0] == messages[1] and messages[0].startswith("step 4: loss nan")
    assert f"the last good checkpoint is step 3 in {tmp_path}" in messages[0]  # step 3 was skipped, then saved
    assert checkpoint.latest_step(tmp_path) == 3


def test_a_non_finite_step_leaves_weights_and_optimizer_untouched():
    """The loop's part: a step whose loss is NaN (injected into step 2 here) is yielded as skipped, with no
    optimizer update; the next step trains on."""
    from scalebook import data
    from scalebook.model import GPT, GPTConfig
    from scalebook.parallel.parallelize import ParallelModel

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=16))
    model = ParallelModel(gpt, torch.optim.AdamW(gpt.parameters()))
    forward_backward, calls = model.forward_backward, []

    def nan_at_step_2(x, y):
        calls.append(1)
        loss = forward_backward(x, y)
        return loss * math.nan if len(calls) == 2 else loss

    model.forward_backward = nan_at_step_2
    generator, tokens = torch.Generator().manual_seed(0), data.corpus_tokens()[:10_000]
    loop = training_steps(model, lambda: data.get_batch(tokens, 2, 16, generator), TrainConfig(steps=3, seq_len=16))
    assert not next(loop).skipped
    before = ({k: v.clone() for k, v in gpt.state_dict().items()}, model.optimizer.state_dict()["state"][0]["step"])
    second = next(loop)
    assert second.skipped and math.isnan(second.loss)
    for name, tensor in gpt.state_dict().items():
        assert torch.equal(tensor, before[0][name]), name  # bit for bit: no update
    assert model.optimizer.state_dict()["state"][0]["step"] == before[1]  # Adam's step count did not move
    third = next(loop)
    assert not third.skipped and math.isfinite(third.loss)


def nan_gradient_at_step_2(strategies: list[str]) -> dict[str, list]:
    """Worker: each strategy trained 5 steps, one gradient on every rank set to NaN in step 2, one skip allowed;
    its (loss, grad norm, skipped) per step."""
    from scalebook.parallel.parallelize import ParallelModel

    clip, results = ParallelModel.clip_grad_norm_, {}
    for strategy in strategies:

        def poisoned(self, max_norm, calls=[]):  # noqa: B006 (one list per strategy: it counts the steps)
            calls.append(1)
            if len(calls) == 2:
                grad = next(p.grad for p in self.model.parameters() if p.grad is not None)
                (grad.to_local() if hasattr(grad, "to_local") else grad).fill_(math.nan)
            return clip(self, max_norm)

        ParallelModel.clip_grad_norm_ = poisoned
        try:
            argv = [*SMALL, "--steps", "5", "--micro-batch", "1", "--skip-nonfinite", "1", "--strategy", strategy]
            results[strategy] = [(r.loss, r.grad_norm, r.skipped) for r in cli.run(args_of(argv))]
        finally:
            ParallelModel.clip_grad_norm_ = clip
    return results


def test_every_wrapper_skips_a_nan_gradient_and_trains_on_as_one_process():
    """The skipped step leaves no trace in any wrapper's buffers or shards: the steps after it equal one process's
    with the same NaN, to float32 summation order (1e-6 relative measured, checked at 1e-5)."""
    single = nan_gradient_at_step_2(["single"])["single"]
    assert single[1][2] and math.isnan(single[1][1]) and not any(skipped for *_, skipped in single[2:])
    for strategy, run in launch(nan_gradient_at_step_2, 2, ["ddp", "zero2", "fsdp"], timeout=180)[0].items():
        assert [skipped for *_, skipped in run] == [False, True, False, False, False], strategy
        for step in (0, 2, 3, 4):
            assert run[step][:2] == pytest.approx(single[step][:2], rel=1e-5), (strategy, step + 1)


def test_a_non_finite_learning_rate_is_refused_before_step_1(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*SMALL, "--lr", "inf"])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "need 0 < --min-lr <= --lr, both finite, got 0.0003 and inf" in err


# ----- 4. defaults that work; one message on rank 0 ----------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_every_strategy_runs_with_its_defaults_on_1_2_4_8_ranks(world_size):
    # Before: --global-batch 8 with --micro-batch 4 allowed at most 2 replicas (the README's sbatch on 4 GPUs).
    for strategy in cli.STRATEGIES:
        if strategy == "single" and world_size > 1:
            continue  # one replica by definition; test_cli_strategies checks its message
        args = cli.build_parser().parse_args(["--strategy", strategy])
        dims = cli.layout(args, world_size)
        assert args.global_batch == 4 * world_size * dims.micro_batches and args.global_batch >= 8
    # Under --pp each replica gets at least --pp micro-batches; a given --global-batch is kept.
    args = cli.build_parser().parse_args(["--strategy", "3d", "--tp", "2", "--pp", "4", "--micro-batch", "1"])
    assert cli.layout(args, 16).micro_batches == 4 and args.global_batch == 8
    assert default_global_batch(cli.build_parser().parse_args(["--global-batch", "12"]), 2) == 8  # the rule alone
    assert cli.build_parser().parse_args(["--global-batch", "12"]).global_batch == 12


def test_an_error_of_a_run_local_launch_under_torchrun_is_printed_once_with_exit_code_2(tmp_path):
    # Before: each rank printed the usage text and its error (178 lines), after the process group started. Since
    # issue 37 run_local runs the pre-flight before it starts torchrun, so the message is all there is (a torchrun
    # started by hand: tests/test_cli_input.py).
    run = cli.run_local([*SMALL, "--strategy", "torch-ddp", "--data", str(tmp_path / "missing.txt")], nproc=2)
    assert run.returncode == 2 and run.records == []
    assert run.stderr.count(f"error: invalid arguments:\n  --data: data path {tmp_path / 'missing.txt'}") == 1
    assert "usage:" not in run.stderr and "Traceback" not in run.stderr and "exitcode" not in run.stderr


def test_check_only_runs_the_pre_flight_for_a_world_size_and_trains_nothing(tmp_path, capsys):
    # The sbatch scripts call it once before torchrun, so that a bad argument ends the job with exit code 2.
    ckpt = tmp_path / "ckpt"
    good = [*SMALL, "--check-only", "4", "--strategy", "torch-ddp", "--global-batch", "8"]  # 4 replicas x 2 rows
    assert cli.main([*good, "--checkpoint-dir", str(ckpt)]) == 0
    assert capsys.readouterr().out == "" and not list(ckpt.glob("step_*"))  # no step ran, nothing saved
    with pytest.raises(SystemExit) as exit_info:  # 4 replicas x micro-batch 4 do not divide a global batch of 8
        cli.main([*good, "--micro-batch", "4"])
    assert exit_info.value.code == 2 and "--global-batch (8) must be a multiple of" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*SMALL, "--check-only", "0"])
    assert exit_info.value.code == 2 and "--check-only takes the number of ranks" in capsys.readouterr().err


# ----- 5. bad paths and data, before step 1 ------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--checkpoint-dir", "--metrics"])
def test_an_unwritable_path_fails_before_step_1(flag, tmp_path, capsys):
    # A path under a regular file: no folder can be made there, even by root (which chmod does not stop).
    # Before: the first checkpoint or metric line failed, after --checkpoint-every steps of training.
    (tmp_path / "file").write_text("x")
    path = tmp_path / "file" / "sub" / "out"
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*SMALL, flag, str(path)])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == ""  # no step ran
    assert f"{flag} {path} " in err and f"({tmp_path / 'file'} is a file, not a folder); choose another {flag}" in err


def test_a_read_only_checkpoint_dir_fails_before_step_1(tmp_path, capsys):
    # An immutable folder (chattr +i) refuses new files even to root, as a read-only mount does.
    folder = tmp_path / "read-only"
    folder.mkdir()
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here (needs root and a filesystem with inode flags)")
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli.main([*SMALL, "--checkpoint-dir", str(folder)])
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == ""
    assert f"--checkpoint-dir {folder} is not a writable folder (Operation not permitted)" in err


def test_missing_or_too_little_data_fails_before_step_1(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    for data, fragment in (
        (tmp_path / "missing.txt", "does not exist"),
        (short, "has 9 byte tokens, fewer than the 33"),
    ):
        with pytest.raises(SystemExit):
            cli.main([*SMALL, "--data", str(data)])
        err = capsys.readouterr().err
        assert f"--data: data path {data}" in err and fragment in err and "None" not in err


# ----- 6. resume errors --------------------------------------------------------------------------------------

CHANGED = {"model": "small", "moe_experts": 4, "moe_top_k": 1, "seq_len": 16, "global_batch": 8, "seed": 1,
           "data": "corpus.txt"}  # fmt: skip


def test_every_resume_setting_that_differs_is_named_with_both_values(saved, tmp_path):
    # Before: another model size gave a tensor-size error deep in load_state_dict.
    assert sorted(CHANGED) == sorted(RESUME_SETTINGS)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text " * 100)
    changes = {**CHANGED, "data": str(corpus)}
    with pytest.raises(ValueError) as error:
        preflight(args_of(SMALL, checkpoint_dir=saved[0], resume=True, **changes), 1)
    lines = str(error.value).splitlines()[1:]
    assert len(lines) == len(RESUME_SETTINGS)  # one line each, nothing else
    for name, value in changes.items():
        flag = f"--{name.replace('_', '-')}"
        original = getattr(args_of(SMALL), name)
        expected = f"{flag}: the checkpoint (step 4 in {saved[0]}) has {original!r}, this run {value!r}; pass {flag} "
        assert any(line.strip().startswith(expected + str(original)) for line in lines), name


def test_a_resume_on_tokens_of_another_tokenizer_is_refused(saved, monkeypatch):
    # The checkpoint was trained on byte tokens; the same --data path now holds shards of another tokenizer (a
    # folder prepared again): the ids would mean other strings, so the run must not continue silently.
    from scalebook import data

    monkeypatch.setattr(data, "tokenizer_id", lambda path=None: "sha256:0123")
    with pytest.raises(ValueError) as error:
        preflight(args_of(SMALL, checkpoint_dir=saved[0], resume=True), 1)
    assert "--data: the checkpoint (step 4" in str(error.value)
    assert "tokenizer bytes" in str(error.value) and "tokens of sha256:0123" in str(error.value)


def test_a_layout_change_continues_the_run(saved, tmp_path, monkeypatch):
    # The book's DDP and ZeRO-3 on a process group of one rank, at a free port (a launcher's variables).
    for name, value in {"RANK": 0, "WORLD_SIZE": 1, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()}.items():
        monkeypatch.setenv(name, str(value))
    # One process -> the book's DDP, and -> ZeRO-3 (before: refused, "laid out as --tp 1 --pp 1 on 1 ranks, which
    # this run cannot read"; before that a KeyError): the same steps 3 and 4.
    for strategy in ("ddp", "zero3"):
        (tmp_path / strategy).mkdir()
        ckpt = copy_of(saved, tmp_path / strategy)
        checkpoint.mark_complete(ckpt, 2)
        resumed = cli.run(args_of([*SMALL, "--strategy", strategy], checkpoint_dir=ckpt, resume=True))
        for got, expected in zip(steps(resumed), saved[1][2:], strict=True):  # one rank: the same sums (1e-6: a
            assert got == pytest.approx(expected, rel=1e-6), strategy  # wrapper's reductions of one rank)


def test_async_saves_are_published_pruned_and_resume_bit_for_bit(tmp_path):
    # --async-save: written by a background thread, published (manifest, latest) when the next save starts or
    # the run ends; --keep-last 2 then deletes step 2.
    ckpt = tmp_path / "ckpt"
    full = cli.run(args_of([*SMALL, "--steps", "6", "--keep-last", "2", "--async-save"], checkpoint_dir=str(ckpt)))
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_000004", "step_000006"]
    assert checkpoint.newest_intact(ckpt) == (6, [])
    checkpoint.mark_complete(ckpt, 4)
    resumed = cli.run(args_of([*SMALL, "--steps", "6", "--async-save"], checkpoint_dir=str(ckpt), resume=True))
    assert steps(resumed) == steps(full)[4:]  # the copy was taken before training moved on: the same state


def test_keep_last_deletes_only_older_checkpoints(tmp_path):
    ckpt = tmp_path / "ckpt"
    cli.run(args_of([*SMALL, "--steps", "6", "--keep-last", "2"], checkpoint_dir=str(ckpt)))
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_000004", "step_000006"]
    # A step folder newer than latest (a save killed before its manifest) and latest itself are never deleted.
    (ckpt / "step_000008").mkdir()
    checkpoint.mark_complete(ckpt, 4)
    assert checkpoint.prune(ckpt, 1) == [] and checkpoint.newest_intact(ckpt) == (4, [])
    assert checkpoint.prune(ckpt, 0) == []  # 0: keep them all
    with pytest.raises(ValueError, match="--keep-last must be >= 0"):
        preflight(args_of(SMALL, keep_last=-1), 1)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names an fd's file through /proc (Linux)")
def test_a_checkpoint_file_and_latest_are_renamed_then_their_directory_fsynced(tmp_path, monkeypatch):
    # rename(2) changes the directory, not the file: only an fsync of the directory after it makes the new name
    # survive a power loss (review C28). Each fsync and rename is recorded with the path it concerns, in order.
    events, fsync, replace = [], os.fsync, os.replace

    def recorded_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recorded_replace(source, target):
        replace(source, target)
        events.append(("rename", os.path.realpath(target)))

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)

    def published(write, path: Path) -> None:
        """``write()`` fsyncs its temporary file's data, renames it to ``path``, then fsyncs ``path``'s directory."""
        events.clear()
        write()
        assert [kind for kind, _ in events] == ["fsync", "rename", "fsync"], events
        assert Path(events[0][1]).name.startswith(f".{path.name}.tmp"), events
        assert events[1:] == [("rename", str(path)), ("fsync", str(path.parent))], events

    root = Path(os.path.realpath(tmp_path))
    published(lambda: checkpoint.atomic_save({"weight": torch.ones(3)}, root / "consolidated.pt"),
              root / "consolidated.pt")  # fmt: skip
    checkpoint.step_dir(root, 2).mkdir()
    published(lambda: checkpoint.write_manifest(root, 2), checkpoint.step_dir(root, 2) / checkpoint.MANIFEST)
    published(lambda: checkpoint.mark_complete(root, 2), root / "latest")
    assert torch.load(root / "consolidated.pt")["weight"].sum() == 3 and checkpoint.latest_step(root) == 2


def test_steps_at_or_below_the_checkpoint_say_so(saved, capsys):
    # Before: nothing happened, silently. Equal: a finished job submitted again has nothing to do (exit 0).
    assert cli.run(args_of(SMALL, checkpoint_dir=saved[0], resume=True)) == []
    assert capsys.readouterr().err == (f"nothing to do: the checkpoint in {saved[0]} is at step 4 = --steps; pass a "
                                       "larger --steps to train further\n")  # fmt: skip
    # Below: the run cannot go back.
    with pytest.raises(ValueError, match="--steps 3 is below the checkpoint's step 4: a run cannot go back"):
        preflight(args_of([*SMALL, "--steps", "3"], checkpoint_dir=saved[0], resume=True), 1)


# ----- 7. --cp -----------------------------------------------------------------------------------------------


def test_cp_is_offered_as_it_works():
    """--help's terms: ring attention with a data-parallel --strategy, --seq-len divisible by 2 x cp, not with
    --pp or --sequence-parallel. (Its runs equal one process: tests/test_cli_strategies.py, "cp", "dp2 x cp2",
    "tp2 x cp2".) Before the runtime issue every strategy rejected it."""
    (text,) = [action.help for action in cli.build_parser()._actions if "--cp" in action.option_strings]
    assert "ring attention" in text and "not with --pp or --sequence-parallel" in text
    for strategy in ("ddp", "torch-ddp", "fsdp", "zero1", "zero2", "zero3"):
        dims = cli.layout(cli.build_parser().parse_args(["--strategy", strategy, "--cp", "2"]), 2)
        assert (dims.cp, dims.dp) == (2, 1)
    refused = {"need a data-parallel wrapper": ["--cp", "2"],
               "must be divisible by 4": ["--cp", "2", "--seq-len", "30"],
               "--cp 2 with --pp 2": ["--strategy", "ddp", "--cp", "2", "--pp", "2"]}  # fmt: skip
    for message, argv in refused.items():
        with pytest.raises(ValueError, match=message):
            cli.layout(cli.build_parser().parse_args(argv), 2 * (1 + ("--pp" in argv)))


def test_the_state_dict_saves_a_parameter_without_optimizer_state_without_it_and_changes_nothing():
    """A parameter that never had a gradient has no AdamW state: the checkpoint holds none for it (a load leaves
    it without, tests/test_state_dict.py), and saving creates none, so its step count does not move (an earlier
    version stepped it at lr 0 on every save, and its first update then used step 2's bias correction)."""
    from scalebook.model import GPT, GPTConfig
    from scalebook.parallel.parallelize import ParallelModel

    torch.manual_seed(0)
    gpt = GPT(GPTConfig.named("tiny"))
    model = ParallelModel(gpt, torch.optim.AdamW(gpt.parameters(), lr=1e-3))
    x = torch.randint(0, 256, (2, 16))
    model.forward_backward(x, x)
    gpt.wpe.weight.grad = None  # as if it had no gradient in every step so far
    model.step()
    before = {k: v.clone() for k, v in model.optimizer.state[gpt.wte.weight].items()}
    weights = {name: p.detach().clone() for name, p in gpt.named_parameters()}
    state = model.state_dict()
    assert not any(key.startswith("optim.wpe.weight.") for key in state) and gpt.wpe.weight not in model.optimizer.state
    for key, value in before.items():
        assert torch.equal(state[f"optim.wte.weight.{key}"], value), key  # step 1 stays step 1
    assert all(torch.equal(p, weights[name]) for name, p in gpt.named_parameters())
