"""Data parallelism from scratch: replicate the model, split the batch, average the gradients.

Every rank holds the whole model, runs forward and backward on its own B/N sequences of the global batch
of B, and the ranks average their gradients before each optimizer step,

    g = (1/N) sum_r g_r      (g_r: rank r's mean gradient over its B/N sequences),

which is the mean gradient over all B sequences: every replica takes the step one process would take on
the whole batch, and the replicas stay identical. Three versions, each one change away from the last:

* :class:`AllReduceDDP`: at the end of backward, all-reduce each parameter's gradient on its own. One
  collective per parameter tensor, many of them tiny, each paying the full start-up latency.
* :class:`BucketedDDP`: at the end of backward, copy the gradients into flat buckets of about
  ``bucket_cap_mb`` MiB (PyTorch's default is 25), one set of buckets per (dtype, device), filled in
  reverse order of definition, and all-reduce each bucket. The same bytes in a handful of calls.
* :class:`OverlappedDDP`: as soon as the last gradient of a bucket has been accumulated, start that
  bucket's all-reduce asynchronously, so the network works while backward is still computing the
  gradients of earlier layers.

Versions 2 and 3 keep two copies of the gradients by default, as torch DDP does: ``.grad`` and the buckets
beside it, one more gradient-sized buffer per replica (4 bytes per parameter in fp32). With
``gradient_as_bucket_view=True`` (torch's option of that name) each ``.grad`` becomes a view of its slot in
its bucket, so autograd accumulates straight into the buckets and one copy remains. Version 1 reduces
``.grad`` in place and never had a second copy.

All three average **inside** ``loss.backward()``, as torch DDP and picotron do. A hook on each parameter
(``register_post_accumulate_grad_hook``) hears when its gradient is ready; the first such hook of a
backward pass queues a callback with the autograd engine
(``torch.autograd.Variable._execution_engine.queue_callback``), which the engine runs once, after the
last gradient of that backward pass and before ``backward()`` returns. The callback launches what is
left and waits for every all-reduce, so when ``backward()`` returns each replica's ``.grad`` holds the
mean over ranks, and a loop written for torch DDP runs unchanged::

    for i, (x, y) in enumerate(micro_batches):
        with model.no_sync() if i < len(micro_batches) - 1 else nullcontext():
            (model(x, y)[1] / len(micro_batches)).backward()
    optimizer.step()

Each wraps any ``nn.Module`` the way ``torch.nn.parallel.DistributedDataParallel`` does: it starts every
replica from rank 0's parameters and buffers (and, with ``forward_sync_buffers``, torch 2.13's name for
``broadcast_buffers``, re-broadcasts the buffers before each forward), skips frozen parameters, reduces
a parameter shared by two modules once, accepts parameters of several dtypes and devices, and offers
``no_sync()`` for gradient accumulation and ``register_comm_hook`` for a custom reduction
(:func:`fp16_compress_hook` and :func:`bf16_compress_hook` halve the bytes by averaging in 16 bits, as
torch's hooks of those names do). A parameter that gets no gradient on a rank (unused in its forward)
contributes zeros, so every rank still issues the same collectives in the same order; afterwards its
``.grad`` holds the average over ranks. With ``find_unused_parameters=True`` one more small all-reduce
finds the parameters no rank used, whose ``.grad`` then stays ``None``, as in torch DDP (an optimizer
skips them; a zero gradient would still decay them). ``sync_gradients()``, which older loops call
before the optimizer step, is still there: it averages what backward passes run entirely under
``no_sync()`` left behind (a pipeline schedule runs all its micro-batches that way) and otherwise does
nothing.

Chapter 10's experiments (timelines, step times, traffic) run these classes from
:mod:`scalebook.experiments.ddp`.

Source: Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training"
(VLDB), Sec. 3.2 (bucketing, overlap, no_sync); PyTorch documentation, "DistributedDataParallel" and
"DDP Communication Hooks" (``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``); picotron,
``picotron/data_parallel/data_parallel.py`` (``queue_callback`` from the first gradient hook); Tazi et al.
2025, "The Ultra-Scale Playbook", data parallelism.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

MIB = 1024 * 1024  # torch DDP's bucket_cap_mb counts mebibytes
DEFAULT_BUCKET_CAP_MB = 25.0


@torch.no_grad()
def broadcast_from_rank0(tensors: Iterable[torch.Tensor], process_group=None) -> None:
    """Overwrite every tensor with rank 0's copy (the group's first rank), so that all replicas agree.

    The tensors travel flattened into one message per dtype, paying the latency once rather than once per
    tensor (torch DDP coalesces them the same way, in messages of up to 250 MiB).
    """
    tensors = list(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        same_dtype = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same_dtype])
        dist.broadcast(flat, group_src=0, group=process_group)
        offset = 0
        for t in same_dtype:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


@dataclass
class GradBucket:
    """What a communication hook is handed: torch's ``GradBucket`` interface, so hooks written for torch
    DDP (``hook(state, bucket) -> Future[Tensor]``) run on the book's versions unchanged."""

    bucket_index: int
    flat: torch.Tensor  # this rank's gradients, back to back
    params: list[nn.Parameter]

    def index(self) -> int:
        return self.bucket_index

    def buffer(self) -> torch.Tensor:
        return self.flat

    def parameters(self) -> list[nn.Parameter]:
        return self.params


