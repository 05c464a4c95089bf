"""Chapter 10's experiments on the book's data parallelism: training runs, timelines, step times, predictions.

The library (:mod:`scalebook.parallel.ddp`) holds the three wrappers a training run uses. Here they run on
the ranks of a launch (:func:`scalebook.comm.launch`) next to torch's ``DistributedDataParallel`` and one
process without communication, all through one loop (:class:`DataParallelRun`):

* :func:`train_data_parallel` trains one setup and reports its losses, step times, collective calls and
  bytes (:func:`scalebook.comm.traffic.count_traffic`), each all-reduce's launch and completion
  (:class:`Span`, recorded by one communication hook, :func:`probed_allreduce_hook`, that serves torch DDP
  and the book's versions alike) and its buckets; or, with ``comm_hook="fp16"``, averages in 16 bits
  through a compression hook (torch's ``fp16_compress_hook`` on torch DDP, the book's on its versions);
* :func:`compare_step_times` times several setups side by side, one step of each in turn;
* :func:`gradient_copies` measures the bytes that gradients and buckets hold, with and without
  ``gradient_as_bucket_view``, in the book's versions 2 and 3 and in torch DDP;
* :func:`hidden_communication` measures how much of the all-reduce time a timeline hides behind backward;
* :func:`predicted_step_time` predicts a step on GPUs with the alpha-beta model;
* :func:`run_experiments` runs many of them in one launch (starting ranks is the slow part of a demo).

Source: Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training"
(VLDB), Sec. 3.2 and 5 (bucket sizes, overlap); PyTorch documentation, "DDP Communication Hooks".
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from scalebook.accounting.comm import alpha_beta_time
from scalebook.accounting.flops import training_flops_with_attention
from scalebook.accounting.params import param_count
from scalebook.comm.collectives import ALL_REDUCES
from scalebook.comm.traffic import count_traffic
from scalebook.configs import ModelConfig
from scalebook.data import corpus_tokens, get_batch
from scalebook.measure import tensor_bytes
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.ddp import (
    DEFAULT_BUCKET_CAP_MB,
    MIB,
    AllReduceDDP,
    BucketedDDP,
    OverlappedDDP,
    compress_hook,
)
from scalebook.train import TrainConfig, lr_at, make_optimizer

VERSIONS = {"allreduce": AllReduceDDP, "bucketed": BucketedDDP, "overlapped": OverlappedDDP}
# Two references run through the same loop: PyTorch's own DDP, and one process without any communication.
REFERENCES = ("torch", "single")
# Averaging in 16 bits (communication hooks that halve the bytes): the dtype each one sends.
COMM_HOOKS = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Span:
    """An interval of one rank's wall-clock time in ``time.perf_counter`` seconds.

    On Linux that clock is the system-wide monotonic clock, so spans of ranks on one machine share an axis.
    """

    kind: str  # "forward", "backward" (to its last gradient), "sync" (the wait that ends it), "optimizer", "all-reduce"
    start: float
    end: float = math.nan  # an asynchronous all-reduce fills it in when it completes
    detail: str = ""


def done_future(value) -> torch.futures.Future:
    """A future that has already completed with ``value`` (what a blocking all-reduce hands back)."""
    future = torch.futures.Future()
    future.set_result(value)
    return future


@dataclass
class CommProbe:
    """What the communication hook saw of a data-parallel backward: its buckets and their all-reduces."""

    names: dict[int, str]  # id(parameter) -> name
    spans: list[Span] = field(default_factory=list)
    buckets: dict[int, list[str]] = field(default_factory=dict)  # bucket index -> parameter names
    all_reduce: Callable | None = None  # a blocking from-scratch all-reduce instead of dist.all_reduce


def probed_allreduce_hook(probe: CommProbe, bucket):
    """DDP's default all-reduce hook, issued from Python so that ``count_traffic`` and the probe see it.

    ``bucket`` is torch's ``GradBucket`` or the book's :class:`scalebook.parallel.ddp.GradBucket` (the same
    methods), so one hook probes torch DDP and the book's versions alike; it returns the future of the
    averaged buffer.
    (No annotations: ``register_comm_hook`` compares them with the real types, and this module's are strings.)
    """
    probe.buckets[bucket.index()] = [probe.names[id(p)] for p in bucket.parameters()]
    span = Span("all-reduce", time.perf_counter(), detail=f"bucket {bucket.index()}")
    probe.spans.append(span)
    tensor = bucket.buffer().div_(dist.get_world_size())
    if probe.all_reduce is not None:
        probe.all_reduce(tensor, None)
        span.end = time.perf_counter()
        return done_future(tensor)

    def done(future):
        span.end = time.perf_counter()
        return future.value()[0]

    return dist.all_reduce(tensor, async_op=True).get_future().then(done)


class DataParallelRun:
    """One rank's replica in a training run: the model, its data-parallel wrapper, optimizer and data.

    ``version`` is one of ``VERSIONS``, ``"torch"`` (``DistributedDataParallel``) or ``"single"`` (one
    process training on the whole global batch, no communication). The model is a
    :class:`scalebook.model.GPT` in ``dtype``, trained on ``tokens`` (the default corpus, byte-level, if
    None). Each replica is initialised from a different seed (``seed + rank``): only the broadcast from
    rank 0 makes them equal. With ``probe``, all-reduces are recorded as :class:`Span` objects by the
    communication hook :func:`probed_allreduce_hook`, registered on torch DDP and the book's versions
    alike. ``all_reduce`` is ``"library"`` (``dist.all_reduce``) or one of the from-scratch all-reduces of
    :mod:`scalebook.comm.collectives` (``"ring"``, ``"tree"``, ``"naive"``), for every version. With
    ``record_grads``, each step keeps in ``grads`` the gradients the optimizer receives, before clipping.
    ``comm_hook`` (``"fp16"`` or ``"bf16"``) averages in 16 bits instead of probing: torch DDP gets torch's
    ``fp16_compress_hook`` (torch refuses its bf16 hook without CUDA and NCCL), the book's versions
    :func:`scalebook.parallel.ddp.compress_hook`, over the chosen ``all_reduce``.
    ``gradient_as_bucket_view`` is passed to torch DDP and the book's versions 2 and 3 (version 1 has no buckets).
    """

    def __init__(
        self,
        version: str,
        model_config: GPTConfig,
        train_config: TrainConfig,
        *,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        tokens: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        probe: bool = False,
        all_reduce: str = "library",
        record_grads: bool = False,
        comm_hook: str | None = None,
        gradient_as_bucket_view: bool = False,
    ):
        if gradient_as_bucket_view and version in ("allreduce", "single"):
            raise ValueError(f"gradient_as_bucket_view needs buckets: version {version!r} has none")
        if comm_hook is not None and comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook must be None or one of {sorted(COMM_HOOKS)}, got {comm_hook!r}")
        if comm_hook is not None and version == "single":
            raise ValueError("comm_hook needs a data-parallel version: one process has nothing to communicate")
        if comm_hook is not None and version == "torch" and (comm_hook != "fp16" or all_reduce != "library"):
            raise ValueError(
                "torch DDP runs torch's fp16_compress_hook over dist.all_reduce only (its bf16 hook "
                "needs CUDA and NCCL); use one of the book's versions for bf16 or a from-scratch all_reduce"
            )
        if version not in (*VERSIONS, *REFERENCES):
            raise ValueError(f"version must be one of {(*VERSIONS, *REFERENCES)}, got {version!r}")
        if all_reduce != "library" and all_reduce not in ALL_REDUCES:
            raise ValueError(f"all_reduce must be 'library' or one of {sorted(ALL_REDUCES)}, got {all_reduce!r}")
        if train_config.seq_len > model_config.block_size:
            raise ValueError(f"seq_len {train_config.seq_len} exceeds block_size {model_config.block_size}")
        if version != "single" and not dist.is_initialized():
            raise ValueError(f"version {version!r} needs a process group: run it under scalebook.comm.launch")
        self.version, self.cfg = version, train_config
        self.rank, self.world_size = (0, 1) if version == "single" else (dist.get_rank(), dist.get_world_size())
        self.tokens = corpus_tokens() if tokens is None else tokens
        torch.manual_seed(train_config.seed + self.rank)
        self.model = GPT(model_config).to(dtype)
        self.spans: list[Span] = []
        self.probe = None
        self.record_grads, self.grads = record_grads, {}
        # GPT's only buffers are its constant causal masks: no per-forward broadcast, in ours or in torch's.
        if version == "torch":
            self.wrapped = DistributedDataParallel(self.model, bucket_cap_mb=bucket_cap_mb, forward_sync_buffers=False,
                                                   gradient_as_bucket_view=gradient_as_bucket_view)  # fmt: skip
        elif version == "single":
            self.wrapped = self.model
        else:
            kwargs = {} if version == "allreduce" else {"bucket_cap_mb": bucket_cap_mb,
                                                        "gradient_as_bucket_view": gradient_as_bucket_view}  # fmt: skip
            self.wrapped = VERSIONS[version](self.model, forward_sync_buffers=False, **kwargs)
        from_scratch = ALL_REDUCES.get(all_reduce)  # None: the library's dist.all_reduce
        if comm_hook is not None:  # no probe: the hook does the averaging (and count_traffic still sees it)
            hook = (
                default_hooks.fp16_compress_hook
                if version == "torch"
                else functools.partial(compress_hook, COMM_HOOKS[comm_hook], all_reduce=from_scratch)
            )
            self.wrapped.register_comm_hook(None, hook)
        elif version != "single" and (probe or from_scratch is not None):
            self.probe = CommProbe({id(p): n for n, p in self.model.named_parameters()}, self.spans,
                                   all_reduce=from_scratch)  # fmt: skip
            self.wrapped.register_comm_hook(self.probe, probed_allreduce_hook)
        # The moment the last gradient of a backward pass is ready: what follows inside backward() is the wait
        # for the all-reduces (ours and torch DDP's alike average before backward() returns).
        self.last_gradient = math.nan
        if self.probe is not None:
            for p in self.model.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._gradient_ready)
        self.optimizer = make_optimizer(self.model, train_config)
        # The same seed on every rank: all draw the same global batch and keep their own rows of it.
        self.generator = torch.Generator().manual_seed(train_config.seed)

    def _gradient_ready(self, p) -> None:
        self.last_gradient = time.perf_counter()

    @contextlib.contextmanager
    def _timed(self, kind: str):
        start = time.perf_counter()
        yield
        self.spans.append(Span(kind, start, time.perf_counter()))

    def step(self, step: int) -> float:
        """One optimizer step over ``grad_accum`` micro-batches; returns this rank's mean loss."""
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = get_batch(
            self.tokens,
            cfg.batch_size * cfg.grad_accum,
            cfg.seq_len,
            self.generator,
            rank=self.rank,
            world_size=self.world_size,
        )
        self.spans.clear()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for i, (xb, yb) in enumerate(zip(x.chunk(cfg.grad_accum), y.chunk(cfg.grad_accum), strict=True)):
            local = i < cfg.grad_accum - 1 and self.version != "single"
            with self.wrapped.no_sync() if local else contextlib.nullcontext():
                with self._timed("forward"):
                    _, loss = self.wrapped(xb, yb)
                with self._timed("backward"):
                    (loss / cfg.grad_accum).backward()
                backward = self.spans[-1]
                if backward.start < self.last_gradient < backward.end:  # split off the wait at its end
                    self.spans.append(Span("sync", self.last_gradient, backward.end))
                    backward.end = self.last_gradient
            loss_sum += loss.item()
        if self.record_grads:  # the averaged gradient, before clipping and the optimizer change anything
            self.grads = {name: p.grad.detach().clone() for name, p in self.model.named_parameters()}
        with self._timed("optimizer"):
            if cfg.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.optimizer.step()
        return loss_sum / cfg.grad_accum

    def buckets(self) -> list[list[str]] | None:
        """Parameter names of each bucket (one per parameter for version 1), in launch order; None
        without a probe."""
        if self.probe is not None:
            return [self.probe.buckets[i] for i in sorted(self.probe.buckets)]
        return None


def train_data_parallel(
    version: str,
    model_config: GPTConfig,
    train_config: TrainConfig,
    *,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    tokens: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    keep_params: bool = False,
    keep_grads: bool = False,
    all_reduce: str = "library",
    comm_hook: str | None = None,
) -> dict:
    """Train one :class:`DataParallelRun` for ``train_config.steps`` steps on this rank and report it.

    Each rank takes ``batch_size * grad_accum`` sequences per step, so the global batch is that times the
    world size. Returns ``losses`` (the global mean loss of each step), ``step_times`` (s), the collective
    ``calls`` and ``bytes_sent`` of each step (counted by :func:`scalebook.comm.traffic.count_traffic`; for
    ``"torch"`` through a communication hook), the last step's ``spans`` and ``buckets``, and, with
    ``keep_params``, the final ``params``; with ``keep_grads``, the ``grads`` of the first step as the
    optimizer receives them (averaged over ranks, not yet clipped). ``tokens``, ``dtype`` and ``all_reduce``
    are as in :class:`DataParallelRun`. With a from-scratch ``all_reduce`` (say ``"ring"``) the bytes are
    counted at its ``isend`` calls, so they are measured (and ``calls`` counts its ``isend``/``irecv``
    calls); with the library's, ``count_traffic`` can only charge each call the ring algorithm's bytes.
    With ``comm_hook`` (see :class:`DataParallelRun`) no spans or buckets are recorded.
    """
    run = DataParallelRun(
        version, model_config, train_config, bucket_cap_mb=bucket_cap_mb, tokens=tokens, dtype=dtype, probe=True,
        all_reduce=all_reduce, record_grads=keep_grads, comm_hook=comm_hook,
    )  # fmt: skip
    first_grads = None
    losses, step_times, calls, bytes_sent = [], [], [], []
    for step in range(train_config.steps):
        with count_traffic() as traffic:
            start = time.perf_counter()
            losses.append(run.step(step))
            step_times.append(time.perf_counter() - start)
        calls.append(traffic.count())
        bytes_sent.append(traffic.bytes_sent())
        if keep_grads and first_grads is None:
            first_grads = run.grads
    mean_losses = torch.tensor(losses, dtype=torch.float64)
    if version != "single":  # one more collective, after counting: the logged loss is the global mean
        dist.all_reduce(mean_losses)
        mean_losses /= run.world_size
    result = {
        "losses": mean_losses.tolist(),
        "step_times": step_times,
        "calls": calls,
        "bytes_sent": bytes_sent,
        "spans": list(run.spans),
        "buckets": run.buckets(),
    }
    if keep_grads:
        result["grads"] = first_grads
    if keep_params:
        result["params"] = {name: p.detach().clone() for name, p in run.model.named_parameters()}
    return result


def compare_step_times(setups: dict[str, dict], model_config: GPTConfig, train_config: TrainConfig) -> dict:
    """Step times (s) of several setups trained side by side on this rank, one step of each in turn.

    ``setups[label]`` holds :class:`DataParallelRun` arguments (``version``, ``bucket_cap_mb``, and
    optionally its own ``train_config`` with the same number of steps). Interleaving the steps, in an
    order that rotates from step to step, exposes every setup to the same background load of a shared
    machine. Returns ``{label: [seconds of step 0, step 1, ...]}``; step 0 pays one-off costs.
    """
    if any(kwargs.get("train_config", train_config).steps != train_config.steps for kwargs in setups.values()):
        raise ValueError("every setup must train for the same number of steps as train_config")
    runs = {
        label: DataParallelRun(**{"model_config": model_config, "train_config": train_config, **kwargs})
        for label, kwargs in setups.items()
    }
    labels = list(runs)
    times = {label: [] for label in labels}
    for step in range(train_config.steps):
        shift = step % len(labels)
        for label in labels[shift:] + labels[:shift]:  # the same collectives in the same order on every rank
            start = time.perf_counter()
            runs[label].step(step)
            times[label].append(time.perf_counter() - start)
    return times


def gradient_bytes_held(run: DataParallelRun) -> dict:
    """What ``run``'s gradients and DDP buckets hold once ``backward()`` has returned.

    ``held``: bytes of the storages behind every ``.grad`` and every bucket, each storage once
    (:func:`scalebook.measure.tensor_bytes`); ``grad_bytes``: those behind ``.grad`` alone; ``storages``: the
    parameter names whose ``.grad`` share one storage. The book's buckets are ``run.wrapped.buckets``; torch
    DDP's reducer keeps its buckets in C++, so their bytes come from its own log (``bucket_sizes``), counted
    apart from ``.grad`` unless ``gradient_as_bucket_view`` is on, where ``.grad``'s storages are the buckets
    (the bytes must then be equal, which is checked).
    """
    named = [(name, p) for name, p in run.model.named_parameters() if p.grad is not None]
    grads = tensor_bytes(p.grad for _, p in named)
    storages: dict[int, list[str]] = {}
    for name, p in named:
        storages.setdefault(p.grad.untyped_storage().data_ptr(), []).append(name)
    if run.version == "torch":
        log = run.wrapped._get_ddp_logging_data()
        bucket_bytes = sum(int(size) for size in str(log["bucket_sizes"]).split(","))
        if log["gradient_as_bucket_view"]:
            if bucket_bytes != grads:
                raise RuntimeError(f"torch DDP's buckets hold {bucket_bytes} bytes, its .grad views {grads}")
            held = grads
        else:
            held = grads + bucket_bytes
    else:
        held = tensor_bytes([*(p.grad for _, p in named), *(bucket.buffer for bucket in run.wrapped.buckets)])
    return {"held": held, "grad_bytes": grads, "storages": list(storages.values())}


def gradient_copies(model_config: GPTConfig, train_config: TrainConfig, *, bucket_cap_mb: float) -> dict:
    """Versions 2 and 3 and torch DDP, each with ``gradient_as_bucket_view`` off and on, trained side by side
    for ``train_config.steps`` steps; for each (``"<version> view"`` or ``"<version> copy"``), the bytes held
    after the last backward (:func:`gradient_bytes_held`) and the averaged gradients the optimizer received."""
    result = {}
    for version in ("bucketed", "overlapped", "torch"):
        for view in (False, True):
            run = DataParallelRun(version, model_config, train_config, bucket_cap_mb=bucket_cap_mb,
                                  record_grads=True, gradient_as_bucket_view=view)  # fmt: skip
            for step in range(train_config.steps):
                run.step(step)
            result[f"{version} {'view' if view else 'copy'}"] = {**gradient_bytes_held(run), "grads": run.grads,
                                                                  "n_params": run.model.num_parameters()}  # fmt: skip
    return result


def run_experiments(**experiments: tuple[Callable, dict]) -> dict:
    """Run ``name=(function, kwargs)`` experiments in order on this rank: one launch, many results.

    Starting ranks is the slow part of a small demo (seconds each), so a chapter launches once and runs
    everything it needs inside that launch.
    """
    return {name: function(**kwargs) for name, (function, kwargs) in experiments.items()}


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def hidden_communication(spans: list[Span]) -> float:
    """The share of a step's all-reduce time (the union of the all-reduce spans) that runs while
    backward computes: 0 when communication starts after backward, 1 when backward covers all of it."""
    comm = _merged([(s.start, s.end) for s in spans if s.kind == "all-reduce"])
    backward = _merged([(s.start, s.end) for s in spans if s.kind == "backward"])
    total = sum(end - start for start, end in comm)
    if total == 0:
        raise ValueError("these spans hold no all-reduce: record a step of a data-parallel run")
    covered = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in comm for s2, e2 in backward)
    return covered / total


