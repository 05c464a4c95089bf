"""Run a function on N ranks, and find out which rank we are when someone else launched us.

Two ways in:

* ``launch(fn, world_size, ...)`` starts ``world_size`` local processes (``spawn``), joins them into one
  process group (gloo on CPU), calls ``fn(*args, **kwargs)`` on every rank and returns the list of
  per-rank return values. A rank that raises, or ranks that hang past ``timeout``, become one
  :class:`LaunchError` naming the rank and carrying its traceback; no process is left behind.
* ``init_from_env()`` is for code started by ``torchrun`` or ``srun``: it reads RANK/WORLD_SIZE/... or
  SLURM_PROCID/SLURM_NTASKS/... and initialises the default process group, with NCCL on CUDA
  machines and gloo elsewhere.

With ``check_nccl=True``, or while ``SCALEBOOK_CHECK_NCCL=1`` is set, every rank records its communication
and the run fails unless NCCL could have paired it (:mod:`scalebook.comm.nccl_rules`); ``init_from_env``
honours the same variable.

``spawn`` starts fresh interpreters that import ``fn`` by name, so ``fn`` must live in an importable
module (the package, a script's module, a test file), not in a notebook cell.

Source: PyTorch documentation, "torch.distributed" and "torchrun (Elastic Launch)";
SLURM documentation, "srun" output environment variables.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scalebook.comm import nccl_rules, processes

STARTUP_ALLOWANCE = 120.0  # seconds for all ranks to start and join the process group


class LaunchError(RuntimeError):
    """One or more ranks failed or hung."""


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in a distributed job, as its launcher described it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: str = "none"  # "torchrun", "slurm" or "none"


def _first_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``n[1-2,5]`` -> ``n1``, ``gpu[007-008],cpu1`` -> ``gpu007``."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    match = re.fullmatch(r"(.*)\[([^\]]+)\](.*)", first)
    if not match:
        return first
    prefix, ranges, suffix = match.groups()
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def detect_env(environ: dict | None = None) -> DistEnv:
    """Read the launcher's variables: torchrun's (RANK, WORLD_SIZE, ...) take precedence over SLURM's."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = int(env["SLURM_NTASKS"])
        nodes = int(env.get("SLURM_NNODES", 1))
        job_id = int(env.get("SLURM_JOB_ID", 0))
        # "4" with --ntasks-per-node, else SLURM_TASKS_PER_NODE such as "4(x2)" or "3,2".
        per_node = re.match(r"\d+", env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", ""))
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=world,
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=int(per_node.group()) if per_node else max(1, world // nodes),
            master_addr=env.get("MASTER_ADDR") or _first_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
            # A port derived from the job id lets concurrent jobs on one node avoid each other.
            master_port=int(env.get("MASTER_PORT", 10000 + job_id % 20000)),
            launcher="slurm",
        )
    return DistEnv()


def backend_and_device(local_rank: int = 0) -> tuple[str, torch.device]:
    """NCCL and this rank's GPU when CUDA is present, otherwise gloo on the CPU."""
    if torch.cuda.is_available():
        return "nccl", torch.device("cuda", local_rank % torch.cuda.device_count())
    return "gloo", torch.device("cpu")


def init_from_env(timeout: float = 600.0) -> DistEnv:
    """Initialise the default process group from the launcher's environment and return it.

    Under ``torchrun`` this is PyTorch's standard path: ``init_process_group(backend)``, whose default
    ``env://`` reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. One exception: since PyTorch 2.4,
    torchrun's agent hosts one store for the whole job (TORCHELASTIC_USE_AGENT_STORE=True) and keeps it
    across ``--max-restarts`` restarts, while the default group's keys do not name the attempt, so a
    restarted rank can read the address of its dead predecessor and hang or fail to connect (pytorch
    issue #135712). There the same ``env://`` store gets a prefix per attempt. TORCHELASTIC_RESTART_COUNT
    counts the restarts of one node's agent only (pytorch issue #108158): in a multi-node job with restarts,
    start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which gives every rendezvous round a fresh
    store and takes the plain ``env://`` path here.

    Ranks started by ``srun`` alone have no RANK/WORLD_SIZE variables and no agent: their rank and world
    size come from SLURM's variables, and rank 0 hosts the store at the address :func:`detect_env`
    derived (``tcp://``).
    """
    env = detect_env()
    backend, device = backend_and_device(env.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return env
    if backend == "gloo" and nccl_rules.checking_enabled():
        nccl_rules.record_until_destroy()
    wait = timedelta(seconds=timeout)
    if env.launcher == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(backend, store=_agent_store(wait), rank=env.rank, world_size=env.world_size,
                                timeout=wait)  # fmt: skip
    elif env.launcher == "torchrun":
        dist.init_process_group(backend, timeout=wait)  # init_method="env://"
    else:
        # srun alone: the derived address. No launcher at all (one process that wants a group, e.g. FSDP2 on
        # one rank): nobody else needs the port, so MASTER_PORT if given, else a free one, not a fixed 29500.
        port = env.master_port if env.launcher == "slurm" else int(os.environ.get("MASTER_PORT") or free_port())
        dist.init_process_group(backend, init_method=f"tcp://{env.master_addr}:{port}", rank=env.rank,
                                world_size=env.world_size, timeout=wait)  # fmt: skip
    return env


def _agent_store(timeout: timedelta) -> dist.Store:
    """A client of torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True), its keys prefixed by the restart
    attempt, so that a restarted rank never reads what its dead predecessor wrote (see :func:`init_from_env`)."""
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"scalebook/attempt{attempt}", store)


def rank0_says(text: str, timeout: float = 30.0) -> None:
    """Rank 0 writes ``text`` to stderr; under torchrun the other ranks return only once it has (or after
    ``timeout`` seconds), through the agent's store, before any process group exists.

    For an error that every rank finds and exits on: torchrun stops the remaining ranks as soon as one rank
    exits with a failure, so without the wait a rank 1 that found the error first could have rank 0 stopped
    before it had said anything. Anywhere else (one process, srun) rank 0 writes and the others return at once.
    """
    env = detect_env()
    if env.rank == 0:
        sys.stderr.write(text)
        sys.stderr.flush()
    if env.launcher != "torchrun" or env.world_size == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    try:
        store = _agent_store(timedelta(seconds=timeout))
        if env.rank == 0:
            store.set("rank0_said", "1")
        else:
            store.wait(["rank0_said"], timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001 - no store, or rank 0 never said it: the error stands, exit as planned
        pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_picklable_by_name(fn) -> None:
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"{qualname} is a local function or lambda; spawned ranks import the function by name, "
            "so define it at the top level of a module"
        )
    if module is None or (fn.__module__ == "__main__" and not getattr(module, "__file__", None)):
        raise ValueError(
            f"{qualname} is defined in a notebook or interactive session; spawned ranks cannot import it. "
            "Use a function from the scalebook package (or another importable module)"
        )


def _rank_main(rank, world_size, port, backend, timeout, threads, check_nccl, fn, args, kwargs, outdir):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    # One thread per rank: ranks share the machine's cores, and results become bit-reproducible.
    torch.set_num_threads(threads)
    outcome = {"rank": rank}
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        (Path(outdir) / f"rank{rank}.ready").touch()
        recorder = nccl_rules.start_recording() if check_nccl else None
        outcome["result"] = fn(*args, **kwargs)
        dist.barrier()  # nobody tears down while a peer still talks to it
        if recorder is not None:
            outcome["nccl_calls"] = nccl_rules.stop_recording(recorder)
    except BaseException:
        outcome["error"] = traceback.format_exc()
        outcome["failed_at"] = time.time()  # the first failure is the cause; later ones are echoes
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    path = Path(outdir) / f"rank{rank}.pt"
    torch.save(outcome, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)  # the parent never reads a half-written file


def launch(
    fn,
    world_size: int,
    *args,
    backend: str | None = None,
    timeout: float = 120.0,
    threads_per_rank: int = 1,
    check_nccl: bool | None = None,
    **kwargs,
) -> list:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` fresh local ranks; return their results by rank.

    ``timeout`` bounds the whole launch (and each collective): ranks still running after it are killed
    and a :class:`LaunchError` reports them as hung. ``check_nccl`` (default: the ``SCALEBOOK_CHECK_NCCL``
    variable) records every rank's communication and raises a :class:`LaunchError` where NCCL could not
    have paired it (:mod:`scalebook.comm.nccl_rules`).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout}")
    _check_picklable_by_name(fn)
    backend = backend or backend_and_device()[0]
    check_nccl = nccl_rules.checking_enabled() if check_nccl is None else bool(check_nccl)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="scalebook-launch-") as outdir:
        port = free_port()
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world_size, port, backend, timeout, threads_per_rank, check_nccl, fn, args, kwargs, outdir),
                daemon=False,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        outcomes, hung = _watch(procs, Path(outdir), timeout)
    return _results_or_raise(outcomes, hung, procs, timeout)


def _watch(procs: list, outdir: Path, timeout: float) -> tuple[dict[int, dict], list[int]]:
    """Collect each rank's outcome file until all have finished, one failed (plus 2 s for its peers to
    report), or the timeout passed; kill whatever still runs. Returns (outcomes by rank, hung ranks)."""
    world_size = len(procs)
    # The timeout counts from the moment every rank has joined the group: starting interpreters and
    # importing torch (seconds per rank on a small machine) is not the function's fault.
    deadline = time.monotonic() + STARTUP_ALLOWANCE + timeout
    all_ready = False
    outcomes: dict[int, dict] = {}
    failed_at = None

    def collect() -> None:
        for rank in range(world_size):
            path = outdir / f"rank{rank}.pt"
            if rank not in outcomes and path.exists():
                outcomes[rank] = torch.load(path, weights_only=False)

    try:
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if not all_ready and all((outdir / f"rank{r}.ready").exists() for r in range(world_size)):
                # A few seconds of grace so a rank's own collective timeout can report first.
                all_ready, deadline = True, now + timeout + 5.0
            collect()
            # A rank that failed leaves its peers blocked in collectives: give them a moment, then stop.
            if failed_at is None and (
                any(p.exitcode not in (None, 0) for p in procs) or any("error" in o for o in outcomes.values())
            ):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > 2.0):
                break
            time.sleep(0.02)
    finally:
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                processes.kill_marked(None, p.pid)  # whatever the rank started (a data worker, say) first
                p.kill()
        for p in procs:
            p.join(timeout=30)
    collect()
    return outcomes, hung


def _results_or_raise(outcomes: dict[int, dict], hung: list[int], procs: list, timeout: float) -> list:
    """Every rank's result in rank order, or one LaunchError naming the rank that failed first."""
    world_size = len(procs)
    errors = {r: o["error"] for r, o in outcomes.items() if "error" in o}
    hang_note = (
        f"ranks {hung} of {world_size} were still running after {timeout:.0f} s and were killed; "
        "a hang usually means the ranks issued different collectives (order, count or shape)"
    )
    if errors:
        first = min(errors, key=lambda r: outcomes[r]["failed_at"])
        echoes = "".join(f"\n  rank {r}: {errors[r].strip().splitlines()[-1]}" for r in sorted(errors) if r != first)
        raise LaunchError(
            f"rank {first} of {world_size} raised first:\n{errors[first]}"
            + (f"\nthen, probably as a consequence:{echoes}" if echoes else "")
            + (f"\n{hang_note}" if hung else "")
        )
    if hung:
        raise LaunchError(hang_note)
    missing = [r for r in range(world_size) if r not in outcomes]
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise LaunchError(f"ranks {missing} died without reporting (exit codes {codes})")
    if "nccl_calls" in outcomes[0]:
        problems = nccl_rules.check([outcomes[r]["nccl_calls"] for r in range(world_size)])
        if problems:
            raise LaunchError(
                "every rank returned on gloo, but NCCL could not have run this communication "
                "(scalebook.comm.nccl_rules; launch(..., check_nccl=False) opts out):\n  " + "\n  ".join(problems)
            )
    return [outcomes[r]["result"] for r in range(world_size)]
