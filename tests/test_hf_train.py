"""The Hugging Face path: datasets' text loader and transformers.Trainer, launched on 2 CPU ranks by torchrun and
by accelerate launch (from the file accelerate config writes)."""

import json
import os
import subprocess
import sys

import pytest

from scalebook.comm import processes
from scalebook.hf_train import launch, launcher_env, load_blocks, write_accelerate_config

TRAIN_ARGS = ["--steps", "10", "--seq-len", "32"]


def test_text_files_become_byte_blocks_in_order(tmp_path):
    text = "first line\nsecond line, with ümlaut\n" * 5
    path = tmp_path / "a.txt"
    path.write_text(text, encoding="utf-8")
    blocks = load_blocks([str(path)], seq_len=16)
    stream = list(text.encode("utf-8"))
    assert blocks["input_ids"] == [stream[i : i + 16] for i in range(0, len(stream) // 16 * 16, 16)]
    assert blocks["labels"] == blocks["input_ids"]  # GPT2LMHeadModel shifts labels itself


def test_the_accelerate_config_file_is_read_back_by_accelerate_as_two_processes(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    path = write_accelerate_config(tmp_path / "two.yaml", 2)
    config = load_config_from_file(str(path))
    assert (config.distributed_type, config.num_processes, config.num_machines) == ("MULTI_GPU", 2, 1)
    assert (config.mixed_precision, config.use_cpu, config.main_process_port) == ("no", False, 0)
    one = load_config_from_file(str(write_accelerate_config(tmp_path / "one.yaml", 1, mixed_precision="bf16")))
    assert (one.distributed_type, one.num_processes, one.mixed_precision) == ("NO", 1, "bf16")


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [({"num_processes": 0}, "num_processes"), ({"num_processes": 3, "num_machines": 2}, "num_machines"),
     ({"num_processes": 2, "mixed_precision": "fp32"}, "mixed_precision")],
)  # fmt: skip
def test_an_impossible_accelerate_config_is_refused_naming_the_setting(tmp_path, kwargs, names):
    with pytest.raises(ValueError, match=names):
        write_accelerate_config(tmp_path / "bad.yaml", **kwargs)
    assert not (tmp_path / "bad.yaml").exists()


def test_launch_refuses_an_unknown_launcher_and_accelerate_without_a_config():
    with pytest.raises(ValueError, match="launcher must be"):
        launch("mpirun", TRAIN_ARGS)
    with pytest.raises(ValueError, match="config_file"):
        launch("accelerate", TRAIN_ARGS)


def test_launcher_env_keeps_the_launchers_variables_only():
    environ = {"RANK": "1", "WORLD_SIZE": "2", "ACCELERATE_MIXED_PRECISION": "no", "HOME": "/root", "PATH": "/bin"}
    assert launcher_env(environ) == {"ACCELERATE_MIXED_PRECISION": "no", "RANK": "1", "WORLD_SIZE": "2"}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The Trainer's run under torchrun and under accelerate launch: same arguments, 2 CPU ranks each."""
    tmp = tmp_path_factory.mktemp("hf")
    config = write_accelerate_config(tmp / "accelerate.yaml", 2)
    runs = {name: launch(name, ["--output-dir", str(tmp / name), *TRAIN_ARGS], config_file=config)
            for name in ("torchrun", "accelerate")}  # fmt: skip
    for run in runs.values():
        assert run.returncode == 0, run.stderr[-3000:]
    return runs


def test_trainer_trains_our_gpt_with_ddp_on_two_ranks(launched):
    record = launched["torchrun"].record
    assert record["world_size"] == 2 and record["tokens_per_step"] == 2 * 4 * 32
    losses = record["losses"]
    assert len(losses) == 10
    # Untrained byte-level model: about ln(256) = 5.5 nats; ten AdamW steps at lr 3e-3 bring it well below.
    assert losses[0] > 5.0 and losses[-1] < 4.2


def test_accelerate_launch_and_torchrun_train_the_same_losses_bit_for_bit(launched):
    # accelerate launch runs torchrun's own code (torch.distributed.run) with the same ranks, seeds and data:
    # the arithmetic is the same, so the losses are equal exactly, not to a tolerance.
    torchrun, accelerate = launched["torchrun"].record, launched["accelerate"].record
    assert accelerate["world_size"] == torchrun["world_size"] == 2
    assert len(accelerate["losses"]) == 10
    assert accelerate["losses"] == torchrun["losses"]


def test_each_launcher_hands_every_rank_its_rank_and_the_rendezvous(launched):
    for name, run in launched.items():
        envs = run.rank_envs
        assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == [("0", "0", "2"), ("1", "1", "2")]
        assert envs[0]["MASTER_ADDR"] == envs[1]["MASTER_ADDR"] and envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
        accelerate_vars = {k for k in envs[0] if k.startswith("ACCELERATE_")}
        assert bool(accelerate_vars) == (name == "accelerate"), accelerate_vars
    assert launched["accelerate"].rank_envs[0]["ACCELERATE_MIXED_PRECISION"] == "no"


def test_accelerate_on_cpu_without_mpirun_starts_one_process(tmp_path):
    # `use_cpu: true` sends several processes to accelerate's mpirun path; with no MPI hostfile it runs the
    # script once, with no RANK or WORLD_SIZE: a "2-process" CPU config that trains on one process.
    config = tmp_path / "cpu.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nmixed_precision: 'no'\n"
                      "num_machines: 1\nnum_processes: 2\nuse_cpu: true\n")  # fmt: skip
    script = tmp_path / "show_env.py"
    script.write_text("import json\nfrom scalebook.hf_train import launcher_env\n"
                      "print(json.dumps(launcher_env()), flush=True)\n")  # fmt: skip
    result = processes.run(  # on a timeout, whatever accelerate started is killed too
        [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(config),
         str(script)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120, name="accelerate launch",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    envs = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(envs) == 1 and "RANK" not in envs[0] and "WORLD_SIZE" not in envs[0]
    assert envs[0]["ACCELERATE_USE_CPU"] == "True"


def test_a_launch_past_its_timeout_is_killed_with_a_clear_error(tmp_path):
    # 2 s is far less than the ranks' start-up (importing torch and transformers): the launcher and both ranks
    # must be killed, and the error must say which launcher and how long, with the end of its stderr.
    with pytest.raises(TimeoutError, match=r"torchrun did not finish in 2 s \(killed with its ranks\)"):
        launch("torchrun", ["--output-dir", str(tmp_path / "out"), *TRAIN_ARGS], timeout=2)
    leftover = subprocess.run(["pgrep", "-f", f"scalebook.hf_train --output-dir {tmp_path}"], capture_output=True,
                              timeout=30)
    assert leftover.returncode == 1, f"ranks still running: {leftover.stdout!r}"
