"""When distributed training goes wrong: deliberately broken training code, and the tools that catch it.

Chapter 16's six labs. Each pairs a small, DELIBERATELY BROKEN variant of code from Chapters 7-13 with
the symptom it produces, a tool that diagnoses it, and the fix. Broken code is selected by a variant
whose name starts with ``"broken"``; it lives here, not in the modules it imitates, and must never be
copied. Worker functions (``*_lab``) run on the ranks of :func:`scalebook.comm.launch`.

1. The hang (:func:`sync_and_check_stop`, :func:`diagnose_hang`): ranks issue collectives in different
   orders. gloo waits for the process-group timeout; ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` compares each
   collective's fingerprint (operation, shapes) across ranks before running it and names the mismatch
   at once; :func:`record_collectives` is a flight recorder whose per-rank logs
   :func:`first_mismatch` compares after the fact.
2. Gradient accumulation scaled wrong (:func:`accumulation_lab`): micro-batch losses not divided by the
   number of micro-batches, or averaged per micro-batch although their token counts differ.
3. ``no_sync`` misuse (:func:`no_sync_lab`): the last micro-batch also skips the all-reduce (replicas
   drift apart, caught by :func:`rank_checksums`), or no micro-batch skips it (correct but
   ``grad_accum`` times the traffic, caught by :func:`scalebook.comm.traffic.count_traffic`).
4. Unsynchronized randomness (:func:`randomness_lab`): tensor-parallel ranks initialised from different
   seeds; data-parallel ranks reading the same batch.
5. Parity across layouts (:func:`parity_lab`): DP, TP and PP from one seed against one process, their
   losses and their gradient norms before the optimizer compared step by step by
   :func:`scalebook.parity.compare_losses`; a missing 1/d hides in the losses and shows in the norms.
6. Out of memory, predicted (:func:`predicted_peak_bytes`, :func:`check_fits`, :class:`EmulatedDevice`):
   the accounting of Chapter 7 refuses a micro-batch that will not fit, and a CPU emulation of a device
   with a memory cap fails exactly there.

Source: PyTorch documentation, "torch.distributed: Debugging torch.distributed applications"
(``TORCH_DISTRIBUTED_DEBUG``, collective fingerprints) and "DistributedDataParallel.no_sync";
torchtitan documentation, "How to converge" (loss parity); Shoeybi et al. 2019 (Megatron-LM, Sec. 3,
random number generation in tensor parallelism); Korthikanti et al. 2022 (activation memory).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from scalebook import measure
from scalebook.accounting.comm import bytes_sent_per_rank
from scalebook.accounting.memory import activation_bytes, model_state_bytes
from scalebook.comm import count_traffic, launch
from scalebook.comm.launch import LaunchError
from scalebook.configs import ModelConfig, gpt_like
from scalebook.data import default_corpus, get_batch, tokenize
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.ddp import BucketedDDP, TorchDDPProbe, probed_allreduce_hook
from scalebook.parallel.pipeline import GPTStage, build_schedule, run_schedule, stage_layers, sync_tied_embedding
from scalebook.parallel.tensor import TensorParallelGPT, sharding_of
from scalebook.train import TrainConfig, make_optimizer


@functools.cache
def _tokens() -> torch.Tensor:
    return tokenize(default_corpus())


def _check_variants(variants, allowed: tuple[str, ...]) -> tuple[str, ...]:
    variants = tuple(variants)
    unknown = [v for v in variants if v not in allowed]
    if not variants or unknown:
        raise ValueError(f"variants must be a non-empty selection of {allowed}, got {variants}")
    return variants


# ----- The diagnosis tool of labs 3 and 4: one checksum per rank ------------------------------------------


def checksum(tensors) -> float:
    """A float64 fingerprint of ``tensors``: a position-weighted sum, so permuted values change it too."""
    total = torch.zeros((), dtype=torch.float64)
    for t in tensors:
        flat = t.detach().reshape(-1).to(torch.float64)
        total += flat @ torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64)
    return total.item()


def rank_checksums(tensors, group=None) -> list[float]:
    """Every rank's :func:`checksum` of its ``tensors``, in rank order (a collective: all ranks call it).

    Replicas (data-parallel parameters, tensor-parallel replicated weights) must give identical
    checksums; data shards must give different ones. Sending one number per rank costs nothing, so it
    can run every N steps in production.
    """
    mine = torch.tensor([checksum(tensors)], dtype=torch.float64)
    out = torch.empty(dist.get_world_size(group), dtype=torch.float64)
    dist.all_gather_single(out, mine, group=group)
    return out.tolist()


def spread(checksums: list[float]) -> float:
    """Relative spread ``(max - min) / |mean|`` of per-rank checksums: 0 for identical replicas."""
    mean = sum(checksums) / len(checksums)
    return (max(checksums) - min(checksums)) / max(abs(mean), 1e-300)


# ----- Lab 1: the hang -------------------------------------------------------------------------------------

HANG_VARIANTS = ("broken: rank 0 checks the stop flag first", "fixed: same order on every rank")


class _TraceFile(list):
    """The call list of a ``count_traffic`` block that also writes each call to a file as it is issued,
    so the record survives a rank that is killed while blocked in the call."""

    def __init__(self, path: Path):
        super().__init__()
        self.file = path.open("w", buffering=1)  # line-buffered: every call reaches the disk at once

    def append(self, call) -> None:
        super().append(call)
        self.file.write(f"{call.op} {call.message_bytes} {call.group_size}\n")


@contextlib.contextmanager
def record_collectives(directory: str | os.PathLike) -> Iterator[None]:
    """Flight recorder: log every collective this rank issues to ``directory/rank<r>.trace`` as it starts."""
    trace = _TraceFile(Path(directory) / f"rank{dist.get_rank()}.trace")
    try:
        with count_traffic() as traffic:
            traffic.calls = trace
            yield
    finally:
        trace.file.close()


def first_mismatch(directory: str | os.PathLike, world_size: int) -> str | None:
    """Compare the ranks' flight-recorder logs; describe the first call where they differ (None: all agree)."""
    traces = []
    for rank in range(world_size):
        path = Path(directory) / f"rank{rank}.trace"
        traces.append(path.read_text().splitlines() if path.exists() else [])
    for i in range(max(map(len, traces))):
        calls = [trace[i] if i < len(trace) else None for trace in traces]
        if len(set(calls)) > 1:

            def describe(call):
                if call is None:
                    return "issued nothing"
                op, message, _ = call.split()
                return f"{op} of {int(message):,} bytes"

            return f"collective #{i}: " + ", ".join(f"rank {r} {describe(c)}" for r, c in enumerate(calls))
    return None


