"""The batch scripts in slurm/, submitted unchanged to a real SLURM cluster (a controller and two emulated
GPU nodes on this machine). The tests vary only what the scripts document as user settings: the number
of ranks per node (CPUs here, not GPUs), the training arguments and the virtual environment.

Needs SLURM, munge, slurmdbd and MariaDB (the cluster's accounting, which `sacct` reads), and root (the cluster
edits /etc/hosts): without them the cluster's tests skip, and fail under CI=true, which installs them and runs as
root (tests/_skips.py)."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _skips import require

from scalebook.cluster import LocalCluster
from scalebook.train.cli import run_local

ROOT = Path(__file__).resolve().parents[1]
VENV = str(Path(sys.executable).parents[1])
ARGS = "--steps 4 --micro-batch 1 --global-batch 4 --seq-len 32"


def test_cluster_down_stops_every_daemon_it_started_and_removes_its_files(cluster, tmp_path):
    # The issue: `make cluster-down` left the munged that `cluster-up` started running, and its folder behind.
    # A second cluster (own ports, own munged socket, own /etc/hosts line) beside the module's shared one, which
    # must keep running when this one goes down.
    # With accounting, as `make cluster-up` starts it: MariaDB and slurmdbd must stop too.
    workdir = tmp_path / "scalebook-slurm"
    second = LocalCluster(workdir, controller_port=16937, node_port=17121, accounting=True)

    def ours() -> str:  # every process of this cluster names its workdir: on its command line, or in SLURM_CONF
        found = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                cmdline, environ = (proc / "cmdline").read_bytes(), (proc / "environ").read_bytes()
            except OSError:  # gone meanwhile
                continue
            if str(workdir).encode() in cmdline + environ:
                found.append(cmdline.replace(b"\0", b" ").decode())
        return "\n".join(found)

    try:
        second.up()
        started = ours()
        for daemon in ("munged", "slurmctld", "slurmd -N n1", "slurmd -N n2", "slurmdbd", "mariadbd"):
            assert daemon in started
        assert second.run("sacctmgr", "-n", "-P", "list", "cluster", "format=Cluster").stdout.split() == ["scalebook"]
        assert second.munge_socket.exists() and str(workdir) in Path("/etc/hosts").read_text()
        # As `make cluster-down` runs it: only the workdir, the ports come from the files up() wrote.
        down = subprocess.run([sys.executable, "-m", "scalebook.cluster", "down", "--workdir", str(workdir)],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert down.returncode == 0, down.stderr
    finally:
        second.down()  # a no-op when the command above did its job
    assert ours() == ""
    assert not workdir.exists() and not second.munge_socket.parent.exists()
    assert str(workdir) not in Path("/etc/hosts").read_text()
    assert f"n1 n2 # scalebook local SLURM cluster {cluster.workdir}\n" in Path("/etc/hosts").read_text()
    assert cluster.run("sinfo", "-h", "-o", "%t %D").stdout.split() == ["idle", "2"]  # the shared one runs on


def require_slurm() -> None:
    """Skip (fail under CI=true) unless the daemons and clients LocalCluster.up() starts are installed and this
    is root; up() itself raises ClusterError for either, which would be an error here, not a skip."""
    missing = [d for d in ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "slurmdbd", "mariadbd", "sacct")
               if not shutil.which(d) and not Path("/usr/sbin", d).exists()]  # fmt: skip
    require(not missing, f"SLURM ({', '.join(missing)})", "apt-get install -y slurm-wlm munge slurmdbd mariadb-server")
    require(os.geteuid() == 0, "root", "the local cluster starts daemons and edits /etc/hosts: run the tests as root")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require_slurm()
    # Ports away from the readers' `make cluster-up` defaults, so a running reader cluster does not clash.
    # With accounting (MariaDB and slurmdbd, as `make cluster-up` starts it): the tests read `sacct`.
    local = LocalCluster(tmp_path_factory.mktemp("slurm"), controller_port=16917, node_port=17101, accounting=True)
    with local:
        yield local


def settings(tmp_path, train_args, **env) -> dict[str, str]:
    """What the tests set: the virtual environment, 2 ranks per node, the training arguments with a metrics file."""
    return {"SCALEBOOK_VENV": VENV, "NPROC_PER_NODE": "2",
            "TRAIN_ARGS": f"{train_args} --metrics {tmp_path / 'metrics.jsonl'}", **env}  # fmt: skip


def submit(cluster, tmp_path, script, train_args, **env):
    metrics = tmp_path / "metrics.jsonl"
    code, job_id = cluster.submit_and_wait(ROOT / "slurm" / script, env=settings(tmp_path, train_args, **env),
                                           cwd=tmp_path, timeout=120)  # fmt: skip
    info = cluster.run("scontrol", "show", "job", job_id).stdout
    log = "".join(p.read_text() for p in tmp_path.glob(f"*-{job_id}.out"))
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return code, info, log, records


def field(info: str, name: str) -> str:
    return re.search(rf"\b{name}=(\S+)", info).group(1)


def direct_torchrun(nproc: int, args: str = ARGS, strategy: str = "torch-ddp") -> list[float]:
    run = run_local(["--strategy", strategy, "--no-progress", *args.split()], nproc=nproc, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return [record["loss"] for record in run.records]


def test_single_node_job_completes_with_the_losses_of_a_direct_torchrun(cluster, tmp_path):
    code, info, log, records = submit(cluster, tmp_path, "train_single_node.sbatch", ARGS)
    assert code == 0, log
    assert field(info, "JobState") == "COMPLETED" and field(info, "ExitCode") == "0:0"
    assert field(info, "TresPerNode") == "gres:gpu:4"  # the GPU request went through unchanged
    assert [r["world_size"] for r in records] == [2] * 4
    # Same code, same ranks, same data: the cluster adds nothing to the arithmetic.
    assert [r["loss"] for r in records] == direct_torchrun(2)


def test_two_node_job_rendezvouses_across_both_nodes(cluster, tmp_path):
    code, info, log, records = submit(cluster, tmp_path, "train_multi_node.sbatch", ARGS)
    assert code == 0, log
    assert field(info, "JobState") == "COMPLETED" and field(info, "NodeList") == "n[1-2]"
    assert "2 nodes x 2 ranks, rendezvous at n1" in log
    assert [r["world_size"] for r in records] == [4] * 4
    single = [r["loss"] for r in records]
    # Four ranks sum the gradients in a different order than two: equal to float32 rounding.
    assert single == pytest.approx(direct_torchrun(2), rel=1e-6)


def readme_first_sbatch_command() -> list[str]:
    readme = (ROOT / "slurm" / "README.md").read_text()
    return shlex.split(next(line for line in readme.splitlines() if line.strip().startswith("sbatch ")))


def test_the_readmes_sbatch_command_runs_unchanged_on_a_four_gpu_node(cluster, tmp_path):
    # The issue: the CLI's fixed --global-batch 8 with --micro-batch 4 fitted at most 2 ranks, so the README's first
    # command failed on any 4-GPU node. Now nothing is overridden: no NPROC_PER_NODE, no TRAIN_ARGS; only the
    # virtual environment, as the README's checklist (step 2, Install) says.
    command = readme_first_sbatch_command()
    assert command == ["sbatch", "slurm/train_single_node.sbatch"]
    code, job_id = cluster.submit_and_wait(ROOT / command[1], env={"SCALEBOOK_VENV": VENV}, cwd=tmp_path, timeout=120)
    log = "".join(p.read_text() for p in tmp_path.glob(f"*-{job_id}.out"))
    assert code == 0, log
    assert "4 ranks, strategy torch-ddp" in log  # one rank per emulated GPU
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert [r["step"] for r in records] == list(range(1, 21)) and {r["world_size"] for r in records} == {4}


def test_a_failing_job_ends_with_exit_code_2_and_one_message(cluster, tmp_path):
    # The issue: each of 4 ranks printed the error with the whole usage text (178 lines), and the job ended with 143.
    for script, dp in (("train_single_node.sbatch", 2), ("train_multi_node.sbatch", 4)):
        code, info, log, _ = submit(cluster, tmp_path, script, "--global-batch 3")
        assert code == 2, log
        assert field(info, "JobState") == "FAILED" and field(info, "ExitCode") == "2:0"
        # The job's line, then the error once: its heading, what to change, where the usage is; no rank's output.
        assert log.splitlines()[1:] == [
            "python -m scalebook.train: error: invalid arguments:",
            f"  --global-batch (3) must be a multiple of --micro-batch x dp = 4 x {dp} = {4 * dp}; "
            f"e.g. --global-batch {4 * dp}",
            "(see python -m scalebook.train --help)",
        ], log


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


def test_readme_defaults_table_matches_the_command_lines_default_global_batch():
    from scalebook.train.cli import build_parser
    from scalebook.train.preflight import default_global_batch

    readme = (ROOT / "slurm" / "README.md").read_text()
    defaults = build_parser().parse_args([])
    for gpus in (1, 2, 4, 8):
        global_batch = default_global_batch(defaults, gpus)
        per_rank = global_batch // (defaults.micro_batch * gpus)
        assert f"| {gpus} | {global_batch} | {per_rank} |" in readme


def test_a_two_node_3d_job_keeps_tensor_parallelism_inside_a_node(cluster, tmp_path):
    # The layout real clusters use: TP over the ranks of one node, the pipeline across the two nodes.
    code, info, log, records = submit(cluster, tmp_path, "train_multi_node.sbatch", f"{ARGS} --tp 2 --pp 2",
                                      STRATEGY="3d")  # fmt: skip
    assert code == 0, log
    assert field(info, "JobState") == "COMPLETED" and field(info, "NodeList") == "n[1-2]"
    assert [r["world_size"] for r in records] == [4] * 4
    single = run_local(["--strategy", "single", "--no-progress", *ARGS.split()], timeout=120)
    assert single.returncode == 0, single.stderr[-3000:]
    # Tensor-parallel partial sums and the pipeline's micro-batch order: equal to float32 rounding.
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in single.records], rel=1e-6)


# Preemption: long enough a run (30 steps, 1-3 s of training) for the signal to land mid-run.
LONG = "--steps 30 --micro-batch 1 --global-batch 4 --seq-len 32"


def stop_mid_run(cluster, tmp_path, script: str, train_args: str, *sbatch_args: str) -> str:
    """Submit ``script``; once it logs its first step, signal its batch shell as SLURM does before a time limit
    (``--signal=B:USR1``); return its job id once it has requeued itself (pending again)."""
    metrics = tmp_path / "metrics.jsonl"
    job = cluster.submit(ROOT / "slurm" / script, *sbatch_args, env=settings(tmp_path, train_args), cwd=tmp_path)
    deadline = time.monotonic() + 60
    while not (metrics.exists() and metrics.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    cluster.run("scancel", "--signal=USR1", "--batch", job)
    cluster.wait_for(job, ("PENDING",), timeout=60)
    return job


def logs_and_records(tmp_path) -> tuple[str, list[dict]]:
    """Every job's log in ``tmp_path`` (a requeued job appends to its own), and rank 0's metric records in order."""
    log = "".join(p.read_text() for p in sorted(tmp_path.glob("*.out")))
    return log, [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def diagnosis(cluster, info: dict, log: str) -> str:
    """What to read when a job ended otherwise than expected: its fields, its log, the daemons' last lines."""
    fields = {k: info.get(k) for k in ("JobState", "Reason", "ExitCode", "Restarts", "NodeList", "BatchHost")}
    tails = []
    for path in sorted((cluster.workdir / "log").glob("slurm*.log")):
        tails.append(f"--- {path.name} (last 25 lines)\n" + "\n".join(path.read_text().splitlines()[-25:]))
    return f"{fields}\n--- the job's log\n{log}\n" + "\n".join(tails)