def compress_hook(dtype: torch.dtype, process_group, bucket, *, all_reduce: Callable | None = None):
    """Average ``bucket`` over the ranks in ``dtype``: cast, divide by the group size, all-reduce, copy back.

    torch's ``_compress_hook`` from scratch, the same operations in the same order (the cast first, then the
    division, in ``dtype``), so that it gives the same bits; the message has ``dtype``'s width, half of
    fp32's for fp16 and bf16. The result is written back into the bucket's buffer in its own dtype. Each
    element is rounded to ``dtype`` (relative error up to 2^-11 in fp16, 2^-8 in bf16), and again by each
    addition of the all-reduce. fp16's smallest subnormal is 2^-24: rounding to nearest, a magnitude up to
    2^-25 becomes 0 and one between 2^-25 and 2^-24 becomes 2^-24, in the cast and again after the division
    by the group size. ``process_group`` is the hook's state (None: the default group). ``all_reduce``, if given,
    is a blocking from-scratch sum ``all_reduce(tensor, group)`` such as
    ``scalebook.comm.collectives.ring_all_reduce``, used instead of ``dist.all_reduce``.
    (No annotations on the hook's arguments: torch's ``register_comm_hook`` compares them with its types.)
    """
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(dist.get_world_size(process_group))

    def decompress(total: torch.Tensor) -> torch.Tensor:
        return buffer.copy_(total)  # in place, as torch's hook: no second full-width buffer

    if all_reduce is not None:
        all_reduce(compressed, process_group)
        future = torch.futures.Future()
        future.set_result(decompress(compressed))
        return future
    work = dist.all_reduce(compressed, group=process_group, async_op=True)
    return work.get_future().then(lambda future: decompress(future.value()[0]))


def fp16_compress_hook(process_group, bucket):
    """A communication hook that all-reduces the bucket in fp16: torch's ``fp16_compress_hook``, from scratch
    (:func:`compress_hook`). Register it with ``model.register_comm_hook(process_group_or_None, hook)``."""
    return compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group, bucket):
    """A communication hook that all-reduces the bucket in bf16: torch's ``bf16_compress_hook``, from scratch
    (:func:`compress_hook`). torch's own refuses to register without CUDA and NCCL; gloo sums bf16, so this
    one also runs on CPU ranks."""
    return compress_hook(torch.bfloat16, process_group, bucket)