def sync_and_check_stop(variant: str, trace_dir: str | None = None, numel: int = 1000) -> float:
    """Worker: one step's gradient all-reduce and rank 0's "should we stop?" broadcast.

    BROKEN variant: rank 0 checks the stop flag before syncing gradients, the others after, so rank 0
    waits in a broadcast while its peers wait in an all-reduce. Returns the gradient sum; raises
    RuntimeError saying how many seconds the failing collective took to fail.
    """
    _check_variants([variant], HANG_VARIANTS)
    rank = dist.get_rank()
    grad, stop = torch.full((numel,), float(rank)), torch.zeros(1)
    order = ["stop", "grad"] if variant.startswith("broken") and rank == 0 else ["grad", "stop"]
    recorder = record_collectives(trace_dir) if trace_dir else contextlib.nullcontext()
    start = time.perf_counter()
    try:
        with recorder:
            for what in order:
                if what == "grad":
                    dist.all_reduce(grad)
                else:
                    dist.broadcast(stop, group_src=0)
    except RuntimeError as error:
        raise RuntimeError(f"collective failed after {time.perf_counter() - start:.3f} s: {error}") from error
    return grad.sum().item()


@dataclass(frozen=True)
class HangReport:
    """What the reader sees when the hang lab runs: did it surface, how fast, and what names the cause."""

    variant: str
    debug: str  # TORCH_DISTRIBUTED_DEBUG in the ranks
    surfaced: bool  # the launch raised instead of returning
    seconds_in_rank: float | None  # from the first collective to the error, on the first failing rank
    wall_seconds: float  # the whole launch, including starting the ranks
    first_rank: int | None
    cause: str  # the stable part of the error (no ports, addresses or timings)
    mismatch: str | None  # the flight recorder's verdict