def stopped_at(log: str) -> int:
    return int(re.search(r"stopping at step (\d+) on SIGUSR1: checkpoint saved", log).group(1))


def what_the_log_says(log: str) -> list[str]:
    """The log's lines other than the metrics and each run's first line, after checking that it holds no traceback
    and no launcher's noise (the issue: 25 lines of torchrun's SignalException traceback and its warnings for each
    stop; srun's errors for the torchrun that exited with 1)."""
    for noise in ("Traceback", "SignalException", "closing signal", "death signal", "srun: error"):
        assert noise not in log, log
    return [line for line in log.splitlines() if not line.startswith("{") and "(restart " not in line]


def requeued_by_slurm(line: str, job: str) -> bool:
    """SLURM's own line for a run that a requeue ended (the job goes on): slurmstepd's, which no script can omit."""
    return re.fullmatch(rf"slurmstepd-n\d: error: \*\*\* JOB {job} ON n\d CANCELLED AT \S+ DUE TO JOB REQUEUE \*\*\*",
                        line) is not None  # fmt: skip


def until_logged(tmp_path, step: int, timeout: float = 90.0) -> None:
    metrics, deadline = tmp_path / "metrics.jsonl", time.monotonic() + timeout
    while len(metrics.read_text().splitlines()) < step and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_job_stopped_at_its_time_limit_then_preempted_ends_as_if_never_stopped_with_a_clean_log(cluster, tmp_path):
    # Run 1: SIGUSR1 before the time limit: the job saves and requeues itself. Run 2: preempted, as SLURM's
    # PreemptMode=REQUEUE does it: SIGTERM to every process of the job, SIGKILL KillWait (30) s later, requeued.
    job = stop_mid_run(cluster, tmp_path, "train_single_node.sbatch", LONG)
    # SLURM holds a requeued job back ~2 minutes; start it in 2 s instead, not now: slurmd refuses a job's launch
    # credential created in the same second as the kill that revoked the first run's ("Job credential revoked").
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now+2")
    first = stopped_at(logs_and_records(tmp_path)[0])
    until_logged(tmp_path, first + 2)  # the second run has trained a step
    cluster.run("scontrol", "requeue", job)
    cluster.wait_for(job, ("PENDING",), timeout=60)
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now+2")
    info = cluster.wait_for(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=90)
    log, records = logs_and_records(tmp_path)
    ended = (info["JobState"], info["Restarts"], info["ExitCode"])
    assert ended == ("COMPLETED", "2", "0:0"), diagnosis(cluster, info, log)
    assert "(restart 0): 2 ranks" in log and "(restart 1): 2 ranks" in log and "(restart 2): 2 ranks" in log
    # Each stop in a line of rank 0's and one of the job's (the signal, where it saved); SLURM adds its requeue line.
    second = int(re.findall(r"stopping at step (\d+) on SIGTERM", log)[0])
    ckpt = tmp_path / "checkpoints" / "scalebook"
    said = what_the_log_says(log)
    assert [line for line in said if not requeued_by_slurm(line, job)] == [
        f"stopping at step {first} on SIGUSR1: checkpoint saved in {ckpt}; continue with --resume",
        f"job {job}: stopped on SIGUSR1 before the time limit; requeued, to resume from {ckpt}",
        f"stopping at step {second} on SIGTERM: checkpoint saved in {ckpt}; continue with --resume",
        f"job {job}: stopped on SIGTERM; --resume continues from {ckpt}",
    ], log
    assert 1 <= len(said) - 4 <= 2, log
    assert 1 <= first < second < 30
    # Every step logged once: each run began right after the saved step, not at 0 nor one later.
    assert [r["step"] for r in records] == list(range(1, 31))
    # Same ranks, data and state: bit for bit the losses of a run that was never stopped.
    assert [r["loss"] for r in records] == direct_torchrun(2, LONG)
    # Accounting saw it all: each run cut short is REQUEUED, the last COMPLETED; one job id throughout.
    runs = wait_for_sacct(cluster, job)
    assert [(r["JobID"], r["State"]) for r in runs] == [(job, "REQUEUED")] * 2 + [(job, "COMPLETED")], runs
    assert runs[-1]["ExitCode"] == "0:0"


