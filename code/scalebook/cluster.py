"""A real SLURM cluster on one machine: a controller and two emulated GPU nodes, for tests and readers.

``LocalCluster(workdir).up()`` writes a ``slurm.conf`` into ``workdir``, starts its own ``munged`` (the
authentication daemon, on a socket of its own, so clusters and a system munged do not share one), ``slurmctld``
(the controller) and one ``slurmd`` per emulated node, and waits until the nodes are idle; ``down()`` stops every
daemon ``up()`` started, munged included, removes the files it wrote (``workdir`` itself once empty) and its line
in ``/etc/hosts``.
Clients (``sbatch``, ``squeue``, ``scontrol``) find the cluster through the ``SLURM_CONF`` variable,
which :meth:`LocalCluster.env` supplies. From a shell: ``python -m scalebook.cluster up|down|status``
(or ``make cluster-up`` / ``make cluster-down``).

The emulated nodes ``n1`` and ``n2`` both run on this host (Debian's SLURM allows several ``slurmd``
on one machine, each on its own port). Each declares 4 GPUs backed by empty files, in a partition named
``gpu``, so a batch script written for a GPU cluster (``#SBATCH --gres=gpu:4``) is accepted unchanged;
the ranks it starts see no CUDA device and fall back to gloo on the CPU. There are no cgroups: jobs are tracked
by process (``proctrack/linuxproc``); ``sbatch --wait`` reports their exit codes and ``scontrol show job`` their
state until the controller forgets them. ``LocalCluster(workdir, accounting=True)`` (``python -m scalebook.cluster
up`` starts it so) adds accounting, a MariaDB server and ``slurmdbd`` (:mod:`scalebook.cluster_accounting`), so that
``sacct`` (:meth:`LocalCluster.sacct`) keeps every run of every job. :meth:`LocalCluster.submit` and
:meth:`LocalCluster.wait_for` leave time in between to signal a running job (``scancel --signal=USR1 --batch``)
or requeue it; SLURM holds a requeued job back about two minutes unless ``scontrol update JobId=N
StartTime=now+2`` lets it start sooner (not ``now``: slurmd refuses a launch credential created in the same
second as the kill that revoked the first run's, and the job fails with "Job credential revoked").

Requires root (it starts daemons and edits ``/etc/hosts``) and the Debian packages ``slurm-wlm`` and
``munge``; accounting also ``slurmdbd`` and ``mariadb-server``.

Source: SLURM documentation, "slurm.conf", "gres.conf" and "Multiple slurmd support"
(https://slurm.schedmd.com/); MUNGE documentation.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from scalebook.cluster_accounting import ACCOUNTING_ENTRIES, Accounting

NODES = ("n1", "n2")
GPUS_PER_NODE = 4
CPUS_PER_NODE = 16
_HOSTS_MARK = "# scalebook local SLURM cluster"
_DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol")
# What up() creates in its workdir; down() removes exactly these, so a workdir holding other files survives.
_WORKDIR_ENTRIES = ("slurm.conf", "gres.conf", "state", "log", "gpu", "spool", "munge", "slurmctld.pid",
                    *(f"slurmd.{n}.pid" for n in NODES))  # fmt: skip


class ClusterError(RuntimeError):
    """The local cluster could not start, or a job did not finish as expected."""


def _slurm_conf(workdir: Path, controller_port: int, node_port: int, munge_socket: Path, dbd_port: int | None) -> str:
    first, last = node_port, node_port + len(NODES) - 1
    accounting = ("AccountingStorageType=accounting_storage/none" if dbd_port is None else
                  f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=localhost\n"
                  f"AccountingStoragePort={dbd_port}\n"
                  # The munged of slurmdbd's connections: this cluster's, not the default socket.
                  f"AccountingStoragePass={munge_socket}")  # fmt: skip
    return f"""\