@contextlib.contextmanager
def _environment(**variables: str) -> Iterator[None]:
    """Set environment variables for processes started inside the block (spawned ranks inherit them)."""
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _cause(message: str) -> str:
    fingerprints = re.findall(
        r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), OpType=(\w+), "
        r"TensorShape=\[([^\]]*)\]",
        message,
    )
    if fingerprints:
        ranks = dict((int(r), f"{op}{[int(s) for s in shape.split(',') if s.strip()]}")
                     for r, _, op, shape in fingerprints)  # fmt: skip
        return "fingerprint mismatch: " + ", ".join(f"rank {r} runs {ranks[r]}" for r in sorted(ranks))
    if "Timed out" in message or "timed out" in message:
        return "a collective timed out: its peers never joined it"
    if "still running after" in message:
        return "ranks hung and were killed by the launcher"
    return message.strip().splitlines()[-1]


def diagnose_hang(variant: str, *, debug: str = "OFF", timeout: float = 3.0) -> HangReport:
    """Run :func:`sync_and_check_stop` on 2 ranks with a ``timeout``-second process group, with
    ``TORCH_DISTRIBUTED_DEBUG=debug`` (``"OFF"`` or ``"DETAIL"``) and the flight recorder on."""
    _check_variants([variant], HANG_VARIANTS)
    if debug not in ("OFF", "INFO", "DETAIL"):
        raise ValueError(f"debug must be 'OFF', 'INFO' or 'DETAIL' (TORCH_DISTRIBUTED_DEBUG), got {debug!r}")
    with (
        tempfile.TemporaryDirectory(prefix="scalebook-trace-") as trace_dir,
        _environment(TORCH_DISTRIBUTED_DEBUG=debug),
    ):
        start = time.perf_counter()
        try:
            launch(sync_and_check_stop, 2, variant, trace_dir, timeout=timeout)
            surfaced, message = False, ""
        except LaunchError as error:
            surfaced, message = True, str(error)
        wall = time.perf_counter() - start
        mismatch = first_mismatch(trace_dir, 2)
    seconds = re.search(r"collective failed after ([\d.]+) s", message)
    first = re.match(r"rank (\d+) of", message)
    return HangReport(
        variant=variant,
        debug=debug,
        surfaced=surfaced,
        seconds_in_rank=float(seconds.group(1)) if seconds else None,
        wall_seconds=wall,
        first_rank=int(first.group(1)) if first else None,
        cause=_cause(message) if surfaced else "",
        mismatch=mismatch,
    )


# ----- Lab 2: gradient accumulation scaled wrong -----------------------------------------------------------

ACCUMULATION_VARIANTS = (
    "broken: sum of micro-batch means",  # forgot to divide by grad_accum
    "broken: mean of micro-batch means",  # divided by grad_accum, but micro-batches hold different token counts
    "fixed: divide by the global token count",
)