def wait_for_sacct(cluster, job: str, timeout: float = 20.0) -> list[dict]:
    """``sacct``'s runs of ``job`` once the controller has sent the last one's end to slurmdbd (asynchronously)."""
    deadline, runs = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        runs = cluster.sacct(job)
        if runs and runs[-1]["State"] not in ("RUNNING", "PENDING"):
            return runs
        time.sleep(0.5)
    return runs


def test_a_two_node_job_stopped_mid_run_resumes_on_one_node(cluster, tmp_path):
    # SIGUSR1 reaches the ranks of both nodes (the trap -> srun -> each node's torchrun). Its user then cancels the
    # requeued job and resubmits it on one node: the same job name, so the same checkpoints: 4 ranks saved, 2 resume.
    args = f"{LONG} --strategy ddp"
    job = stop_mid_run(cluster, tmp_path, "train_multi_node.sbatch", args)
    cluster.run("scancel", job)
    code, _ = cluster.submit_and_wait(ROOT / "slurm" / "train_multi_node.sbatch", "--nodes=1",
                                      env=settings(tmp_path, args), cwd=tmp_path, timeout=120)  # fmt: skip
    log, records = logs_and_records(tmp_path)
    assert code == 0, log
    assert "(restart 0): 2 nodes x 2 ranks" in log and "(restart 0): 1 nodes x 2 ranks" in log
    step = stopped_at(log)
    ckpt = tmp_path / "checkpoints" / "scalebook-multinode"
    # One line of rank 0's, one of the job's, SLURM's requeue line: no torchrun traceback on either node, and no srun
    # errors (each node's torchrun exits 0 once its ranks have stopped by themselves).
    said = [line for line in what_the_log_says(log) if not requeued_by_slurm(line, job)]
    assert said == [
        f"stopping at step {step} on SIGUSR1: checkpoint saved in {ckpt}; continue with --resume",
        f"job {job}: stopped on SIGUSR1 before the time limit; requeued, to resume from {ckpt}",
    ], log
    assert [r["step"] for r in records] == list(range(1, 31))
    assert [r["world_size"] for r in records] == [4] * step + [2] * (30 - step)
    # Four ranks sum the gradients in another order than two: float32 rounding, which the AdamW steps carry forward
    # (1.1e-6 relative measured at step 37 of a 40-step run; 1e-6 holds over the 4 steps of the other two-node tests).
    assert [r["loss"] for r in records] == pytest.approx(direct_torchrun(2, LONG, "ddp"), rel=1e-5)


