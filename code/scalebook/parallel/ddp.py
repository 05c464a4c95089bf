"""Data parallelism from scratch: replicate the model, split the batch, average the gradients.

Every rank holds the whole model, runs forward and backward on its own B/N sequences of the global batch
of B, and the ranks average their gradients before each optimizer step,

    g = (1/N) sum_r g_r      (g_r: rank r's mean gradient over its B/N sequences),

which is the mean gradient over all B sequences: every replica takes the step one process would take on
the whole batch, and the replicas stay identical. Three versions, each one change away from the last:

* :class:`AllReduceDDP`: after backward, all-reduce each parameter's gradient on its own. One collective
  per parameter tensor, many of them tiny, each paying the full start-up latency.
* :class:`BucketedDDP`: after backward, copy the gradients into flat buckets of about ``bucket_cap_mb``
  MiB (PyTorch's default is 25), filled in reverse order of definition, and all-reduce each bucket.
  The same bytes in a handful of calls.
* :class:`OverlappedDDP`: as soon as the last gradient of a bucket has been accumulated (a
  ``register_post_accumulate_grad_hook`` tells us), start that bucket's all-reduce asynchronously, so the
  network works while backward is still computing the gradients of earlier layers.
  :meth:`~OverlappedDDP.sync_gradients` waits for them before the optimizer step.

All three start every replica from rank 0's weights (a broadcast, as torch DDP does at construction) and
offer ``no_sync()`` for gradient accumulation. One training loop drives them all, and torch's
``DistributedDataParallel``, which synchronises inside the last backward by itself::

    for i, (x, y) in enumerate(micro_batches):
        with model.no_sync() if i < len(micro_batches) - 1 else nullcontext():
            (model(x, y)[1] / len(micro_batches)).backward()
    model.sync_gradients()
    optimizer.step()

The second half of the module runs the chapter's experiments on the ranks of a launch
(:func:`train_data_parallel`, :func:`compare_step_times`, :func:`run_experiments`) and predicts a step's
time on GPUs with the alpha-beta model (:func:`predicted_step_time`).

Source: Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training"
(VLDB), Sec. 3.2 (bucketing, overlap, no_sync); PyTorch documentation, "DistributedDataParallel" and
"DDP Communication Hooks"; Tazi et al. 2025, "The Ultra-Scale Playbook", data parallelism.
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
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from scalebook.accounting.comm import alpha_beta_time
from scalebook.accounting.flops import training_flops_with_attention
from scalebook.accounting.params import param_count
from scalebook.configs import ModelConfig
from scalebook.data import default_corpus, get_batch, tokenize
from scalebook.comm.collectives import ALL_REDUCES
from scalebook.comm.traffic import count_traffic
from scalebook.model import GPT, GPTConfig
from scalebook.train import TrainConfig, lr_at, make_optimizer

MIB = 1024 * 1024  # torch DDP's bucket_cap_mb counts mebibytes
DEFAULT_BUCKET_CAP_MB = 25.0


@dataclass
class Span:
    """An interval of one rank's wall-clock time in ``time.perf_counter`` seconds.

    On Linux that clock is the system-wide monotonic clock, so spans of ranks on one machine share an axis.
    """

    kind: str  # "forward", "backward", "sync", "optimizer" or "all-reduce"
    start: float
    end: float = math.nan  # an asynchronous all-reduce fills it in when it completes
    detail: str = ""


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module, process_group=None) -> None:
    """Overwrite every parameter and buffer with rank 0's copy, so that all replicas start equal.

    The tensors travel flattened into one message per dtype, paying the latency once rather than once per
    tensor (torch DDP coalesces them the same way, in messages of up to 250 MiB).
    """
    tensors = [*module.parameters(), *module.buffers()]
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        same_dtype = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same_dtype])
        dist.broadcast(flat, group_src=0, group=process_group)
        offset = 0
        for t in same_dtype:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


class DataParallel(nn.Module):
    """What the three versions share: hold the module, broadcast rank 0's weights, ``no_sync()``.

    ``all_reduce`` is the collective that sums the gradients: ``None`` for the library's
    ``dist.all_reduce``, or a from-scratch one such as ``scalebook.comm.collectives.ring_all_reduce``
    (called as ``all_reduce(tensor, group)``, blocking), whose every ``isend`` ``count_traffic`` sees.
    """

    def __init__(self, module: nn.Module, process_group=None, *, all_reduce: Callable | None = None):
        if not dist.is_initialized():
            raise ValueError(
                "no process group: run under scalebook.comm.launch or torchrun, after dist.init_process_group"
            )
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError("the module has no parameter that requires a gradient: there is nothing to average")
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.all_reduce = all_reduce
        self.world_size = dist.get_world_size(process_group)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.names = {p: name for name, p in module.named_parameters()}
        self.require_backward_grad_sync = True
        self.spans: list[Span] | None = None  # a list here records every all-reduce's launch and completion
        broadcast_from_rank0(module, process_group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this block keep their gradients local; they add up in ``.grad``."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def sync_gradients(self) -> None:
        """Leave every replica's ``.grad`` holding the mean over ranks. Call it before ``optimizer.step()``."""
        raise NotImplementedError

    def _grad(self, p: nn.Parameter) -> torch.Tensor:
        if p.grad is None:
            raise RuntimeError(
                f"parameter {self.names[p]} got no gradient: this implementation assumes every parameter is "
                "used in every step (torch DDP handles unused ones with find_unused_parameters=True)"
            )
        return p.grad

    def _all_reduce(self, tensor: torch.Tensor, detail: str, *, async_op: bool = False):
        """Sum ``tensor`` over the ranks in place; with ``async_op`` return at once with the work handle.

        A from-scratch ``all_reduce`` is blocking: it has finished on return, and its handle is a done future.
        """
        span = Span("all-reduce", time.perf_counter(), detail=detail)
        if self.all_reduce is not None:
            self.all_reduce(tensor, self.process_group)
            work, async_op = done_future(tensor), False
        else:
            work = dist.all_reduce(tensor, group=self.process_group, async_op=async_op)
        if self.spans is not None:
            self.spans.append(span)
            if async_op:
                work.get_future().add_done_callback(lambda _: setattr(span, "end", time.perf_counter()))
            else:
                span.end = time.perf_counter()
        return work


