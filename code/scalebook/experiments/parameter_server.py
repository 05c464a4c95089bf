"""A parameter server from point-to-point messages: the first data-parallel design, and why all-reduce replaced it.

Before all-reduce, data parallelism had a centre. A **parameter server** holds the model's parameters and
the optimizer; the workers hold replicas. Each step, on ``d`` ranks of which one (the ``server``) also
computes a gradient like the others:

    1. every rank runs forward and backward on its own shard of the global batch;
    2. push:  each worker sends its gradient, M bytes, to the server;
    3. the server averages the d gradients, g = (1/d) sum_r g_r (the mean DDP computes), clips it, and
       steps the optimizer: only the server holds optimizer state;
    4. pull:  the server sends the updated parameters, M bytes again, to each worker.

So per step the server receives (d-1) M and sends (d-1) M, while each worker sends and receives M
(:func:`scalebook.accounting.comm.parameter_server_bytes_per_step`). Over all ranks that is 2 (d-1) M, as
many bytes as a ring all-reduce moves, but a ring spreads them evenly, 2 (d-1)/d M sent and as much received
by every rank, while here the server's link carries half of all of them: its load grows with d, the ring's
stays below 2 M.

:class:`ParameterServer` wraps any ``nn.Module`` and steps any ``torch.optim`` optimizer class (built on the
server only, from ``params`` or the module's trainable parameters). Only point-to-point calls move data: a
push is one ``batch_isend_irecv`` on every rank (the server's holds a receive from each worker, each
worker's its one send), a pull the same with the directions swapped, so that NCCL, which pairs a pair's
messages in issue order and runs each rank's calls one after another, could run it too
(:mod:`scalebook.comm.nccl_rules`). :func:`train_parameter_server` trains the book's GPT with it exactly as
:func:`scalebook.experiments.ddp.train_data_parallel` trains DDP (same seeds, batches, AdamW groups,
learning-rate schedule and clipping), so the two compare number for number; it counts each step's bytes
with :func:`scalebook.comm.traffic.count_traffic`, and :func:`ring_all_reduce_traffic` counts the ring's
for the same message.

Source: Li et al. 2014, "Scaling Distributed Machine Learning with the Parameter Server" (OSDI), Sec. 2-3
(servers and workers, push and pull); NCCL documentation, "Point-to-point communication" and "Group Calls".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from scalebook.comm.collectives import ring_all_reduce
from scalebook.comm.traffic import Traffic, count_traffic
from scalebook.data import corpus_tokens, get_batch
from scalebook.model import GPT, GPTConfig
from scalebook.train import TrainConfig, lr_at, weight_decay_groups


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by dtype, in order of first appearance: one flat message per group."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _run(ops: list) -> None:
    """Post ``ops`` as one batch (one NCCL group call) and wait for all of them."""
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


class ParameterServer(nn.Module):
    """Synchronous data parallelism through a server: push gradients, average and step there, pull parameters.

    ``server`` is a rank of ``process_group`` (default: the whole job) that also computes a gradient; the
    optimizer, ``optimizer_class(params, **defaults)``, exists on it alone (``self.optimizer`` is None on the
    workers). Every rank starts from the server's parameters and buffers. A training step::

        model.zero_grad()
        model(x, y).backward()   # or any loss of the wrapped module's output
        model.step()             # push_gradients(), server_step(), pull_parameters()

    After :meth:`push_gradients` the server's ``.grad`` holds the mean gradient over the ranks (a worker's
    keeps its own); :meth:`server_step` clips it to ``max_grad_norm`` if given and steps.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        *,
        params=None,
        server: int = 0,
        process_group=None,
        max_grad_norm: float | None = None,
        **defaults,
    ):
        if not dist.is_initialized():
            raise ValueError("no process group: run under scalebook.comm.launch or torchrun")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_class must be a torch.optim.Optimizer class (say torch.optim.AdamW), "
                             f"got {optimizer_class!r}")  # fmt: skip
        world_size = dist.get_world_size(process_group)
        if isinstance(server, bool) or not isinstance(server, int) or not 0 <= server < world_size:
            raise ValueError(f"server must be a rank of the group, 0 to {world_size - 1}, got {server!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be a positive norm or None, got {max_grad_norm!r}")
        trainable = [p for p in module.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("the module has no parameter that requires a gradient: there is nothing to train")
        super().__init__()
        self.module, self.group, self.server = module, process_group, server
        self.rank, self.world_size = dist.get_rank(process_group), world_size
        self.params = trainable
        self.max_grad_norm = max_grad_norm
        self.optimizer = (
            optimizer_class(trainable if params is None else params, **defaults) if self.is_server else None
        )
        with torch.no_grad():
            self._pull([*module.parameters(), *module.buffers()])

    @property
    def is_server(self) -> bool:
        return self.rank == self.server

    @property
    def workers(self) -> list[int]:
        """The group ranks other than the server."""
        return [r for r in range(self.world_size) if r != self.server]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def push_gradients(self) -> None:
        """Workers send their gradients (zeros for a parameter their backward did not reach); the server
        receives one message per worker and dtype, and its ``.grad`` becomes the mean over the d ranks."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        for same_dtype in _by_dtype(grads):
            flat = torch.cat([g.reshape(-1) for g in same_dtype])
            if not self.is_server:
                _run([dist.P2POp(dist.isend, flat, group=self.group, group_peer=self.server)])
                continue
            incoming = {w: torch.empty_like(flat) for w in self.workers}
            _run([dist.P2POp(dist.irecv, incoming[w], group=self.group, group_peer=w) for w in self.workers])
            # Divide each term first, as DDP does (a sum of means cannot overflow), and add in rank order.
            mean = torch.zeros_like(flat)
            for r in range(self.world_size):
                mean += (flat if r == self.server else incoming[r]) / self.world_size
            _unflatten_into(mean, same_dtype)
        if self.is_server:
            for p, g in zip(self.params, grads, strict=True):
                p.grad = g  # the mean (a parameter without a gradient got a zero tensor, now the mean)

    def server_step(self) -> None:
        """On the server: clip the mean gradient if asked, and take the optimizer step. Workers wait."""
        if self.is_server:
            if self.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
            self.optimizer.step()

    @torch.no_grad()
    def pull_parameters(self) -> None:
        """The server sends its parameters to every worker, one message per worker and dtype."""
        self._pull(self.params)

    def step(self) -> None:
        """One synchronous step: push, step on the server, pull."""
        self.push_gradients()
        self.server_step()
        self.pull_parameters()

    def _pull(self, tensors: list[torch.Tensor]) -> None:
        for same_dtype in _by_dtype(tensors):
            if self.is_server:
                flat = torch.cat([t.reshape(-1) for t in same_dtype])
                _run([dist.P2POp(dist.isend, flat, group=self.group, group_peer=w) for w in self.workers])
            else:
                flat = torch.empty(sum(t.numel() for t in same_dtype), dtype=same_dtype[0].dtype,
                                   device=same_dtype[0].device)  # fmt: skip
                _run([dist.P2POp(dist.irecv, flat, group=self.group, group_peer=self.server)])
                _unflatten_into(flat, same_dtype)


def bytes_received(traffic: Traffic) -> int:
    """Bytes this rank received through point-to-point calls (``recv``, ``irecv``) in ``traffic``.

    Exact for point-to-point messages; a library collective's received bytes are not recorded.
    """
    return sum(c.message_bytes for c in traffic.of("recv", "irecv"))


def _first_ranks_group(ranks: int | None):
    """(group, this rank's place in it, its size) for the first ``ranks`` ranks of the job; the group is None
    for the whole job and this rank's place is None outside it. Every rank must call it (``new_group``)."""
    world = dist.get_world_size()
    ranks = world if ranks is None else ranks
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= world:
        raise ValueError(f"ranks must be an integer from 1 to the {world} ranks of the launch, got {ranks!r}")
    group = None if ranks == world else dist.new_group(list(range(ranks)))
    rank = dist.get_rank()
    return group, (rank if rank < ranks else None), ranks


def train_parameter_server(
    model_config: GPTConfig,
    train_config: TrainConfig,
    *,
    ranks: int | None = None,
    tokens: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    keep_params: bool = False,
    keep_grads: bool = False,
) -> dict | None:
    """Train the book's GPT with a :class:`ParameterServer` (group rank 0 the server) on the first ``ranks``
    ranks of the launch (all by default); ranks outside them return None.

    As :func:`scalebook.experiments.ddp.train_data_parallel` trains DDP: each replica starts from its own seed
    (``seed + rank``), every rank draws the same global batch and keeps its rows, the server runs the book's
    AdamW (weight decay on matrices only), learning-rate schedule and clipping. Returns the global mean
    ``losses``, each step's ``bytes_sent``, ``bytes_received`` and ``calls`` on this rank (push and pull,
    counted at the sends and receives), whether this rank ``is_server``, with ``keep_grads`` the server's
    mean gradient of the first step before clipping (None on workers), and with ``keep_params`` the final
    parameters.
    """
    group, rank, ranks = _first_ranks_group(ranks)
    if rank is None:
        return None
    cfg = train_config
    tokens = corpus_tokens() if tokens is None else tokens
    torch.manual_seed(cfg.seed + rank)
    model = GPT(model_config).to(dtype)
    ps = ParameterServer(model, torch.optim.AdamW, params=weight_decay_groups(model, cfg.weight_decay),
                         process_group=group, max_grad_norm=cfg.grad_clip, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                         foreach=False)  # fmt: skip
    generator = torch.Generator().manual_seed(cfg.seed)  # the same global batches on every rank
    losses, sent, received, calls, first_grads = [], [], [], [], None
    for step in range(cfg.steps):
        for param_group in ps.optimizer.param_groups if ps.optimizer else []:
            param_group["lr"] = lr_at(step, cfg)
        x, y = get_batch(tokens, cfg.batch_size * cfg.grad_accum, cfg.seq_len, generator, rank=rank, world_size=ranks)
        ps.zero_grad()
        loss_sum = 0.0
        for xb, yb in zip(x.chunk(cfg.grad_accum), y.chunk(cfg.grad_accum), strict=True):
            _, loss = ps(xb, yb)
            (loss / cfg.grad_accum).backward()
            loss_sum += loss.item()
        losses.append(loss_sum / cfg.grad_accum)
        with count_traffic() as traffic:
            ps.push_gradients()
            if keep_grads and step == 0 and ps.is_server:
                first_grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
            ps.server_step()
            ps.pull_parameters()
        sent.append(traffic.bytes_sent())
        received.append(bytes_received(traffic))
        calls.append(traffic.count())
    mean_losses = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean_losses, group=group)  # after counting: the logged loss is the global mean
    result = {
        "losses": (mean_losses / ranks).tolist(),
        "bytes_sent": sent,
        "bytes_received": received,
        "calls": calls,
        "is_server": ps.is_server,
        "grads": first_grads,
    }
    if keep_params:
        result["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return result


def ring_all_reduce_traffic(numel: int, *, ranks: int | None = None, dtype: torch.dtype = torch.float32) -> dict | None:
    """Bytes this rank sends and receives in the book's ring all-reduce
    (:func:`scalebook.comm.collectives.ring_all_reduce`) of ``numel`` elements of ``dtype`` on the first
    ``ranks`` ranks of the launch (all by default): ``{"bytes_sent": ..., "bytes_received": ...}``, or None
    outside them."""
    group, rank, _ = _first_ranks_group(ranks)
    if rank is None:
        return None
    with count_traffic() as traffic:
        ring_all_reduce(torch.ones(numel, dtype=dtype), group)
    return {"bytes_sent": traffic.bytes_sent(), "bytes_received": bytes_received(traffic)}