def shared_part(script: str) -> str:
    text = (ROOT / "slurm" / script).read_text()
    return text[text.index("# ---- shared by both scripts") : text.index("# ---- end of the shared part")]


def test_both_scripts_share_their_environment_and_preemption_code_word_for_word():
    # Each script stands alone (a user copies one to a cluster); this keeps their common part from drifting.
    assert shared_part("train_single_node.sbatch") == shared_part("train_multi_node.sbatch")
    for script in ("train_single_node.sbatch", "train_multi_node.sbatch"):
        header = (ROOT / "slurm" / script).read_text()
        assert "#SBATCH --requeue\n#SBATCH --signal=B:USR1@120\n#SBATCH --open-mode=append\n" in header


def test_readme_where_things_go_table_names_the_scripts_defaults():
    readme = (ROOT / "slurm" / "README.md").read_text()
    script = (ROOT / "slurm" / "train_single_node.sbatch").read_text()
    as_readme = {"${SLURM_SUBMIT_DIR}/": "", "${SLURM_JOB_NAME}": "<job name>", "${SLURM_JOB_ID}": "<job id>",
                 "%x": "<job name>", "%j": "<job id>"}  # fmt: skip

    def readme_form(default: str) -> str:
        for variable, placeholder in as_readme.items():
            default = default.replace(variable, placeholder)
        return default

    output = re.search(r"#SBATCH --output=(\S+)", script).group(1)
    assert f"| `{readme_form(output)}` | `#SBATCH --output` |" in readme
    for name, suffix in (("CHECKPOINT_DIR", "/"), ("LOG_DIR", "/nccl_trace_rank_<N>")):
        default = re.search(rf'{name}="\$\{{{name}:-(\S+)\}}"', script).group(1)
        assert f"| `{readme_form(default)}{suffix}` | `{name}` |" in readme
    # The preemption table's numbers are the scripts' settings.
    assert "#SBATCH --signal=B:USR1@120" in script and "(`--signal=B:USR1@120`)" in readme
    assert 'TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-90}"' in script
    assert "`TORCH_ELASTIC_SHUTDOWN_TIMEOUT=90`" in readme