def done_future(value) -> torch.futures.Future:
    """A future that has already completed with ``value`` (what a blocking all-reduce hands back)."""
    future = torch.futures.Future()
    future.set_result(value)
    return future


class AllReduceDDP(DataParallel):
    """Version 1: after backward, all-reduce every parameter's gradient, one collective each."""

    def sync_gradients(self) -> None:
        """All-reduce each parameter's gradient in place, divided by the number of ranks."""
        # Gradients accumulate locally until this call, so no_sync() has nothing to switch off here.
        for p in reversed(self.params):  # any order works, as long as every rank uses the same one
            grad = self._grad(p)
            grad.div_(self.world_size)  # divide first (as torch DDP does): a sum of means cannot overflow
            self._all_reduce(grad, self.names[p])


def assign_buckets(params: list[nn.Parameter], bucket_cap_bytes: int) -> list[list[nn.Parameter]]:
    """Group parameters into buckets, last-defined first, closing a bucket once it holds ``bucket_cap_bytes``.

    Backward produces gradients roughly in the reverse of the order the layers were defined, so the first
    bucket is the first to be complete. As in torch DDP, a bucket may pass the cap by its last tensor.
    """
    buckets, current, size = [], [], 0
    for p in reversed(params):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_cap_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


class Bucket:
    """The gradients of a few parameters, back to back in one flat buffer that one collective reduces."""

    def __init__(self, index: int, params: list[nn.Parameter]):
        self.index = index
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.views, offset = {}, 0  # each parameter's slice of the buffer, shaped like the parameter
        for p in params:
            self.views[p] = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ready = 0  # gradients of this backward copied in so far (OverlappedDDP)
        self.work = None  # its all-reduce while in flight (OverlappedDDP)

    def unpack(self) -> None:
        """Copy each parameter's slice of the (reduced) buffer back into its ``.grad``."""
        for p in self.params:
            p.grad.copy_(self.views[p])