class DataParallel(nn.Module):
    """What the three versions share: hold the module, broadcast rank 0's state, ``no_sync()``, and average
    the gradients by the end of each backward pass.

    Assumes one backward pass at a time through the wrapped module, the same on every rank (the same
    collectives in the same order), and activation checkpointing, if any, without reentrant backward passes
    (``torch.utils.checkpoint(..., use_reentrant=False)``, as the book's GPT uses): a nested backward pass would
    run the end-of-backward callback too early. Each version defines ``_average`` (what the callback does) and
    may define ``_on_gradient`` (what it does with each gradient as soon as it is ready).
    """

    def __init__(
        self,
        module: nn.Module,
        process_group=None,
        *,
        forward_sync_buffers: bool = True,
        find_unused_parameters: bool = False,
    ):
        if not dist.is_initialized():
            raise ValueError(
                "no process group: run under scalebook.comm.launch or torchrun, after dist.init_process_group"
            )
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError("the module has no parameter that requires a gradient: there is nothing to average")
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.forward_sync_buffers = forward_sync_buffers
        self.find_unused_parameters = find_unused_parameters
        self.params = [p for p in module.parameters() if p.requires_grad]  # each shared Parameter once
        self.names = {p: name for name, p in module.named_parameters()}
        self.require_backward_grad_sync = True
        self.sync_buffers_next_forward = True  # torch's require_forward_param_sync
        self.comm_hook: tuple[object, Callable] | None = None
        self.callback_queued = False  # the end-of-backward callback of the running backward pass is queued
        self.unaveraged = False  # gradients accumulated under no_sync() that no backward pass has averaged yet
        broadcast_from_rank0([*module.parameters(), *module.buffers()], process_group)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def forward(self, *args, **kwargs):
        if self.callback_queued:  # the engine drops a backward pass's callbacks when that pass raises
            raise RuntimeError(
                "the previous backward pass through this wrapper raised before it ended: its gradients were never "
                "averaged and some of its all-reduces may be in flight. Build a new wrapper on every rank."
            )
        buffers = list(self.module.buffers())
        # As torch DDP: rank 0's buffers (say BatchNorm's running statistics) before each forward that
        # follows a synchronising one, so that every replica computes with the same state.
        if self.forward_sync_buffers and self.sync_buffers_next_forward and buffers:
            broadcast_from_rank0(buffers, self.process_group)
        output = self.module(*args, **kwargs)
        self.sync_buffers_next_forward = torch.is_grad_enabled() and self.require_backward_grad_sync
        return output

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this block keep their gradients local; they add up in ``.grad``, and the
        first backward pass outside it averages the sum."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Reduce with ``hook(state, bucket)`` instead of dividing by the world size and all-reducing.

        As in torch DDP, ``bucket`` offers ``index()``, ``buffer()`` and ``parameters()`` and the hook
        returns a ``torch.futures.Future`` of the averaged buffer. Register it before the first backward.
        """
        self.comm_hook = (state, hook)

    def sync_gradients(self) -> None:
        """Average what no backward pass has averaged: the gradients of backward passes run entirely under
        ``no_sync()`` (as a pipeline schedule runs its micro-batches). After a backward pass outside
        ``no_sync()`` there is nothing left to do, so calling it there, or twice, changes nothing. A loop
        written for torch DDP never needs it."""
        if self.unaveraged:
            self._average()
            self.unaveraged = False

    def _gradient_ready(self, p: nn.Parameter) -> None:
        """Autograd calls this once ``p.grad`` holds the gradient of the current backward pass (accumulated
        onto what ``.grad`` held before)."""
        if not self.require_backward_grad_sync:
            self.unaveraged = True  # accumulating: the gradient waits in p.grad for a later backward pass
            return
        if not self.callback_queued:
            # The first gradient of this backward pass: have the engine call _end_of_backward once, after the
            # last gradient of the pass and before backward() returns (the callback belongs to this pass).
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self.callback_queued = True
        self._on_gradient(p)

    def _on_gradient(self, p: nn.Parameter) -> None:
        """What a version does with a gradient as soon as it is ready (versions 1 and 2: nothing)."""

    def _end_of_backward(self) -> None:
        self.callback_queued = False
        self._average()
        self.unaveraged = False

    def _average(self) -> None:
        """Leave every replica's ``.grad`` holding the mean over ranks, waiting for every collective."""
        raise NotImplementedError

    def _reduce(self, index: int, flat: torch.Tensor, params: list[nn.Parameter]) -> torch.futures.Future:
        """Start averaging ``flat`` over the ranks; return the future of the averaged tensor."""
        if self.comm_hook is not None:
            state, hook = self.comm_hook
            return hook(state, GradBucket(index, flat, params))
        flat.div_(self.world_size)  # divide first (as torch DDP does): a sum of means cannot overflow
        work = dist.all_reduce(flat, group=self.process_group, async_op=True)
        return work.get_future().then(lambda future: future.value()[0])

    def _local_grad(self, p: nn.Parameter) -> torch.Tensor:
        """``p.grad``, or zeros for a parameter this rank's backward did not reach: every rank must still
        send its slot, or the ranks would disagree about the collectives."""
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def _unused_everywhere(self) -> set[nn.Parameter]:
        """With ``find_unused_parameters``, the parameters that got no gradient on any rank (one all-reduce
        of a flag per parameter, issued by every rank); otherwise none."""
        if not self.find_unused_parameters:
            return set()
        used = torch.tensor([p.grad is not None for p in self.params], dtype=torch.int32, device=self.params[0].device)
        dist.all_reduce(used, group=self.process_group)
        return {p for p, count in zip(self.params, used.tolist(), strict=True) if count == 0}