def padded_batch(generator: torch.Generator, rows: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length sequences right-padded to ``seq_len``: targets of padding are -100 (ignored by the loss).

    Each sequence keeps between ``seq_len // 8`` and ``seq_len`` real tokens, so micro-batches hold
    different numbers of tokens, as with packed-free batching of documents of different lengths.
    """
    x, y = get_batch(_tokens(), rows, seq_len, generator)
    lengths = torch.randint(max(1, seq_len // 8), seq_len + 1, (rows,), generator=generator)
    padding = torch.arange(seq_len)[None, :] >= lengths[:, None]
    return x.masked_fill(padding, 0), y.masked_fill(padding, -100)


def _token_losses_sum(model, x, y) -> tuple[torch.Tensor, int]:
    logits, _ = model(x)
    loss_sum = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1), reduction="sum")
    return loss_sum, int((y != -100).sum())


def _relative_error(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    num = sum(((grads[n] - g) ** 2).sum() for n, g in reference.items())
    return (num / sum((g**2).sum() for g in reference.values())).sqrt().item()


def accumulation_lab(
    variants=ACCUMULATION_VARIANTS,
    *,
    steps: int = 6,
    micro_batch: int = 2,
    grad_accum: int = 4,
    seq_len: int = 32,
    lr: float = 0.05,
    size: str = "tiny",
    seed: int = 0,
) -> dict:
    """Worker: train torch DDP replicas with each way of scaling accumulated micro-batch losses, and one
    process on the whole global batch (the reference), with plain SGD so a wrong gradient scale shows.

    Returns ``{"reference": losses, variant: {"losses", "grad_error"}}``: the token-weighted global loss
    of each step (computed the same way for every variant) and the relative gradient error of step 0.
    """
    variants = _check_variants(variants, ACCUMULATION_VARIANTS)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = GPTConfig.named(size)

    def batches(step: int):
        """The global batch of ``step``: world x grad_accum micro-batches; this rank's are [rank::world]."""
        generator = torch.Generator().manual_seed(seed * 1000 + step)
        return [padded_batch(generator, micro_batch, seq_len) for _ in range(world * grad_accum)]

    torch.manual_seed(seed)
    reference = GPT(config)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    ref_losses, ref_grads = [], None
    for step in range(steps):
        x, y = (torch.cat(t) for t in zip(*batches(step), strict=True))
        ref_opt.zero_grad()
        _, loss = reference(x, y)  # cross_entropy's mean skips the -100 targets: a token-weighted mean
        loss.backward()
        ref_grads = ref_grads or {n: p.grad.clone() for n, p in reference.named_parameters()}
        ref_opt.step()
        ref_losses.append(loss.item())
    out = {"reference": ref_losses}
    for variant in variants:
        torch.manual_seed(seed)
        model = DistributedDataParallel(GPT(config))
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        losses, grad_error = [], None
        for step in range(steps):
            mine = batches(step)[rank::world]
            tokens = torch.tensor([float(sum(int((y != -100).sum()) for _, y in mine))])
            dist.all_reduce(tokens)  # the fix needs the global token count before the first backward
            optimizer.zero_grad()
            logged = torch.zeros(2, dtype=torch.float64)  # (sum of token losses, tokens) for the log
            for i, (x, y) in enumerate(mine):
                last = i == grad_accum - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss_sum, n = _token_losses_sum(model, x, y)
                    if variant == "broken: sum of micro-batch means":
                        scaled = loss_sum / n
                    elif variant == "broken: mean of micro-batch means":
                        scaled = loss_sum / n / grad_accum
                    else:  # DDP averages over ranks, so undo its 1/world: the result is sum / global tokens
                        scaled = loss_sum * world / tokens[0]
                    scaled.backward()
                logged += torch.tensor([loss_sum.item(), n], dtype=torch.float64)
            if grad_error is None:
                grad_error = _relative_error({n: p.grad for n, p in model.module.named_parameters()}, ref_grads)
            optimizer.step()
            dist.all_reduce(logged)
            losses.append((logged[0] / logged[1]).item())
        out[variant] = {"losses": losses, "grad_error": grad_error}
    return out


# ----- Lab 3: no_sync misuse -------------------------------------------------------------------------------

NO_SYNC_VARIANTS = (
    "broken: no_sync on every micro-batch",  # the last backward never all-reduces
    "broken: no_sync never used",  # every backward all-reduces
    "fixed: no_sync on all but the last",
)


def no_sync_lab(
    variants=NO_SYNC_VARIANTS,
    *,
    steps: int = 3,
    micro_batch: int = 2,
    grad_accum: int = 4,
    seq_len: int = 32,
    size: str = "tiny",
    seed: int = 0,
) -> dict:
    """Worker: torch DDP with gradient accumulation, using ``no_sync`` three ways.

    Per variant: the cross-rank parameter checksums after each step (:func:`rank_checksums`), the
    all-reduce calls and bytes of each step (a communication hook makes DDP's all-reduces visible to
    :func:`~scalebook.comm.traffic.count_traffic`), and ``expected_bytes``, one ring all-reduce of every
    gradient (:func:`scalebook.accounting.comm.bytes_sent_per_rank`).
    """
    variants = _check_variants(variants, NO_SYNC_VARIANTS)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = GPTConfig.named(size)
    train_config = TrainConfig(steps=steps, lr=1e-3, min_lr=1e-3, warmup_steps=0, grad_clip=None, progress=False)
    out = {}
    for variant in variants:
        torch.manual_seed(seed)
        model = GPT(config)
        ddp = DistributedDataParallel(model)
        probe = TorchDDPProbe({id(p): n for n, p in model.named_parameters()})
        ddp.register_comm_hook(probe, probed_allreduce_hook)
        optimizer = make_optimizer(model, train_config)
        generator = torch.Generator().manual_seed(seed)
        checksums, calls, sent = [], [], []
        for _ in range(steps):
            x, y = get_batch(_tokens(), micro_batch * grad_accum, seq_len, generator, rank=rank, world_size=world)
            optimizer.zero_grad()
            with count_traffic() as traffic:
                for i, (xb, yb) in enumerate(zip(x.chunk(grad_accum), y.chunk(grad_accum), strict=True)):
                    if variant == "broken: no_sync on every micro-batch":
                        skip = True
                    elif variant == "broken: no_sync never used":
                        skip = False
                    else:
                        skip = i < grad_accum - 1
                    with ddp.no_sync() if skip else contextlib.nullcontext():
                        (ddp(xb, yb)[1] / grad_accum).backward()
            optimizer.step()
            calls.append(traffic.count("all_reduce"))
            sent.append(traffic.bytes_sent("all_reduce"))
            checksums.append(rank_checksums(model.parameters()))
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        out[variant] = {
            "checksums": checksums,
            "calls": calls,
            "bytes_sent": sent,
            "expected_bytes": bytes_sent_per_rank("all_reduce", grad_bytes, world),
        }
    return out


# ----- Lab 4: unsynchronized randomness --------------------------------------------------------------------

TP_SEED_VARIANTS = ("broken: seed + rank on every rank", "fixed: one seed for all tensor-parallel ranks")
DATA_VARIANTS = ("broken: every rank reads the whole batch", "fixed: each rank reads its shard")


def randomness_lab(*, batch_size: int = 4, seq_len: int = 32, size: str = "tiny", seed: int = 0) -> dict:
    """Worker: the two random streams that must (or must not) agree across ranks.

    ``"tp"``: each variant builds a :class:`~scalebook.parallel.tensor.TensorParallelGPT` over all ranks
    from a GPT initialised with ``seed + rank`` (broken) or ``seed``; reports the checksums of the
    replicated parameters (LayerNorms, position embeddings, row-parallel biases: they must agree) and
    the loss error against the unsharded GPT built from ``seed``. ``"data"``: each variant's batch
    checksums (data-parallel shards must differ).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    config = GPTConfig.named(size)
    x, y = get_batch(_tokens(), batch_size, seq_len, torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    _, ref_loss = GPT(config)(x, y)
    tp = {}
    for variant in TP_SEED_VARIANTS:
        torch.manual_seed(seed + rank if variant.startswith("broken") else seed)
        model = TensorParallelGPT.from_gpt(GPT(config))
        replicated = [p for n, p in model.named_parameters() if sharding_of(n) is None]
        _, loss = model(x, y)
        tp[variant] = {"checksums": rank_checksums(replicated), "loss_error": abs(loss.item() - ref_loss.item())}
    data = {}
    for variant in DATA_VARIANTS:
        generator = torch.Generator().manual_seed(seed)
        if variant.startswith("broken"):  # the sampler was never told about the other ranks
            xb, _ = get_batch(_tokens(), batch_size, seq_len, generator)
        else:
            xb, _ = get_batch(_tokens(), batch_size, seq_len, generator, rank=rank, world_size=world)
        data[variant] = {"checksums": rank_checksums([xb])}
    return {"tp": tp, "data": data}


# ----- Lab 5: loss parity across layouts -------------------------------------------------------------------

PARITY_LAYOUTS = ("single", "dp2", "tp2", "pp2", "dp2 broken: gradients summed, not averaged",
                  "pp2 broken: tied embedding not synced")  # fmt: skip


def _global_grad_norm(model: torch.nn.Module, layout: str) -> float:
    """The L2 norm of the whole model's gradient, every parameter counted once, on every rank.

    ``single`` and ``dp2`` hold every gradient on each rank; ``tp2`` splits the sharded matrices over the
    ranks (their squares are summed over ranks) and replicates the rest; ``pp2`` gives each rank one
    stage, and the last stage's head is a copy of the first stage's embedding, counted there.
    """
    named = list(model.named_parameters())
    if layout == "tp2":
        split = [p.grad for name, p in named if sharding_of(name) is not None]
        replicated = [p.grad for name, p in named if sharding_of(name) is None]
    elif layout.startswith("pp2"):
        split, replicated = [p.grad for name, p in named if name != "lm_head.weight"], []
    else:
        split, replicated = [], [p.grad for _, p in named]
    squares = torch.zeros((), dtype=torch.float64)
    for g in split:
        squares += g.double().square().sum()
    if split:
        dist.all_reduce(squares)
    for g in replicated:
        squares += g.double().square().sum()
    return squares.sqrt().item()


def parity_lab(
    layouts=PARITY_LAYOUTS,
    *,
    steps: int = 8,
    batch_size: int = 8,
    seq_len: int = 32,
    lr: float = 3e-3,
    size: str = "tiny",
    seed: int = 0,
) -> dict:
    """Worker (2 ranks): train the same GPT from one seed on the same global batches with each layout.

    ``single`` is one process on the whole batch; ``dp2`` Chapter 10's bucketed DDP; ``tp2`` Chapter 12's
    tensor parallelism; ``pp2`` Chapter 13's 1F1B pipeline with 2 micro-batches. Two BROKEN layouts: DDP
    that sums the gradients over the ranks instead of averaging them (a missing 1/d), and a pipeline that
    skips the all-reduce of the tied embedding's two copies. AdamW without clipping (so that the scale of
    the gradients reaches the optimizer untouched).

    Returns ``{"losses": {layout: [global loss of each step]}, "grad_norms": {layout: [norm of each step's
    gradient, before the optimizer]}}``, the same on every rank. The gradient norms are the sharper
    detector: Adam divides a constant factor on the gradients out of its update, so a missing 1/d barely
    moves the losses, while it doubles the norm (d = 2) from step 0.
    """
    layouts = _check_variants(layouts, PARITY_LAYOUTS)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise ValueError(f"parity_lab's layouts are for 2 ranks, got {world}")
    config = GPTConfig.named(size)
    train_config = TrainConfig(steps=steps, lr=lr, min_lr=lr, warmup_steps=0, grad_clip=None, progress=False)
    out = {"losses": {}, "grad_norms": {}}
    for layout in layouts:
        torch.manual_seed(seed)
        full = GPT(config)
        if layout.startswith("pp2"):
            stage = GPTStage(full, stage_layers(config.n_layer, 2)[rank], first=rank == 0, last=rank == 1)
            model = stage
        elif layout == "tp2":
            model = TensorParallelGPT.from_gpt(full)
        else:
            model = full
        ddp = BucketedDDP(model) if layout.startswith("dp2") else None
        optimizer = make_optimizer(model, train_config)
        generator = torch.Generator().manual_seed(seed)
        losses, norms = [], []
        for _ in range(steps):
            x, y = get_batch(_tokens(), batch_size, seq_len, generator)  # the whole global batch
            optimizer.zero_grad(set_to_none=False)
            if layout.startswith("pp2"):
                record = run_schedule(build_schedule("1f1b", 2, 2), {rank: stage}, x, y)
                if layout == "pp2":
                    sync_tied_embedding({rank: stage}, group=None)
                loss = torch.tensor([record.loss if rank == 1 else 0.0])
                dist.broadcast(loss, group_src=1)
            elif layout.startswith("dp2"):
                rows = slice(rank * batch_size // 2, (rank + 1) * batch_size // 2)
                _, local = model(x[rows], y[rows])
                local.backward()
                ddp.sync_gradients()
                if layout != "dp2":  # BROKEN: undo DDP's division, leaving the sum of the ranks' gradients
                    for p in model.parameters():
                        p.grad.mul_(world)
                loss = local.detach().reshape(1) / world
                dist.all_reduce(loss)
            else:
                _, loss = model(x, y)
                loss.backward()
            norms.append(_global_grad_norm(model, layout))  # before the optimizer: what it is about to apply
            optimizer.step()
            losses.append(loss.item())
        out["losses"][layout], out["grad_norms"][layout] = losses, norms
    return out


# ----- Lab 6: out of memory, predicted ---------------------------------------------------------------------


def _model_config(config: GPTConfig) -> ModelConfig:
    return gpt_like(f"GPT n_layer={config.n_layer} n_embd={config.n_embd}", vocab_size=config.vocab_size,
                    d_model=config.n_embd, n_layers=config.n_layer, n_heads=config.n_head,
                    max_seq_len=config.block_size, bias=config.bias)  # fmt: skip


def predicted_peak_bytes(config: GPTConfig, *, micro_batch: int, seq_len: int) -> dict[str, int]:
    """Bytes one fp32 AdamW training step holds at the end of the forward pass, by Chapter 7's accounting.

    ``model_states``: parameters, gradients, Adam's two moments (16 bytes per parameter);
    ``activations``: Korthikanti et al.'s per-layer count at 4 bytes per value without dropout (the
    explicit attention saves its score matrix); ``logits``: the (b, s, V) logits and the fp32
    log-softmax the loss saves, ``2 b s V`` values, which the per-layer formula leaves out.
    """
    if config.dropout:
        raise ValueError("predicted_peak_bytes counts a model without dropout; build the GPT with dropout=0")
    cfg = _model_config(config)
    states = model_state_bytes(cfg, precision="fp32", optimizer="adam").total
    acts = activation_bytes(cfg, seq_len=seq_len, micro_batch=micro_batch, dtype_bytes=4, dropout=False)
    logits = 2 * micro_batch * seq_len * config.vocab_size * 4
    return {"model_states": states, "activations": acts, "logits": logits, "total": states + acts + logits}


def check_fits(config: GPTConfig, *, micro_batch: int, seq_len: int, capacity: int) -> dict[str, int]:
    """Refuse a layout up front: ValueError with the numbers if :func:`predicted_peak_bytes` exceeds
    ``capacity`` bytes; otherwise return the prediction."""
    predicted = predicted_peak_bytes(config, micro_batch=micro_batch, seq_len=seq_len)
    if predicted["total"] > capacity:
        per_sequence = predicted_peak_bytes(config, micro_batch=1, seq_len=seq_len)
        largest = (capacity - per_sequence["model_states"]) // (per_sequence["total"] - per_sequence["model_states"])
        raise ValueError(
            f"micro-batch {micro_batch} x {seq_len} tokens will not fit: predicted "
            f"{predicted['total']:,} bytes (model states {predicted['model_states']:,}, activations "
            f"{predicted['activations']:,}, logits {predicted['logits']:,}) > capacity {capacity:,}; "
            f"use micro_batch <= {largest} with gradient accumulation, or activation recomputation"
        )
    return predicted


class _Saved:
    """A tensor saved for backward, counted on its device while autograd holds it."""

    def __init__(self, tensor: torch.Tensor, device: EmulatedDevice):
        self.tensor, self.device = tensor, device
        device._add(tensor)

    def __del__(self):
        self.device._remove(self.tensor)


class EmulatedDevice:
    """A CPU stand-in for a device with ``capacity`` bytes: raises ``torch.OutOfMemoryError`` when the
    model states plus the tensors saved for backward (each storage once, parameters excluded) exceed it.

    Not counted: temporary buffers that die within one operation (a real device needs headroom for them).
    """

    def __init__(self, capacity: int):
        if not capacity > 0:
            raise ValueError(f"capacity must be a positive number of bytes, got {capacity!r}")
        self.capacity = capacity
        self.state_bytes = 0
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [bytes, references]
        self.saved_bytes = self.peak = 0

    def _add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        entry = self._storages.setdefault(storage.data_ptr(), [storage.nbytes(), 0])
        if entry[1] == 0:
            self.saved_bytes += entry[0]
        entry[1] += 1
        used = self.state_bytes + self.saved_bytes
        self.peak = max(self.peak, used)
        if used > self.capacity:
            raise torch.OutOfMemoryError(
                f"emulated device out of memory: {used:,} bytes in use (model states {self.state_bytes:,}, "
                f"saved activations {self.saved_bytes:,}) > capacity {self.capacity:,}"
            )

    def _remove(self, tensor: torch.Tensor) -> None:
        entry = self._storages[tensor.untyped_storage().data_ptr()]
        entry[1] -= 1
        if entry[1] == 0:
            self.saved_bytes -= entry[0]
            del self._storages[tensor.untyped_storage().data_ptr()]

    @contextlib.contextmanager
    def running(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Account one forward and backward of ``model``: its states now, and every tensor saved meanwhile."""
        self.state_bytes = measure.model_state_bytes(model, optimizer).total
        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t: torch.Tensor):
            return t if t.untyped_storage().data_ptr() in parameters else _Saved(t, self)

        def unpack(packed):
            return packed.tensor if isinstance(packed, _Saved) else packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