class BucketedDDP(DataParallel):
    """Version 2: after backward, copy the gradients into buckets and all-reduce bucket by bucket."""

    def __init__(
        self,
        module: nn.Module,
        process_group=None,
        *,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        all_reduce: Callable | None = None,
    ):
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ValueError(
                f"bucket_cap_mb must be a positive number of MiB (torch's default is 25), got {bucket_cap_mb!r}"
            )
        kinds = {(p.dtype, p.device) for p in module.parameters() if p.requires_grad}
        if len(kinds) > 1:
            raise ValueError(
                f"parameters of several dtypes/devices {sorted(map(str, kinds))} cannot share a "
                "flat bucket; move the model to one device and dtype first"
            )
        super().__init__(module, process_group, all_reduce=all_reduce)
        self.buckets = [Bucket(i, ps) for i, ps in enumerate(assign_buckets(self.params, int(bucket_cap_mb * MIB)))]

    def sync_gradients(self) -> None:
        """Copy the gradients into the buckets, all-reduce each bucket, copy the means back into ``.grad``."""
        for bucket in self.buckets:
            for p in bucket.params:
                bucket.views[p].copy_(self._grad(p))
            bucket.buffer.div_(self.world_size)
            self._all_reduce(bucket.buffer, f"bucket {bucket.index}")
            bucket.unpack()


class OverlappedDDP(BucketedDDP):
    """Version 3: each bucket's all-reduce starts during backward, the moment its last gradient is ready."""

    def __init__(
        self,
        module: nn.Module,
        process_group=None,
        *,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        all_reduce: Callable | None = None,
    ):
        super().__init__(module, process_group, bucket_cap_mb=bucket_cap_mb, all_reduce=all_reduce)
        self.bucket_of = {p: bucket for bucket in self.buckets for p in bucket.params}
        self.next_bucket = 0  # buckets launch in index order on every rank, so the collectives match up
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def _gradient_ready(self, p: nn.Parameter) -> None:
        """Autograd calls this once ``p.grad`` holds the gradient of the current backward pass."""
        if not self.require_backward_grad_sync:
            return  # accumulating: the gradient waits in p.grad for the last micro-batch
        bucket = self.bucket_of[p]
        bucket.views[p].copy_(p.grad)
        bucket.ready += 1
        # A bucket that completes early waits for its predecessors: all ranks must issue the same
        # collectives in the same order, whatever order their gradients happen to arrive in.
        while self.next_bucket < len(self.buckets):
            bucket = self.buckets[self.next_bucket]
            if bucket.ready < len(bucket.params):
                break
            bucket.buffer.div_(self.world_size)
            bucket.work = self._all_reduce(bucket.buffer, f"bucket {bucket.index}", async_op=True)
            self.next_bucket += 1

    def sync_gradients(self) -> None:
        """Wait for the all-reduces that backward started, then copy the means back into ``.grad``."""
        if self.next_bucket < len(self.buckets):
            raise RuntimeError(
                f"only {self.next_bucket} of {len(self.buckets)} buckets were sent: call sync_gradients() once, "
                "after a backward pass outside no_sync()"
            )
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.unpack()
            bucket.ready, bucket.work = 0, None
        self.next_bucket = 0


VERSIONS = {"allreduce": AllReduceDDP, "bucketed": BucketedDDP, "overlapped": OverlappedDDP}
# Two references run through the same loop: PyTorch's own DDP, and one process without any communication.
REFERENCES = ("torch", "single")


# ----- Experiments: run on every rank of a launch (scalebook.comm.launch) ---------------------------------


@dataclass
class TorchDDPProbe:
    """What the communication hook saw of torch DDP's last backward: its buckets and their all-reduces."""

    names: dict[int, str]  # id(parameter) -> name
    spans: list[Span] = field(default_factory=list)
    buckets: dict[int, list[str]] = field(default_factory=dict)  # bucket index -> parameter names
    all_reduce: Callable | None = None  # a blocking from-scratch all-reduce instead of dist.all_reduce