def set_grad(p: nn.Parameter, mean: torch.Tensor, unused: set[nn.Parameter]) -> None:
    """Give ``p`` the averaged gradient, unless no rank used it (its ``.grad`` then stays ``None``)."""
    if p in unused:
        return
    if p.grad is None:
        p.grad = mean.clone()
    elif p.grad is not mean:  # version 1 reduces .grad in place
        p.grad.copy_(mean)


class AllReduceDDP(DataParallel):
    """Version 1: at the end of backward, all-reduce every parameter's gradient, one collective each."""

    def _average(self) -> None:
        """All-reduce each parameter's gradient, divided by the number of ranks, one after the other."""
        means = {}
        for index, p in enumerate(reversed(self.params)):  # any order works, if every rank uses the same one
            means[p] = self._reduce(index, self._local_grad(p), [p]).wait()
        unused = self._unused_everywhere()
        for p, mean in means.items():
            set_grad(p, mean, unused)


def assign_buckets(params: list[nn.Parameter], bucket_cap_bytes: int) -> list[list[nn.Parameter]]:
    """Group parameters into buckets, last-defined first, closing a bucket once it holds ``bucket_cap_bytes``.

    One flat buffer holds one dtype on one device, so each (dtype, device) fills buckets of its own, as in
    torch DDP. Backward produces gradients roughly in the reverse of the order the layers were defined, so
    buckets are listed by their first parameter in that order: the first bucket is the first to be complete.
    As in torch DDP, a bucket may pass the cap by its last tensor.
    """
    order = list(reversed(params))
    closed, filling, size = [], {}, {}
    for p in order:
        kind = (p.dtype, p.device)
        filling.setdefault(kind, []).append(p)
        size[kind] = size.get(kind, 0) + p.numel() * p.element_size()
        if size[kind] >= bucket_cap_bytes:
            closed.append(filling.pop(kind))
            size[kind] = 0
    position = {p: i for i, p in enumerate(order)}
    return sorted(closed + list(filling.values()), key=lambda bucket: position[bucket[0]])


