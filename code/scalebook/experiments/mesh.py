"""Chapter 14's 3-D run: data, tensor and pipeline parallelism composed on one device mesh, trained next to
one process.

:func:`train_3d` is the composition written out, in the order picotron and torchtitan apply it: the rank's
pipeline stage is cut out of the GPT (:func:`scalebook.parallel.pipeline.pipeline_stage`), made
tensor-parallel over its TP group (:func:`scalebook.parallel.tensor.apply_tensor_parallel`), and run by the
library's one 1F1B runtime over its PP group (:func:`scalebook.parallel.pipeline.run_schedule`); after the
schedule the tied embedding's two copies sum their gradients and every gradient is averaged over the DP
group. :func:`compare_3d_with_single_process` launches it and trains the same model in this process.
``python -m scalebook.train`` composes the same pieces through :func:`scalebook.parallel.parallelize`.

Source: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Sec. 3 (PTD-P); picotron ``train.py``; torchtitan ``torchtitan/models/llama3/parallelize.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from scalebook import data
from scalebook.comm import launch
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.dims import DeviceMesh, ParallelDims, tied_embedding_group
from scalebook.parallel.pipeline import build_schedule, pipeline_stage, run_schedule, sync_tied_embedding
from scalebook.parallel.tensor import apply_tensor_parallel, full_gradients, validate_tensor_parallel


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
    mesh = DeviceMesh.build(ParallelDims(dist.get_world_size(), dp=dp, tp=tp, pp=pp))
    tied_group = tied_embedding_group(mesh)  # the first and the last stage of the same (dp, tp) coordinates
    torch.manual_seed(seed)
    model = pipeline_stage(GPT(GPTConfig.named(size)), mesh.coords["pp"], pp)
    apply_tensor_parallel(model, mesh.group("tp"))
    schedule = build_schedule("1f1b", pp, microbatches)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    gen, device = torch.Generator().manual_seed(seed), next(model.parameters()).device
    losses, first_grads = [], None
    for step in range(steps):
        idx, targets = data.get_batch(data.corpus_tokens(), batch_size, seq_len, gen)  # the same everywhere
        mine = slice(mesh.coords["dp"] * batch_size // dp, (mesh.coords["dp"] + 1) * batch_size // dp)
        optimizer.zero_grad()
        loss = run_schedule(schedule, model, idx[mine].to(device), targets[mine].to(device), group=mesh.group("pp"))
        sync_tied_embedding(model, tied_group)
        for p in model.parameters():
            dist.all_reduce(p.grad, group=mesh.group("dp"))
            p.grad /= dp
        if step == 0:
            first_grads = full_gradients(model, mesh.group("tp"))
        optimizer.step()
        # Every rank learns the step's loss: the last stage has it, averaged over the replicas.
        loss = torch.zeros(1, device=device) if loss is None else loss.reshape(1)
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
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        idx, targets = data.get_batch(data.corpus_tokens(), batch_size, seq_len, gen)
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
    step), "max_grad_error": ... (first-step gradients, every rank, every parameter of its stage; the last
    stage's head against the tied matrix's gradient), "grad_scale": ... (the largest reference gradient),
    "coords": [per rank]}``. Raises if a run stopped early or a parameter of the model has no gradient on
    some stage.
    """
    check_3d(dp, tp, pp, batch_size=batch_size, microbatches=microbatches, size=size, seq_len=seq_len)
    kwargs = dict(steps=steps, batch_size=batch_size, seq_len=seq_len, size=size)
    per_rank = launch(train_3d, dp * tp * pp, dp=dp, tp=tp, pp=pp, microbatches=microbatches, timeout=timeout,
                      **kwargs)  # fmt: skip
    reference_grads = {}
    reference = single_process_losses(**kwargs, grads=reference_grads)
    errors = [abs(a - b) for r in per_rank for a, b in zip(r["losses"], reference, strict=True)]
    # The last stage's copy of the tied matrix holds, once summed with the first stage's, the tied gradient.
    stage_grads = [{"wte.weight" if name == "lm_head.weight" else name: grad for name, grad in r["first_grads"].items()}
                   for r in per_rank]  # fmt: skip
    covered = set().union(*stage_grads)
    if covered != set(reference_grads):
        raise RuntimeError(f"the stages' gradients cover {sorted(covered ^ set(reference_grads))} differently "
                           "from the single-process model")  # fmt: skip
    grad_errors = [(grad - reference_grads[name]).abs().max().item() for g in stage_grads for name, grad in g.items()]
    return {
        "losses": per_rank[0]["losses"],
        "reference": reference,
        "max_error": max(errors),
        "max_grad_error": max(grad_errors),
        "grad_scale": max(g.abs().max().item() for g in reference_grads.values()),
        "coords": [r["coords"] for r in per_rank],
    }