def probed_allreduce_hook(probe: TorchDDPProbe, bucket):
    """torch DDP's default all-reduce hook, issued from Python so that ``count_traffic`` and the probe see it.

    ``bucket`` is a ``torch.distributed.GradBucket``; the function returns the future of the reduced buffer.
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


@functools.cache
def _corpus_tokens() -> torch.Tensor:
    return tokenize(default_corpus())


class DataParallelRun:
    """One rank's replica in a training run: the model, its data-parallel wrapper, optimizer and data.

    ``version`` is one of ``VERSIONS``, ``"torch"`` (``DistributedDataParallel``) or ``"single"`` (one
    process training on the whole global batch, no communication). The model is a :class:`scalebook.model.GPT` in
    ``dtype``, trained on ``tokens`` (the default corpus, byte-level, if None). Each replica is initialised
    from a different seed (``seed + rank``): only the broadcast from rank 0 makes them equal. With
    ``probe``, all-reduces are recorded as :class:`Span` objects (for torch DDP through
    :func:`probed_allreduce_hook`). ``all_reduce`` is ``"library"`` (``dist.all_reduce``) or one of the
    from-scratch all-reduces of :mod:`scalebook.comm.collectives` (``"ring"``, ``"tree"``, ``"naive"``), for
    every version. With ``record_grads``, each step keeps in ``grads`` the gradients the optimizer receives,
    before clipping.
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
    ):
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
        self.tokens = _corpus_tokens() if tokens is None else tokens
        torch.manual_seed(train_config.seed + self.rank)
        self.model = GPT(model_config).to(dtype)
        self.spans: list[Span] = []
        self.probe = None
        self.record_grads, self.grads = record_grads, {}
        from_scratch = ALL_REDUCES.get(all_reduce)  # None: the library's dist.all_reduce
        if version == "torch":
            self.wrapped = DistributedDataParallel(self.model, bucket_cap_mb=bucket_cap_mb)
            if probe or from_scratch is not None:
                self.probe = TorchDDPProbe({id(p): n for n, p in self.model.named_parameters()}, self.spans,
                                           all_reduce=from_scratch)  # fmt: skip
                self.wrapped.register_comm_hook(self.probe, probed_allreduce_hook)
        elif version == "single":
            self.wrapped = self.model
        else:
            kwargs = {} if version == "allreduce" else {"bucket_cap_mb": bucket_cap_mb}
            self.wrapped = VERSIONS[version](self.model, all_reduce=from_scratch, **kwargs)
            self.wrapped.spans = self.spans if probe else None
        self.optimizer = make_optimizer(self.model, train_config)
        # The same seed on every rank: all draw the same global batch and keep their own rows of it.
        self.generator = torch.Generator().manual_seed(train_config.seed)

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
            loss_sum += loss.item()
        if isinstance(self.wrapped, DataParallel):
            with self._timed("sync"):
                self.wrapped.sync_gradients()
        if self.record_grads:  # the averaged gradient, before clipping and the optimizer change anything
            self.grads = {name: p.grad.detach().clone() for name, p in self.model.named_parameters()}
        with self._timed("optimizer"):
            if cfg.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.optimizer.step()
        return loss_sum / cfg.grad_accum

    def buckets(self) -> list[list[str]] | None:
        """Parameter names of each bucket, in launch order (None for per-parameter or no communication)."""
        if isinstance(self.wrapped, BucketedDDP):
            return [[self.wrapped.names[p] for p in b.params] for b in self.wrapped.buckets]
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
    """
    run = DataParallelRun(
        version, model_config, train_config, bucket_cap_mb=bucket_cap_mb, tokens=tokens, dtype=dtype, probe=True,
        all_reduce=all_reduce, record_grads=keep_grads,
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


# ----- What the same step would cost on GPUs ---------------------------------------------------------------


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
    as backward has produced it, as in :class:`OverlappedDDP`).

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