def predicted_step_time(
    model: ModelConfig,
    tokens_per_rank: int,
    ranks: int,
    *,
    seq_len: int,
    peak_flops: float,
    mfu: float,
    bandwidth: float,
    alpha: float,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    grad_bytes: int = 4,
) -> dict[str, float]:
    """Seconds of one data-parallel step by the alpha-beta model: ``compute``, ``comm``, and the step
    ``serial`` (all-reduces after backward) and ``overlapped`` (each bucket's all-reduce launched as soon
    as backward has produced it, as in :class:`~scalebook.parallel.ddp.OverlappedDDP`).

        compute    = F(tokens_per_rank) / (mfu * peak_flops)       forward 1/3 of it, backward 2/3
        comm       = k c,  c = T_ring-all-reduce(M / k),  M = grad_bytes * params,  k = ceil(M / bucket cap)
        serial     = compute + comm
        overlapped = compute / 3 + max(2 compute / 3 + c,  2 compute / (3 k) + comm)

    The overlapped time assumes ``k`` equal buckets that backward completes at an even pace, one every
    ``2 compute / (3 k)``, and all-reduces that run one at a time, each starting when its bucket is complete
    and the previous all-reduce is done. The step ends with the last all-reduce. Either backward is the
    bottleneck: then the last bucket, complete only when backward ends, is still all-reduced after it, so
    at least ``c`` is always exposed; or the link is: then all-reduces run back to back from the moment
    the first bucket is complete. With one bucket (``k = 1``) nothing overlaps and the step is ``serial``.
    """
    if ranks < 1 or tokens_per_rank < 1:
        raise ValueError(f"ranks and tokens_per_rank must be >= 1, got {ranks} and {tokens_per_rank}")
    compute = training_flops_with_attention(model, tokens_per_rank, seq_len=seq_len) / (mfu * peak_flops)
    grad_message = grad_bytes * param_count(model)
    n_buckets = math.ceil(grad_message / (bucket_cap_mb * MIB))
    per_bucket = alpha_beta_time("all_reduce", grad_message / n_buckets, ranks, alpha=alpha, bandwidth=bandwidth)
    comm = n_buckets * per_bucket
    backward = 2 * compute / 3
    # Bucket i (0-based) is complete at compute/3 + (i+1) backward/k; the all-reduces end at
    # compute/3 + max_i ((i+1) backward/k + (k-i) c), linear in i, so the first or the last bucket decides.
    return {
        "compute": compute,
        "comm": comm,
        "serial": compute + comm,
        "overlapped": compute / 3 + max(backward + per_bucket, backward / n_buckets + comm),
    }
