"""Measured counterparts of the accounting formulas: bytes held, bytes saved for backward, FLOPs, FLOP/s.

Each function measures on a real model what :mod:`scalebook.accounting` predicts in closed form:

    tensor_bytes, model_state_bytes   bytes held by parameters, gradients and optimizer state
    parameters_by_group               parameters counted by component, from the names in a real model
    saved_activation_bytes            bytes of the tensors autograd saves during a forward pass
    count_flops                       FLOPs of one forward and backward pass, counted per operator
    peak_matmul_flops                 this machine's fp32 matrix-multiply FLOP/s, the peak for MFU on a CPU
    copy_bandwidth                    this machine's memory bandwidth, from a large copy
    peak_allocated_bytes              the most bytes torch's CPU allocator held at once during a call
    one_thread                        torch on one thread for a block (small runs, the same results anywhere)
    gpt_layer_op_calls, roofline_points   the operators of a GPT layer, run and timed for the roofline

``tracemalloc`` does not see torch's allocations, and process RSS mixes in the interpreter and the
allocator's caches, so memory is measured by walking the tensors themselves, or, for the peak within a
call, from the allocation and free events that torch's CPU allocator reports to its profiler. A storage shared by
several tensors (a tied embedding, a view) is counted once. Saved tensors are caught with
``saved_tensors_hooks``: a pack hook sees every tensor an operator keeps for its backward. Weights are
saved too (a linear layer keeps ``W.t()``, a view of the parameter), but they are model state, not
activations, so storages that belong to parameters or buffers are left out; and one activation is often
saved by two operators (the softmax output by softmax and by the next matmul), so each storage counts once.

Source: PyTorch documentation: ``torch.Tensor.untyped_storage``; "Hooks for saved tensors"
(``torch.autograd.graph.saved_tensors_hooks``); ``torch.utils.flop_counter.FlopCounterMode``.
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4
(what a Transformer layer saves); Chowdhery et al. 2022, "PaLM", Appendix B (MFU against peak FLOP/s);
Williams et al. 2009, "Roofline" (peak and bandwidth measured by a kernel that saturates each).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from scalebook.accounting import _checks, roofline


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by the storages behind ``tensors``; each storage counts once.

    A DTensor (FSDP2, tensor parallelism) counts the shard this rank holds, not the global tensor.
    """
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class StateBytes:
    """Bytes held by the model states of one process."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> StateBytes:
    """Count the bytes held right now by parameters, their ``.grad`` tensors and the optimizer state."""
    params = list(model.parameters())
    optimizer_tensors = []
    if optimizer is not None:
        for state in optimizer.state.values():
            # Adam's scalar step counter is a tensor too; it is bookkeeping, not per-parameter state.
            optimizer_tensors.extend(v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step")
    return StateBytes(
        params=tensor_bytes(params),
        grads=tensor_bytes(p.grad for p in params),
        optimizer=tensor_bytes(optimizer_tensors),
    )


def parameters_by_group(model: torch.nn.Module, groups: Mapping[str, str]) -> dict[str, int]:
    """Count ``model``'s parameters into named groups: the counterpart of ``accounting.param_breakdown``.

    ``groups`` maps a label to a regular expression; a parameter joins the first group whose expression
    matches (``re.search``) its name in ``model.named_parameters()``, which yields a tied parameter
    once. A parameter that no group matches is an error, so nothing is silently left out.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    compiled = {label: re.compile(pattern) for label, pattern in groups.items()}
    counts = dict.fromkeys(groups, 0)
    unmatched = []
    for name, param in model.named_parameters():
        label = next((label for label, pattern in compiled.items() if pattern.search(name)), None)
        if label is None:
            unmatched.append(name)
        else:
            counts[label] += param.numel()
    if unmatched:
        raise ValueError(f"no group matches {unmatched[:5]}{' ...' if len(unmatched) > 5 else ''}; add a pattern")
    return counts


# ----------------------------------------------------------------------------------- saved activations


@dataclass(frozen=True)
class SavedTensor:
    """One tensor that autograd saved for the backward pass."""

    layer: str | None  # the layer whose forward saved it (its name in the model), None outside the layers
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int  # bytes of its storage; 0 when a tensor saved earlier already holds that storage
    produced_by: str  # the operator that computed it ("Softmax", "Add"); "" if it has no autograd history