ClusterName=scalebook
SlurmctldHost=localhost
SlurmctldPort={controller_port}
SlurmdPort={node_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={workdir}/state
SlurmdSpoolDir={workdir}/spool/%n
SlurmctldPidFile={workdir}/slurmctld.pid
SlurmdPidFile={workdir}/slurmd.%n.pid
SlurmctldLogFile={workdir}/log/slurmctld.log
SlurmdLogFile={workdir}/log/slurmd.%n.log
# No cgroups in a container: track job processes by their parent ids, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# The emulated nodes declare more CPUs and GPUs than this host has; believe the configuration.
SlurmdParameters=config_overrides
GresTypes=gpu
# Forget finished jobs after a few seconds so `sbatch --wait` returns promptly.
MinJobAge=5
# Reject a request that can never run instead of leaving it pending forever.
EnforcePartLimits=ALL
ReturnToService=2
SchedulerType=sched/backfill
JobCompType=jobcomp/none
{accounting}
MpiDefault=none
InactiveLimit=0
# A stopped job gets SIGTERM, then SIGKILL this many seconds later (SLURM's default): time for its ranks to save.
KillWait=30
Waittime=0
NodeName=n[1-{len(NODES)}] NodeAddr=127.0.0.1 Port=[{first}-{last}] CPUs={CPUS_PER_NODE} RealMemory=4000 \
Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN
PartitionName=gpu Nodes=n[1-{len(NODES)}] Default=YES MaxTime=60 State=UP
"""


class LocalCluster:
    """Start and stop the two-node cluster whose files live in ``workdir``; with ``accounting``, also MariaDB and
    ``slurmdbd`` (:mod:`scalebook.cluster_accounting`, a few seconds more), on ports ``controller_port + 2`` and
    ``controller_port + 1``, so that ``sacct`` answers."""

    def __init__(self, workdir: str | os.PathLike, *, controller_port: int = 16817, node_port: int = 17001,
                 accounting: bool = False):  # fmt: skip
        self.workdir = Path(workdir).resolve()
        self.controller_port = controller_port
        self.node_port = node_port
        self.accounting = Accounting(self.workdir, controller_port + 1, controller_port + 2) if accounting else None

    @property
    def conf(self) -> Path:
        return self.workdir / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        """This cluster's munged socket. munged wants every directory above it searchable by all users, which a
        private workdir (pytest's are 0700) is not, so it lives in /run, named after the workdir."""
        digest = hashlib.sha256(str(self.workdir).encode()).hexdigest()[:12]
        return Path("/run", f"scalebook-munge-{digest}", "munge.socket")

    def env(self) -> dict[str, str]:
        """The environment for SLURM clients (``sbatch``, ``squeue``...) talking to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, check: bool = True, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """Run a SLURM client command against this cluster and return its completed process."""
        result = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise ClusterError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    # -- starting ------------------------------------------------------------------------------

    def up(self, timeout: float = 60.0) -> LocalCluster:
        """Configure and start munge, the controller and the nodes; return once every node is idle."""
        missing = [d for d in _DAEMONS if not shutil.which(d) and not Path("/usr/sbin", d).exists()]
        if missing:
            raise ClusterError(
                f"SLURM is not installed (missing {missing}); install it with "
                "`apt-get install -y slurm-wlm munge` (the repository's .ci/run does)"
            )
        if os.geteuid() != 0:
            raise ClusterError("the local cluster starts daemons and edits /etc/hosts: run it as root")
        for sub in ("state", "log", "gpu", *(f"spool/{n}" for n in NODES)):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        gpu_files = []
        for i in range(GPUS_PER_NODE):
            (self.workdir / "gpu" / f"gpu{i}").touch()
            gpu_files.append(str(self.workdir / "gpu" / f"gpu{i}"))
        dbd_port = self.accounting.dbd_port if self.accounting else None
        self.conf.write_text(_slurm_conf(self.workdir, self.controller_port, self.node_port, self.munge_socket,
                                         dbd_port))  # fmt: skip
        # A count-only gres.conf leaves the nodes INVAL: every GPU needs a device file, here an empty one.
        (self.workdir / "gres.conf").write_text(
            f"NodeName=n[1-{len(NODES)}] Name=gpu File={self.workdir}/gpu/gpu[0-{GPUS_PER_NODE - 1}]\n"
        )
        self._add_hosts()
        self._start_munge()
        env = self.env()
        if self.accounting:  # before the controller, which sends it the cluster's jobs from its first one
            try:
                self.accounting.start(self.munge_socket, env)
            except RuntimeError as error:
                raise ClusterError(str(error)) from None
        subprocess.run(["slurmctld", "-i", "-f", str(self.conf)], env=env, check=True, timeout=60)
        for node in NODES:
            subprocess.run(["slurmd", "-N", node, "-f", str(self.conf)], env=env, check=True, timeout=60)
        self._wait_idle(timeout)
        return self

    @property
    def _hosts_line(self) -> str:
        # One line per cluster, so that taking one cluster down leaves another's names resolvable.
        return f"127.0.0.1 {' '.join(NODES)} {_HOSTS_MARK} {self.workdir}\n"

    def _add_hosts(self) -> None:
        # Rendezvous resolves node names; without this line it fails after minutes, not seconds.
        hosts = Path("/etc/hosts")
        text = hosts.read_text()
        if self._hosts_line not in text:
            hosts.write_text(text.rstrip("\n") + "\n" + self._hosts_line)

    def _munged(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["munged", f"--socket={self.munge_socket}", *args], capture_output=True, text=True,
                              timeout=60)  # fmt: skip

    def _start_munge(self) -> None:
        munge = self.workdir / "munge"
        munge.mkdir(mode=0o700, exist_ok=True)
        key = munge / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o600)
        self.munge_socket.parent.mkdir(mode=0o755, exist_ok=True)
        started = self._munged(
            f"--key-file={key}",
            f"--pid-file={munge}/munged.pid",
            f"--seed-file={munge}/munged.seed",
            f"--log-file={self.workdir}/log/munged.log",
        )
        if started.returncode != 0:
            raise ClusterError(f"munged did not start: {started.stderr.strip()}")

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            result = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10)
            states = result.stdout.strip()
            lines = states.splitlines()
            if result.returncode == 0 and len(lines) == len(NODES) and all(s.split()[1] == "idle" for s in lines):
                return
            time.sleep(0.3)
        raise ClusterError(f"nodes not idle after {timeout:.0f} s (sinfo: {states!r}); see {self.workdir}/log")

    # -- stopping ------------------------------------------------------------------------------

    def down(self, *, keep_files: bool = False) -> None:
        """Stop the daemons this cluster started (munged included), remove its /etc/hosts line and, unless
        ``keep_files`` (to read the logs of a failed start), the files ``up()`` wrote. Safe to call twice."""
        if self.conf.exists():
            jobs = subprocess.run(["squeue", "-h", "-o", "%A"], env=self.env(), capture_output=True, text=True,
                                  timeout=30).stdout.split()  # fmt: skip
            if jobs:
                subprocess.run(["scancel", *jobs], env=self.env(), capture_output=True, timeout=30)
            subprocess.run(["scontrol", "shutdown"], env=self.env(), capture_output=True, timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and self._running("slurmd", "slurmctld"):
            time.sleep(0.2)
        for name in ("slurmd", "slurmctld"):  # whatever did not stop by itself
            subprocess.run(["pkill", "-9", "-f", f"{name} .*{self.conf}"], capture_output=True, timeout=30)
        Accounting(self.workdir, 0, 0).stop()  # (whether up() started it or not: the files say)
        # A job's tasks outlive a killed slurmd: every process started for this cluster carries its SLURM_CONF.
        from scalebook.comm import processes

        processes.kill_marked(str(self.conf), name="SLURM_CONF")
        if self.munge_socket.exists():
            self._munged("--stop")  # waits until the daemon bound to the socket has exited
        shutil.rmtree(self.munge_socket.parent, ignore_errors=True)
        hosts = Path("/etc/hosts")
        text = hosts.read_text()
        if self._hosts_line in text:
            hosts.write_text(text.replace(self._hosts_line, ""))
        if not keep_files:
            self._remove_files()

    def _remove_files(self) -> None:
        for name in (*_WORKDIR_ENTRIES, *ACCOUNTING_ENTRIES):
            entry = self.workdir / name
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink(missing_ok=True)
        if self.workdir.is_dir() and not any(self.workdir.iterdir()):
            self.workdir.rmdir()

    def _running(self, *names: str) -> bool:
        return any(
            subprocess.run(["pgrep", "-f", f"{name} .*{self.conf}"], capture_output=True, timeout=30).returncode == 0
            for name in names
        )

    def __enter__(self) -> LocalCluster:
        try:
            return self.up()
        except BaseException:
            self.down(keep_files=True)  # the error names a log in the workdir
            raise

    def __exit__(self, *exc) -> None:
        self.down()

    # -- jobs ----------------------------------------------------------------------------------

    def submit_and_wait(
        self,
        script: str | os.PathLike,
        *args: str,
        timeout: float = 120.0,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> tuple[int, str]:
        """``sbatch --wait`` a script from ``cwd`` (where its log lands); return (exit code, job id).

        Extra ``args`` go to ``sbatch`` before the script.
        """
        try:
            result = self._sbatch(script, "--wait", *args, env=env, cwd=cwd, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            # Killing sbatch leaves its job running: cancel it (sbatch --parsable printed its id at submission).
            printed = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            job_id = printed.strip().split(";")[0]
            if job_id:
                self.run("scancel", job_id, check=False, timeout=30)
            raise ClusterError(f"sbatch --wait {script} did not finish in {timeout:.0f} s; job {job_id or '?'} "
                               "was cancelled") from None  # fmt: skip
        return result.returncode, result.stdout.strip().split(";")[0]

    def submit(self, script: str | os.PathLike, *args: str, env: dict[str, str] | None = None, cwd=None) -> str:
        """``sbatch`` a script from ``cwd`` without waiting for it (to signal or requeue it meanwhile); its job id."""
        result = self._sbatch(script, *args, env=env, cwd=cwd, timeout=60)
        if result.returncode != 0:
            raise ClusterError(f"sbatch {script} failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout.strip().split(";")[0]

    def _sbatch(self, script, *args: str, env, cwd, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(["sbatch", "--parsable", *args, str(script)], env={**self.env(), **(env or {})},
                              capture_output=True, text=True, timeout=timeout, cwd=cwd)  # fmt: skip

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields of ``job_id`` (``JobState``, ``Restarts``, ``NodeList``...); empty once the
        controller has forgotten the job (``MinJobAge`` seconds after it ended)."""
        result = self.run("scontrol", "show", "job", "--oneliner", job_id, check=False, timeout=30)
        return dict(field.split("=", 1) for field in result.stdout.split() if "=" in field)

    def sacct(self, job_id: str, fields: tuple[str, ...] = ("JobID", "State", "ExitCode", "Start", "End")) -> list:
        """Accounting's record of each run of ``job_id``, oldest first, as dicts of ``fields`` (``sacct
        --duplicates``: a requeued job has one record per run, ``REQUEUED`` for each run that was cut short); needs
        the cluster's ``accounting``. ``sacct`` remembers jobs that ``scontrol`` has forgotten."""
        out = self.run("sacct", "-j", job_id, "--duplicates", "-X", "-n", "-P", "-o", ",".join(fields)).stdout
        return [dict(zip(fields, line.split("|"), strict=True)) for line in out.splitlines()]

    def wait_for(self, job_id: str, states: tuple[str, ...], timeout: float = 120.0) -> dict[str, str]:
        """Poll until the job's ``JobState`` is one of ``states``; return its fields then, or raise ClusterError."""
        deadline, fields = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            time.sleep(0.2)
        raise ClusterError(f"job {job_id} not in {states} after {timeout:.0f} s: {fields.get('JobState', 'forgotten')}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m scalebook.cluster", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument("--no-accounting", action="store_true",
                        help="up: no MariaDB and slurmdbd (no sacct), a few seconds faster")  # fmt: skip
    parser.add_argument("--workdir", default=os.environ.get("SCALEBOOK_CLUSTER_DIR", "/tmp/scalebook-slurm"),
                        help="where the configuration, logs and state live (default: %(default)s)")  # fmt: skip
    args = parser.parse_args(argv)
    cluster = LocalCluster(args.workdir, accounting=not args.no_accounting)
    if args.action == "up":
        cluster.up()
        print(f"cluster up: export SLURM_CONF={cluster.conf}")
    elif args.action == "down":
        cluster.down()
        print("cluster down")
    else:
        print(cluster.run("sinfo", check=False).stdout or "cluster not running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