def train_under_cap(
    config: GPTConfig, *, micro_batch: int, seq_len: int, capacity: int, steps: int = 2, seed: int = 0
) -> int:
    """Train ``steps`` fp32 AdamW steps on an :class:`EmulatedDevice` of ``capacity`` bytes; return its
    peak bytes, or raise ``torch.OutOfMemoryError`` where a real device would. Gradients stay allocated
    between steps (``zero_grad(set_to_none=False)``), so from step 1 on all model states are resident."""
    torch.manual_seed(seed)
    model = GPT(config)
    optimizer = make_optimizer(model, TrainConfig(steps=steps, grad_clip=None, progress=False))
    device = EmulatedDevice(capacity)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = get_batch(_tokens(), micro_batch, seq_len, generator)
        optimizer.zero_grad(set_to_none=False)
        with device.running(model, optimizer):
            _, loss = model(x, y)
            loss.backward()
        optimizer.step()
    return device.peak


def oom_sweep(config: GPTConfig, micro_batches, *, seq_len: int, capacity: int) -> list[dict]:
    """For each micro-batch size: the predicted bytes and verdict of :func:`check_fits`, and what
    :func:`train_under_cap` observed (peak bytes, or the bytes in use when it ran out)."""
    rows = []
    for b in micro_batches:
        predicted = predicted_peak_bytes(config, micro_batch=b, seq_len=seq_len)["total"]
        try:
            check_fits(config, micro_batch=b, seq_len=seq_len, capacity=capacity)
            refused = False
        except ValueError:
            refused = True
        try:
            observed, failed = train_under_cap(config, micro_batch=b, seq_len=seq_len, capacity=capacity), False
        except torch.OutOfMemoryError as error:
            observed, failed = int(re.search(r"([\d,]+) bytes in use", str(error)).group(1).replace(",", "")), True
        rows.append({"micro_batch": b, "predicted": predicted, "refused": refused, "observed": observed,
                     "out_of_memory": failed})  # fmt: skip
    return rows
