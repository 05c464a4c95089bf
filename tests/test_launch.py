"""Launching ranks: results come back by rank, failures and hangs become clear errors."""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from scalebook.comm import LaunchError, detect_env, launch
from scalebook.comm.launch import _first_host


def all_reduce_rank_plus_one():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
            "threads": torch.get_num_threads(), "env_rank": int(os.environ["RANK"])}


def raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ZeroDivisionError("rank one fails on purpose")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 blocks here: its peer is gone
    return t.item()


def rank_one_never_joins():
    if dist.get_rank() == 1:
        time.sleep(600)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_results_come_back_in_rank_order():
    results = launch(all_reduce_rank_plus_one, 3)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 and r["sum"] == 6.0 and r["threads"] == 1 for r in results)
    assert [r["env_rank"] for r in results] == [0, 1, 2]


def test_a_failing_rank_raises_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1 of 2 raised first") as info:
        launch(raise_on_rank_one, 2, timeout=60)
    assert "ZeroDivisionError: rank one fails on purpose" in str(info.value)
    assert time.monotonic() - start < 30, "a failure must not wait for the full timeout"


def both_ranks_sleep():
    time.sleep(600)


def test_a_rank_missing_from_a_collective_times_out_and_is_named():
    with pytest.raises(LaunchError, match="rank 0 of 2 raised first") as info:
        launch(rank_one_never_joins, 2, timeout=3)
    assert "Timed out" in str(info.value)
    assert "ranks [1] of 2 were still running after 3 s" in str(info.value)


def test_a_silent_hang_is_killed_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"ranks \[0, 1\] of 2 were still running after 2 s"):
        launch(both_ranks_sleep, 2, timeout=2)
    assert time.monotonic() - start < 20  # start-up (~4 s) + the 2 s timeout, with slack


def test_notebook_and_local_functions_are_rejected_before_spawning():
    def local():
        return 1

    with pytest.raises(ValueError, match="local function"):
        launch(local, 2)
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        launch(all_reduce_rank_plus_one, 0)


def test_torchrun_environment_is_read():
    env = detect_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                      "MASTER_ADDR": "node7", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 8, 1, 2)
    assert (env.master_addr, env.master_port, env.launcher) == ("node7", 1234, "torchrun")


def test_slurm_environment_is_read():
    env = detect_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
                      "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_JOB_ID": "42"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert (env.master_addr, env.master_port, env.launcher) == ("gpu007", 10042, "slurm")


def test_no_launcher_means_a_single_process():
    env = detect_env({})
    assert (env.rank, env.world_size, env.launcher) == (0, 1, "none")


@pytest.mark.parametrize("nodelist, first", [("n1", "n1"), ("n[1-2]", "n1"), ("a[3,5-6],b1", "a3"), ("x1,y2", "x1")])
def test_first_host_of_a_slurm_nodelist(nodelist, first):
    assert _first_host(nodelist) == first


def test_one_process_without_a_launcher_gets_a_group_even_when_port_29500_is_taken():
    # Before: a process with no launcher variables (FSDP2 on one rank) always used tcp://127.0.0.1:29500 and
    # failed whenever another job held that port. Now it takes MASTER_PORT if given, else a free port.
    script = (
        "import socket\n"
        "blocker = socket.socket()\n"
        "try:\n"
        "    blocker.bind(('127.0.0.1', 29500)); blocker.listen()\n"
        "except OSError:\n"
        "    pass  # someone else holds it already: the point is the same\n"
        "import torch.distributed as dist\n"
        "from scalebook.comm import init_from_env\n"
        "env = init_from_env(timeout=30)\n"
        "print(env.launcher, dist.get_world_size())\n"
        "dist.destroy_process_group()\n"
    )
    environ = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"}
               and not k.startswith("SLURM_")}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["none", "1"]
