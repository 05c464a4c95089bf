"""An N-D device mesh: DP x TP x PP (x CP, with EP folded into DP), rank coordinates and process groups.

A layout is a factorization of the world into degrees, ``world = pp * dp * cp * tp``. Ranks are laid
out as in Megatron-LM with tensor parallelism innermost, so that the tp ranks of one group are
consecutive (on one node, where the fast links are), then context, then data, and pipeline outermost:

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

Expert parallelism does not multiply the world: as in torchtitan and Megatron-LM, the experts are
sharded over ``ep`` of the data-parallel ranks (``ep`` must divide ``dp``), which hold different tokens
anyway. For every dimension, the ranks whose other coordinates agree form one process group; every rank
must create every group, in the same order (``torch.distributed.new_group`` is collective).

:func:`train_3d` composes the book's pieces on such a mesh: :class:`scalebook.parallel.tensor.TensorParallelGPT`
inside each pipeline stage, the action lists of :func:`scalebook.parallel.pipeline.build_schedule`, and a
gradient all-reduce over the data-parallel group. The pipeline runtime of Chapter 13 addresses ranks by
their global number in a world of ``pp`` ranks, so this module carries a small adapter runtime that maps
stages to ranks through the mesh instead.
``python -m scalebook.train --strategy 3d`` (:mod:`scalebook.cli`) trains with the same pieces.

Source: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Sec. 3 (PTD-P); Megatron-LM ``megatron/core/parallel_state.py`` (rank order
tp-cp-ep-dp-pp); torchtitan ``torchtitan/distributed/parallel_dims.py`` (``ParallelDims`` validation).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from scalebook import data
from scalebook.comm import launch
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.dims import DIMS, DeviceMesh, ParallelDims, tied_embedding_group  # noqa: F401
from scalebook.parallel.pipeline import build_schedule, stage_layers
from scalebook.parallel.tensor import (
    TensorParallelGPT,
    copy_to_tensor_parallel_region,
    sharding_of,
    unshard_tensor,
    validate_tensor_parallel,
    vocab_parallel_cross_entropy,
)

# -------------------------------------------------------------------------- 3-D training: DP x TP x PP


class TensorParallelStage(nn.Module):
    """Pipeline stage ``layers`` of a :class:`~scalebook.parallel.tensor.TensorParallelGPT`: its blocks,
    the embeddings on the first stage, and the final norm and the (vocabulary-parallel, tied) head on the
    last."""

    def __init__(self, tp_model: TensorParallelGPT, layers: range, *, first: bool, last: bool):
        super().__init__()
        self.first, self.last, self.group = first, last, tp_model.group
        self.blocks = nn.ModuleDict({str(i): tp_model.blocks[i] for i in layers})
        if first:
            self.wte, self.wpe = tp_model.wte, tp_model.wpe
        if last:
            self.ln_f = tp_model.ln_f
            # The head is tied to the embedding: the last stage keeps its own copy of this rank's shard.
            self.head = tp_model.wte

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if not self.last:
            return x
        logits = torch.nn.functional.linear(copy_to_tensor_parallel_region(self.ln_f(x), self.group), self.head.weight)
        B, T, _ = logits.shape
        losses = vocab_parallel_cross_entropy(logits.reshape(B * T, -1), targets.reshape(-1), self.head.vocab_start,
                                              self.group)  # fmt: skip
        return losses.mean()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters in the unsharded GPT's layout and names, the head (the embedding's copy)
        left out; a collective over the stage's tensor-parallel group."""
        return self._unsharded({name: param.detach() for name, param in self.named_parameters()})

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """This stage's gradients in the unsharded GPT's layout and names, like :meth:`full_state_dict`;
        a replicated parameter's gradient is this rank's own copy. A collective over the TP group."""
        return self._unsharded({name: param.grad.detach() for name, param in self.named_parameters()})

    def _unsharded(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tp, full = dist.get_world_size(self.group), {}
        for name, tensor in tensors.items():
            if name == "head.weight":
                continue
            layout = sharding_of(name)
            if layout is None:
                full[name] = tensor.clone()
                continue
            pieces = [torch.empty_like(tensor) for _ in range(tp)]
            dist.all_gather(pieces, tensor.contiguous(), group=self.group)
            full[name] = unshard_tensor(pieces, layout)
        return full


def _run_pipeline_step(mesh: DeviceMesh, stage: TensorParallelStage, inputs, targets, microbatches: int) -> float:
    """One batch through this rank's stage with the 1F1B action list; returns the batch loss (last stage)."""
    pp, stage_index = mesh.dims.pp, mesh.coords["pp"]
    schedule = build_schedule("1f1b", pp, microbatches)
    x_mbs, y_mbs = inputs.chunk(microbatches), targets.chunk(microbatches)
    width = next(iter(stage.blocks.values())).ln_1.normalized_shape[0]
    shape = (*x_mbs[0].shape, width)
    kept_inputs, kept_outputs, losses, sends = {}, {}, [], []
    for action in schedule.actions[stage_index]:
        m = action.microbatch
        if action.kind == "F":
            if stage.first:
                x = x_mbs[m]
            else:
                x = torch.empty(shape, device=inputs.device)
                dist.recv(x, src=mesh.neighbour("pp", -1), tag=m)
                x.requires_grad_()
            out = stage(x, y_mbs[m]) if stage.last else stage(x)
            if stage.last:
                losses.append(out.detach())
                out = out / microbatches  # the batch loss is the mean over micro-batches
            else:
                sends.append(dist.isend(out.detach(), dst=mesh.neighbour("pp", 1), tag=m))
            kept_inputs[m], kept_outputs[m] = x, out
        else:
            grad = None
            if not stage.last:
                grad = torch.empty(shape, device=inputs.device)
                dist.recv(grad, src=mesh.neighbour("pp", 1), tag=microbatches + m)
            torch.autograd.backward(kept_outputs.pop(m), grad)
            x = kept_inputs.pop(m)
            if not stage.first:
                sends.append(dist.isend(x.grad, dst=mesh.neighbour("pp", -1), tag=microbatches + m))
    for work in sends:
        work.wait()
    return float(torch.stack(losses).mean()) if losses else float("nan")


def train_3d(
    *, dp: int, tp: int, pp: int, steps: int = 3, batch_size: int = 8, seq_len: int = 32, microbatches: int = 2,
    size: str = "tiny", lr: float = 1e-3, seed: int = 0,
) -> dict:  # fmt: skip
    """On every rank (launch on dp * tp * pp ranks): train the GPT with DP x TP x PP; return this rank's
    coordinates, the loss of every step (the mean over the global batch; on every rank) and the first
    step's gradients of this rank's stage, unsharded (the gradients AdamW is given).

    The global batch of ``batch_size`` sequences is split over the dp replicas, each replica's share
    into ``microbatches`` micro-batches that go through the pp stages (1F1B); inside a stage every layer
    is tensor-parallel over tp ranks. After the backward pass the tied embedding's two copies (first and
    last stage) sum their gradients, every gradient is averaged over dp, and AdamW steps.
    """
    dims = ParallelDims(dist.get_world_size(), dp=dp, tp=tp, pp=pp)
    mesh = DeviceMesh.build(dims)
    tied_group = tied_embedding_group(mesh)  # the first and the last stage of the same (dp, tp) coordinates
    torch.manual_seed(seed)
    config = GPTConfig.named(size)
    tp_model = TensorParallelGPT.from_gpt(GPT(config), mesh.group("tp"))
    layers = stage_layers(config.n_layer, pp)[mesh.coords["pp"]]
    stage = TensorParallelStage(tp_model, layers, first=mesh.coords["pp"] == 0, last=mesh.coords["pp"] == pp - 1)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=lr)
    tokens = data.tokenize(data.default_corpus())
    gen = torch.Generator().manual_seed(seed)
    losses, first_grads = [], None
    for step in range(steps):
        idx, targets = data.get_batch(tokens, batch_size, seq_len, gen)  # the same global batch everywhere
        mine = slice(mesh.coords["dp"] * batch_size // dp, (mesh.coords["dp"] + 1) * batch_size // dp)
        optimizer.zero_grad()
        loss = torch.tensor([_run_pipeline_step(mesh, stage, idx[mine], targets[mine], microbatches)])
        if pp > 1 and (stage.first or stage.last):
            dist.all_reduce(tp_model.wte.weight.grad, group=tied_group)
        for p in stage.parameters():
            dist.all_reduce(p.grad, group=mesh.group("dp"))
            p.grad /= dp
        if step == 0:
            first_grads = stage.full_grad_dict()
        optimizer.step()
        # Every rank learns the step's loss: the last stage has it, averaged over the replicas.
        loss = loss if stage.last else torch.zeros(1)
        dist.all_reduce(loss, group=mesh.group("pp"))
        dist.all_reduce(loss, group=mesh.group("dp"))
        losses.append(loss.item() / dp)
    return {"coords": mesh.coords, "losses": losses, "first_grads": first_grads}


def single_process_losses(
    *, steps: int = 3, batch_size: int = 8, seq_len: int = 32, size: str = "tiny", lr: float = 1e-3, seed: int = 0,
    grads: dict | None = None,
) -> list[float]:  # fmt: skip
    """The reference for :func:`train_3d`: the same GPT, batches and AdamW in one process. If ``grads`` is
    a dict, the first step's gradients are copied into it by parameter name."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig.named(size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    tokens = data.tokenize(data.default_corpus())
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        idx, targets = data.get_batch(tokens, batch_size, seq_len, gen)
        optimizer.zero_grad()
        _, loss = model(idx, targets)
        loss.backward()
        if step == 0 and grads is not None:
            grads.update({name: p.grad.detach().clone() for name, p in model.named_parameters()})
        optimizer.step()
        losses.append(loss.item())
    return losses


def check_3d(dp: int, tp: int, pp: int, *, batch_size: int, microbatches: int, size: str, seq_len: int) -> None:
    """Raise one ValueError for a layout :func:`train_3d` cannot run, before any process starts."""
    ParallelDims(dp * tp * pp, dp=dp, tp=tp, pp=pp)
    config = GPTConfig.named(size)
    validate_tensor_parallel(config, tp, seq_len=seq_len)
    problems = []
    if config.n_layer % pp:
        problems.append(f"n_layer ({config.n_layer}) must be divisible by pp ({pp})")
    if batch_size % (dp * microbatches):
        problems.append(f"batch_size ({batch_size}) must be divisible by dp * microbatches ({dp * microbatches})")
    if problems:
        raise ValueError("invalid 3-D run: " + "; ".join(problems))


def compare_3d_with_single_process(
    dp: int = 2, tp: int = 2, pp: int = 2, *, steps: int = 3, batch_size: int = 8, seq_len: int = 32,
    microbatches: int = 2, size: str = "tiny", timeout: float = 300.0,
) -> dict:  # fmt: skip
    """Launch :func:`train_3d` on dp * tp * pp ranks and train the same model in this process.

    Returns ``{"losses": [...] (rank 0's), "reference": [...], "max_error": ... (losses, every rank and
    step), "max_grad_error": ... (first-step gradients, every rank, every parameter of its stage),
    "grad_scale": ... (the largest reference gradient), "coords": [per rank]}``. Raises if a run stopped
    early or a parameter of the model has no gradient on some stage.
    """
    check_3d(dp, tp, pp, batch_size=batch_size, microbatches=microbatches, size=size, seq_len=seq_len)
    kwargs = dict(steps=steps, batch_size=batch_size, seq_len=seq_len, size=size)
    per_rank = launch(train_3d, dp * tp * pp, dp=dp, tp=tp, pp=pp, microbatches=microbatches, timeout=timeout,
                      **kwargs)  # fmt: skip
    reference_grads = {}
    reference = single_process_losses(**kwargs, grads=reference_grads)
    errors = [abs(a - b) for r in per_rank for a, b in zip(r["losses"], reference, strict=True)]
    covered = set().union(*(r["first_grads"] for r in per_rank))
    if covered != set(reference_grads):
        raise RuntimeError(f"the stages' gradients cover {sorted(covered ^ set(reference_grads))} differently "
                           "from the single-process model")  # fmt: skip
    grad_errors = [
        (grad - reference_grads[name]).abs().max().item() for r in per_rank for name, grad in r["first_grads"].items()
    ]
    return {
        "losses": per_rank[0]["losses"],
        "reference": reference,
        "max_error": max(errors),
        "max_grad_error": max(grad_errors),
        "grad_scale": max(g.abs().max().item() for g in reference_grads.values()),
        "coords": [r["coords"] for r in per_rank],
    }