@dataclass(frozen=True)
class SavedActivations:
    """What one forward pass saved for backward: every tensor, and the byte totals by layer."""

    tensors: tuple[SavedTensor, ...]
    layer_names: tuple[str, ...]
    # Casts of parameters saved for backward (autocast's 16-bit weight copies): model state, not counted
    # in the totals; they are the "16-bit parameters" of mixed-precision training.
    parameter_copy_bytes: int = 0

    @property
    def total(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def per_layer(self) -> dict[str, int]:
        """Bytes first saved inside each layer, in the order of ``layer_names``."""
        totals = dict.fromkeys(self.layer_names, 0)
        for t in self.tensors:
            if t.layer is not None:
                totals[t.layer] += t.nbytes
        return totals

    @property
    def in_layers(self) -> int:
        return sum(self.per_layer.values())

    @property
    def outside_layers(self) -> int:
        """Bytes saved outside every layer: token ids, embeddings, final norm, logits, loss."""
        return self.total - self.in_layers


# Autograd nodes that only re-type or re-shape their one input: a parameter seen through them (an
# autocast bf16 copy of a weight, transposed for the matmul) is still the parameter, not an activation.
_CAST_OR_VIEW = frozenset({
    "ToCopyBackward0", "TBackward0", "ViewBackward0", "UnsafeViewBackward0", "TransposeBackward0",
    "PermuteBackward0", "ExpandBackward0", "AliasBackward0",
})  # fmt: skip


def _is_parameter_copy(t: torch.Tensor, parameter_ids: set[int]) -> bool:
    node = t.grad_fn
    while node is not None and type(node).__name__ in _CAST_OR_VIEW:
        sources = [n for n, _ in node.next_functions if n is not None]
        if len(sources) != 1:
            return False
        node = sources[0]
    # A leaf's gradient accumulator holds the leaf as ``variable``.
    return node is not None and id(getattr(node, "variable", None)) in parameter_ids


def _as_args(inputs) -> tuple:
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs)
    raise ValueError(
        f"inputs must be a tensor or a tuple of the model's positional arguments, got {type(inputs).__name__}"
    )


def _layer_names(model: torch.nn.Module, layers) -> dict[int, str]:
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    names = {id(module): name for name, module in model.named_modules()}
    layers = list(layers or ())
    strangers = [type(layer).__name__ for layer in layers if id(layer) not in names]
    if strangers:
        raise ValueError(f"layers must be sub-modules of the model (e.g. model.blocks); not found: {strangers}")
    return {id(layer): names[id(layer)] for layer in layers}


def record_saved_tensors(run, exclude: tuple[torch.Tensor, ...], running: list[str], layer_names: tuple[str, ...]):
    """Call ``run()`` with autograd on and a pack hook that records every tensor saved for backward.

    Storages of ``exclude`` (parameters, buffers) and casts of them are model state, not activations;
    every other storage counts once, at the first tensor that saves it.

    ``running`` is the stack of layer names whose forward is executing (maintained by the caller's
    module hooks); each record is attributed to its top.
    """
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    parameter_ids = {id(t) for t in exclude}
    seen: set[int] = set()
    copies: dict[int, int] = {}  # storage address -> bytes, of the parameter casts
    records: list[SavedTensor] = []
    keep: list[torch.Tensor] = []  # holds every saved tensor, so no storage address is reused mid-pass

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep.append(t)
        storage = t.untyped_storage()
        address = storage.data_ptr()
        if address in excluded:
            return t
        if _is_parameter_copy(t, parameter_ids):
            copies[address] = storage.nbytes()
        else:
            grad_fn = type(t.grad_fn).__name__ if t.grad_fn is not None else ""
            records.append(SavedTensor(
                layer=running[-1] if running else None,
                shape=tuple(t.shape),
                dtype=t.dtype,
                nbytes=0 if address in seen else storage.nbytes(),
                produced_by=grad_fn.removesuffix("Backward0").removesuffix("Backward1"),
            ))  # fmt: skip
            seen.add(address)
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = run()
    del output
    keep.clear()
    return SavedActivations(tensors=tuple(records), layer_names=layer_names, parameter_copy_bytes=sum(copies.values()))


def saved_by_call(fn, *args, exclude: Iterable[torch.Tensor] = ()) -> SavedActivations:
    """What ``fn(*args)`` saves for backward, for any callable: a functional operator such as
    ``F.scaled_dot_product_attention`` or a single layer. Storages of ``exclude`` (pass the layer's
    parameters) and casts of them are not counted; every other storage counts once."""
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    return record_saved_tensors(lambda: fn(*args), tuple(exclude), [], ())