class Bucket:
    """The gradients of a few parameters of one dtype and device, back to back in one flat buffer that one
    collective reduces. With ``grads_as_views``, each parameter's ``.grad`` is its slot in the buffer."""

    def __init__(self, index: int, params: list[nn.Parameter], *, grads_as_views: bool = False):
        self.index = index
        self.params = params
        self.grads_as_views = grads_as_views
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.offsets, offset = {}, 0  # where each parameter's gradient starts in the buffer
        for p in params:
            self.offsets[p] = offset
            offset += p.numel()
        self.ready: set[nn.Parameter] = set()  # gradients of this backward copied in so far (OverlappedDDP)
        self.future: torch.futures.Future | None = None  # its all-reduce while in flight

    def slot(self, flat: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
        """``p``'s slice of ``flat`` (the buffer, or the reduced copy a hook returns), shaped like ``p``."""
        return flat[self.offsets[p] : self.offsets[p] + p.numel()].view_as(p)

    def pack(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Copy ``grad`` into ``p``'s slot, unless it is the slot already (``.grad`` a view of the bucket).

        With ``grads_as_views`` the slot then becomes ``p.grad``: autograd accumulates the next backward
        passes into the bucket itself, and the tensor autograd allocated this time is freed.
        """
        slot = self.slot(self.buffer, p)
        if grad.data_ptr() != slot.data_ptr():
            slot.copy_(grad)
        if self.grads_as_views and p.grad is not None:
            p.grad = slot

    def unpack(self, reduced: torch.Tensor, unused: set[nn.Parameter]) -> None:
        """Copy each parameter's slice of the reduced buffer into its ``.grad``; with ``grads_as_views``,
        make ``.grad`` the slot (the reduction ran in place in the buffer: nothing to copy)."""
        if not self.grads_as_views:
            for p in self.params:
                set_grad(p, self.slot(reduced, p), unused)
            return
        if reduced.data_ptr() != self.buffer.data_ptr():  # a hook that returned a new tensor
            self.buffer.copy_(reduced)
        for p in self.params:
            if p not in unused:
                p.grad = self.slot(self.buffer, p)


class BucketedDDP(DataParallel):
    """Version 2: at the end of backward, copy the gradients into buckets and all-reduce bucket by bucket.

    ``gradient_as_bucket_view=True`` (as in torch DDP) makes each ``.grad`` a view of its bucket after the
    first averaging backward pass, which removes the second copy of the gradients."""

    def __init__(
        self,
        module: nn.Module,
        process_group=None,
        *,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        forward_sync_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
    ):
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ValueError(
                f"bucket_cap_mb must be a positive number of MiB (torch's default is 25), got {bucket_cap_mb!r}"
            )
        if not isinstance(gradient_as_bucket_view, bool):
            raise ValueError(f"gradient_as_bucket_view must be True or False, got {gradient_as_bucket_view!r}")
        super().__init__(module, process_group, forward_sync_buffers=forward_sync_buffers,
                         find_unused_parameters=find_unused_parameters)  # fmt: skip
        self.gradient_as_bucket_view = gradient_as_bucket_view
        groups = assign_buckets(self.params, int(bucket_cap_mb * MIB))
        self.buckets = [Bucket(i, ps, grads_as_views=gradient_as_bucket_view) for i, ps in enumerate(groups)]
        self.bucket_of = {p: bucket for bucket in self.buckets for p in bucket.params}
        self.next_bucket = 0  # buckets launch in index order on every rank, so the collectives match up

    def _launch_buckets(self, *, incomplete_too: bool = False) -> None:
        """Launch the complete buckets in index order, stopping at the first incomplete one (or, with
        ``incomplete_too``, launching it as well, with its missing gradients taken from ``.grad`` or zeros).

        A bucket that completes early waits for its predecessors: all ranks must issue the same
        collectives in the same order, whatever order their gradients happen to arrive in.
        """
        while self.next_bucket < len(self.buckets):
            bucket = self.buckets[self.next_bucket]
            if len(bucket.ready) < len(bucket.params) and not incomplete_too:
                return
            for p in bucket.params:
                if p not in bucket.ready:
                    bucket.pack(p, self._local_grad(p))
            bucket.future = self._reduce(bucket.index, bucket.buffer, bucket.params)
            self.next_bucket += 1

    def _average(self) -> None:
        """Launch every bucket not launched yet (version 2: all of them, packed from ``.grad`` now), wait for
        each all-reduce, and copy the means back into ``.grad``."""
        self._launch_buckets(incomplete_too=True)
        means = [bucket.future.wait() for bucket in self.buckets]
        unused = self._unused_everywhere()
        for bucket, mean in zip(self.buckets, means, strict=True):
            bucket.unpack(mean, unused)
            bucket.ready, bucket.future = set(), None
        self.next_bucket = 0


class OverlappedDDP(BucketedDDP):
    """Version 3: each bucket's all-reduce starts during backward, the moment its last gradient is ready;
    the end of backward only launches the buckets that never completed and waits."""

    def _on_gradient(self, p: nn.Parameter) -> None:
        """Copy ``p.grad`` into its bucket and launch every bucket that is now complete, in index order."""
        bucket = self.bucket_of[p]
        bucket.pack(p, p.grad)
        bucket.ready.add(p)
        self._launch_buckets()
