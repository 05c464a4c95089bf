"""Accounting for the local SLURM cluster (:mod:`scalebook.cluster`): a MariaDB server and ``slurmdbd``, so that
``sacct`` shows the jobs, their states and their restarts as on a real cluster.

:meth:`Accounting.start` creates a MariaDB data folder in the cluster's folder (``mariadb-install-db``), starts
``mariadbd`` on it (no systemd here: the daemon itself, on the loopback address and a port of the cluster's, with
a small buffer pool and log), creates the database and the user ``slurmdbd`` writes with (a fresh password, kept
only in the ``slurmdbd.conf`` that only root may read), starts ``slurmdbd`` and registers the cluster with
``sacctmgr``. The controller, started next, sends it every job's start, end, state and requeue.
:meth:`Accounting.stop` ends ``slurmdbd``, then MariaDB (which flushes its tables on SIGTERM), by the pids they
wrote; the cluster removes the files. Nothing here is kept from one start to the next.

Requires root and the Debian packages ``slurmdbd`` and ``mariadb-server``.

Source: SLURM documentation, "Accounting and Resource Limits" and "slurmdbd.conf"; MariaDB documentation,
"mariadb-install-db" and "mariadbd Options".
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["ACCOUNTING_ENTRIES", "Accounting"]

#: What :meth:`Accounting.start` creates in the cluster's folder (besides its logs in ``log/``).
ACCOUNTING_ENTRIES = ("mysql", "mysql.sock", "mariadbd.pid", "slurmdbd.conf", "slurmdbd.pid")
DATABASE, USER = "slurm_acct_db", "slurmdbd"
_PROGRAMS = ("mariadb-install-db", "mariadbd", "mariadb", "slurmdbd", "sacctmgr", "sacct")
# A database for a few hundred jobs: MariaDB's defaults (a 128 MiB buffer pool, a 96 MiB log) only cost disk.
_SMALL = ("--innodb-buffer-pool-size=16M", "--innodb-log-file-size=4M")


class Accounting:
    """MariaDB and ``slurmdbd`` for the cluster whose files live in ``workdir``, on ``dbd_port`` and ``db_port``."""

    def __init__(self, workdir: Path, dbd_port: int, db_port: int, cluster_name: str = "scalebook"):
        self.workdir, self.dbd_port, self.db_port, self.cluster_name = workdir, dbd_port, db_port, cluster_name

    def _path(self, name: str) -> Path:
        return self.workdir / name

    def start(self, munge_socket: Path, env: dict[str, str]) -> None:
        """Start MariaDB and ``slurmdbd`` (``env`` names the cluster's ``slurm.conf``, beside which ``slurmdbd``
        reads its own), create the database and register the cluster; raise RuntimeError naming a log if not."""
        missing = [p for p in _PROGRAMS if not shutil.which(p) and not Path("/usr/sbin", p).exists()]
        if missing:
            raise RuntimeError(f"accounting needs MariaDB and slurmdbd (missing {missing}); install them with "
                               "`apt-get install -y slurmdbd mariadb-server` (.ci/run does)")  # fmt: skip
        self._start_mariadb(env)
        password = secrets.token_hex(16)
        self._sql(f"CREATE DATABASE {DATABASE}; CREATE USER '{USER}'@'127.0.0.1' IDENTIFIED BY '{password}'; "
                  f"GRANT ALL ON {DATABASE}.* TO '{USER}'@'127.0.0.1';")  # fmt: skip
        conf = self._path("slurmdbd.conf")
        conf.touch()
        conf.chmod(0o600)  # before the password goes in; slurmdbd refuses a configuration that others can read
        conf.write_text(self._slurmdbd_conf(munge_socket, password))
        subprocess.run(["slurmdbd"], env=env, check=True, capture_output=True, timeout=60)
        self._until(lambda: _run(["sacctmgr", "-n", "list", "cluster"], env).returncode == 0, "slurmdbd")
        added = _run(["sacctmgr", "-i", "add", "cluster", self.cluster_name], env)
        if added.returncode != 0:
            raise RuntimeError(f"sacctmgr add cluster failed: {added.stderr.strip() or added.stdout.strip()}")

    def _start_mariadb(self, env: dict[str, str]) -> None:
        data, log = self._path("mysql"), self._path("log")
        install = _run(["mariadb-install-db", "--no-defaults", "--user=root", f"--datadir={data}",
                        "--auth-root-authentication-method=normal", "--skip-test-db", *_SMALL], env)  # fmt: skip
        if install.returncode != 0:
            raise RuntimeError(f"mariadb-install-db failed: {install.stderr.strip()[-2000:]}")
        # mariadbd stays in the foreground (no systemd to start it): a process of its own, outliving this one.
        subprocess.Popen(["mariadbd", "--no-defaults", "--user=root", f"--datadir={data}", f"--port={self.db_port}",
                          "--bind-address=127.0.0.1", "--skip-name-resolve", f"--socket={self._path('mysql.sock')}",
                          f"--pid-file={self._path('mariadbd.pid')}", f"--log-error={log}/mariadbd.log", *_SMALL],
                         env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)  # fmt: skip
        self._until(lambda: self._sql("SELECT 1", check=False).returncode == 0, "mariadbd")

    def _sql(self, statements: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run SQL as MariaDB's root, over the server's socket."""
        result = _run(["mariadb", "--no-defaults", f"--socket={self._path('mysql.sock')}", "-u", "root",
                       "-e", statements], None)  # fmt: skip
        if check and result.returncode != 0:
            raise RuntimeError(f"MariaDB refused {statements.split()[0]}...: {result.stderr.strip()}")
        return result

    def _slurmdbd_conf(self, munge_socket: Path, password: str) -> str:
        return f"""\
DbdHost=localhost
DbdPort={self.dbd_port}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
PidFile={self._path("slurmdbd.pid")}
LogFile={self._path("log")}/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={self.db_port}
StorageUser={USER}
StoragePass={password}
StorageLoc={DATABASE}
"""

    def _until(self, ready, daemon: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{daemon} not ready after {timeout:.0f} s; see {self.workdir}/log/{daemon}.log")
            time.sleep(0.2)

    def stop(self) -> None:
        """End ``slurmdbd``, then MariaDB, each by the pid it wrote (SIGTERM, then SIGKILL after 30 s); a daemon
        that is not running is passed over."""
        mark = f"SLURM_CONF={self.workdir / 'slurm.conf'}".encode()  # in both daemons' environment (start())
        for pid_file in ("slurmdbd.pid", "mariadbd.pid"):
            try:
                pid = int(self._path(pid_file).read_text().split()[0])
                if mark not in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    continue  # a stale file: that pid is now another process's
                os.kill(pid, signal.SIGTERM)
            except (FileNotFoundError, IndexError, ValueError, ProcessLookupError):
                continue
            deadline = time.monotonic() + 30
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _run(cmd: list[str], env: dict[str, str] | None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs and is no zombie (a daemon this process started and has not reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