def saved_activation_bytes(
    model: torch.nn.Module, inputs, *, layers: Iterable[torch.nn.Module] | None = None
) -> SavedActivations:
    """Run ``model(*inputs)`` once with autograd on and record every tensor it saves for backward.

    Storages of parameters and buffers are excluded (model state, not activations), and so are casts of
    parameters (autocast's bf16 weight copies, reported as ``parameter_copy_bytes``); every other
    storage counts once, at the first tensor that saved it. With ``layers`` (e.g. ``model.blocks``),
    each tensor is attributed to the innermost of those modules whose forward was running when it was
    saved. Under activation checkpointing a checkpointed layer saves only its input, and it saves it
    before the layer's forward starts, so those bytes are counted outside the layers.
    """
    args = _as_args(inputs)
    layer_names = _layer_names(model, layers)
    running: list[str] = []

    def enter(name: str):
        def pre_hook(module, args) -> None:
            running.append(name)

        return pre_hook

    def leave(module, args, output) -> None:  # returns None: a forward hook's return would replace output
        running.pop()

    handles = []
    for module in (m for m in model.modules() if id(m) in layer_names):
        handles.append(module.register_forward_pre_hook(enter(layer_names[id(module)])))
        handles.append(module.register_forward_hook(leave))
    try:
        state = (*model.parameters(), *model.buffers())
        return record_saved_tensors(lambda: model(*args), state, running, tuple(layer_names.values()))
    finally:
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------------------------------- FLOPs


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one training step's forward and backward passes (a multiply-add counts 2)."""

    forward: int
    backward: int
    by_operator: Mapping[str, int] = field(default_factory=dict)  # forward + backward, e.g. {"mm": ...}

    @property
    def total(self) -> int:
        return self.forward + self.backward


def _scalar_loss(output, loss_fn):
    if loss_fn is not None:
        loss = loss_fn(output)
    elif isinstance(output, (tuple, list)):
        scalars = [o for o in output if isinstance(o, torch.Tensor) and o.dim() == 0]
        loss = scalars[0] if len(scalars) == 1 else None
    else:
        loss = output
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
        raise ValueError(
            "could not find the loss: the model should return a scalar that requires grad, or a tuple with "
            "exactly one (e.g. GPT(idx, targets)); otherwise pass loss_fn=lambda output: ... returning it"
        )
    return loss


def count_flops(model: torch.nn.Module, inputs, *, loss_fn: Callable | None = None) -> FlopCount:
    """Count the FLOPs of ``model(*inputs)`` and of the backward pass of its loss, per operator.

    PyTorch's ``FlopCounterMode`` counts matrix multiplies and attention kernels (2 FLOPs per
    multiply-add); element-wise work (norms, softmax, GELU) is not counted, as in the formulas. It
    counts nothing for the CPU's fused flash-attention kernel, so attention runs on SDPA's math backend
    here, which multiplies explicitly. Gradients are taken with ``torch.autograd.grad``, so the
    parameters' ``.grad`` are left as they were.
    """
    args = _as_args(inputs)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no parameter that requires grad: there is no backward pass to count")
    by_operator: dict[str, int] = {}

    def tally(counter: FlopCounterMode) -> int:
        for op, flops in counter.get_flop_counts().get("Global", {}).items():
            name = getattr(op, "__name__", str(op)).split(".")[-1]
            by_operator[name] = by_operator.get(name, 0) + flops
        return counter.get_total_flops()

    with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as counter:
            loss = _scalar_loss(model(*args), loss_fn)
        forward = tally(counter)
        with FlopCounterMode(display=False) as counter:
            torch.autograd.grad(loss, params, allow_unused=True)
        backward = tally(counter)
    return FlopCount(forward=forward, backward=backward, by_operator=MappingProxyType(by_operator))


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one intra-op thread inside the block, the caller's count restored after it. For runs of small
    matrices: a second thread gains them nothing, on a busy machine the threads' waiting for each other costs
    many times the work, and one thread gives the same results on a machine of any core count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def best_time(fn: Callable[[], object], *, repeats: int = 5) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn()``, after one warm-up call (thread pool
    start-up, first-touch page faults). The minimum is the run least disturbed by other work."""
    _checks.require(_checks.positive_int(repeats=repeats))
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def peak_allocated_bytes(fn: Callable[[], object]) -> int:
    """The most bytes torch's CPU allocator held at once while ``fn()`` ran, counted from what it held when
    ``fn`` started (a tensor freed inside ``fn`` that existed before counts negative).

    Every CPU tensor's memory is allocated and freed through c10's CPU allocator, which reports each event
    with its size to the profiler when ``profile_memory=True``; their running sum in time order is the
    bytes in use, and its maximum the peak. Unlike RSS this leaves out the interpreter and malloc's
    caches; unlike counting saved tensors it sees temporaries (a softmax's output until it is freed, a
    gradient while it is built). ``torch.autograd.profiler.profile`` is used rather than
    ``torch.profiler.profile``, whose first use imports ``torch._inductor`` (seconds).
    """
    from torch.autograd import profiler

    # kineto, the profiler's engine, prints "profiler_start"/"profiler_stop" to stderr unless told not to.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with profiler.profile(profile_memory=True) as prof:
        fn()
    events = [e for e in prof.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    in_use = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        in_use += event.nbytes()
        peak = max(peak, in_use)
    return peak


def peak_matmul_flops(size: int = 2048, *, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of the fastest of ``repeats`` (size x size) @ (size x size) products: 2 size^3 FLOPs each.

    Large square products are the best case for the math library, so this is the most the machine
    sustains in practice, the denominator of MFU on a CPU (whose datasheets quote no dense FLOP/s).
    """
    _checks.require(_checks.positive_int(size=size, repeats=repeats))
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(dtype) for _ in range(2))
    out = torch.empty(size, size, dtype=dtype)
    return 2 * size**3 / best_time(lambda: torch.mm(a, b, out=out), repeats=repeats)


