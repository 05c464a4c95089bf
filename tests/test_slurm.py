"""The batch scripts in slurm/, submitted unchanged to a real SLURM cluster (a controller and two emulated
GPU nodes on this machine). The tests vary only what the scripts document as user settings: the number
of ranks per node (CPUs here, not GPUs), the training arguments and the virtual environment."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scalebook.cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[1]
VENV = str(Path(sys.executable).parents[1])
ARGS = "--steps 4 --micro-batch 1 --global-batch 4 --seq-len 32"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # Ports away from the readers' `make cluster-up` defaults, so a running reader cluster does not clash.
    local = LocalCluster(tmp_path_factory.mktemp("slurm"), controller_port=16917, node_port=17101)
    with local:
        yield local


def submit(cluster, tmp_path, script, train_args, **env):
    metrics = tmp_path / "metrics.jsonl"
    settings = {"SCALEBOOK_VENV": VENV, "NPROC_PER_NODE": "2",
                "TRAIN_ARGS": f"{train_args} --metrics {metrics}", **env}  # fmt: skip
    result = subprocess.run(
        ["sbatch", "--parsable", "--wait", str(ROOT / "slurm" / script)],
        cwd=tmp_path, env={**cluster.env(), **settings}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    job_id = result.stdout.strip().split(";")[0]
    info = cluster.run("scontrol", "show", "job", job_id).stdout
    log = "".join(p.read_text() for p in tmp_path.glob(f"*-{job_id}.out"))
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return result.returncode, info, log, records


def field(info: str, name: str) -> str:
    return re.search(rf"\b{name}=(\S+)", info).group(1)


def direct_torchrun(tmp_path, nproc: int) -> list[float]:
    metrics = tmp_path / "direct.jsonl"
    subprocess.run(
        [str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc-per-node={nproc}",
         "-m", "scalebook.train", "--strategy", "torch-ddp", "--no-progress", *ARGS.split(), "--metrics", str(metrics)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def test_single_node_job_completes_with_the_losses_of_a_direct_torchrun(cluster, tmp_path):
    code, info, log, records = submit(cluster, tmp_path, "train_single_node.sbatch", ARGS)
    assert code == 0, log
    assert field(info, "JobState") == "COMPLETED" and field(info, "ExitCode") == "0:0"
    assert field(info, "TresPerNode") == "gres:gpu:4"  # the GPU request went through unchanged
    assert [r["world_size"] for r in records] == [2] * 4
    # Same code, same ranks, same data: the cluster adds nothing to the arithmetic.
    assert [r["loss"] for r in records] == direct_torchrun(tmp_path, 2)


def test_two_node_job_rendezvouses_across_both_nodes(cluster, tmp_path):
    code, info, log, records = submit(cluster, tmp_path, "train_multi_node.sbatch", ARGS)
    assert code == 0, log
    assert field(info, "JobState") == "COMPLETED" and field(info, "NodeList") == "n[1-2]"
    assert "2 nodes x 2 ranks, rendezvous at n1" in log
    assert [r["world_size"] for r in records] == [4] * 4
    single = [r["loss"] for r in records]
    # Four ranks sum the gradients in a different order than two: equal to float32 rounding.
    assert single == pytest.approx(direct_torchrun(tmp_path, 2), rel=1e-6)


def test_a_failing_job_reports_a_nonzero_exit_through_sbatch_wait(cluster, tmp_path):
    code, info, log, _ = submit(cluster, tmp_path, "train_single_node.sbatch", "--global-batch 3")
    assert code != 0
    assert field(info, "JobState") == "FAILED"
    assert "--global-batch (3) must be a multiple of --micro-batch x dp" in log


def test_readme_memory_table_matches_accounting():
    from scalebook import accounting, configs
    from scalebook.model import GPTConfig

    readme = (ROOT / "slurm" / "README.md").read_text()
    for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"):
        cfg = configs.ModelConfig.from_gpt_config(GPTConfig.named(name), name=name)
        cells = [f"{accounting.param_count(cfg) / 1e6:.0f}M"] + [
            f"{accounting.model_state_bytes(cfg, zero_stage=stage, dp=dp, precision='fp32').total / 1e9:.2f} GB"
            for stage, dp in ((0, 4), (3, 4), (3, 8))
        ]
        assert f"| {name} | " + " | ".join(cells) + " |" in readme