def copy_bandwidth(megabytes: int = 256, *, repeats: int = 5) -> float:
    """Bytes/s of the fastest of ``repeats`` copies of a ``megabytes`` MB fp32 tensor into another.

    A copy reads every byte once and writes it once, 2 x the size moved, with no arithmetic: the most
    bandwidth a program gets from memory. The tensor should be far larger than the caches (tens of MB),
    or the cache's bandwidth is measured instead.
    """
    _checks.require(_checks.positive_int(megabytes=megabytes, repeats=repeats))
    src = torch.ones(megabytes * 10**6 // 4)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / best_time(lambda: dst.copy_(src), repeats=repeats)


# ---------------------------------------------------------------------------------------------- roofline


@dataclass(frozen=True)
class OpCall:
    """One operator of a GPT layer, ready to run: ``fn(*inputs)``."""

    name: str
    fn: Callable
    inputs: tuple[torch.Tensor, ...]

    def __call__(self) -> torch.Tensor:
        return self.fn(*self.inputs)


def gpt_layer_op_calls(
    batch: int, seq_len: int, d_model: int, n_heads: int, *, dtype: torch.dtype = torch.float32
) -> dict[str, OpCall]:
    """The operators of ``accounting.roofline.gpt_layer_ops`` on random tensors of their shapes, by name."""
    roofline.gpt_layer_ops(batch, seq_len, d_model, n_heads)  # validates the shape, with the formula's messages
    b, s, h, a = batch, seq_len, d_model, n_heads
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    x, scores, heads = t(b, s, h), t(b, a, s, s), t(b, a, s, h // a)
    calls = [
        OpCall("LayerNorm", lambda x, w, c: F.layer_norm(x, (h,), w, c), (x, t(h), t(h))),
        OpCall("QKV projection", torch.matmul, (x, t(h, 3 * h))),
        OpCall("attention scores QK^T", torch.matmul, (heads, t(b, a, h // a, s))),
        OpCall("softmax", lambda z: torch.softmax(z, dim=-1), (scores,)),
        OpCall("attention P V", torch.matmul, (scores, heads)),
        OpCall("output projection", torch.matmul, (x, t(h, h))),
        OpCall("residual add", torch.add, (x, t(b, s, h))),
        OpCall("MLP up", torch.matmul, (x, t(h, 4 * h))),
        OpCall("GELU", lambda z: F.gelu(z, approximate="tanh"), (t(b, s, 4 * h),)),
        OpCall("MLP down", torch.matmul, (t(b, s, 4 * h), t(4 * h, h))),
    ]
    return {call.name: call for call in calls}


@dataclass(frozen=True)
class RooflinePoint:
    """An operator placed on the roofline: its intensity (from the formula) and the FLOP/s it reached."""

    name: str
    intensity: float
    flops_per_second: float
    seconds: float


def roofline_points(
    batch: int, seq_len: int, d_model: int, n_heads: int, *, repeats: int = 5, dtype: torch.dtype = torch.float32
) -> list[RooflinePoint]:
    """Time each operator of a GPT layer (best of ``repeats``) and divide its formula FLOPs by the time."""
    calls = gpt_layer_op_calls(batch, seq_len, d_model, n_heads, dtype=dtype)
    p = torch.empty((), dtype=dtype).element_size()
    points = []
    for op in roofline.gpt_layer_ops(batch, seq_len, d_model, n_heads, dtype_bytes=p):
        seconds = best_time(calls[op.name], repeats=repeats)
        points.append(RooflinePoint(op.name, op.intensity, op.flops / seconds, seconds))
    return points
