"""Chapter 12's experiments on tensor and sequence parallelism: parity, traffic, memory and time per layer.

The library (:mod:`scalebook.parallel.tensor`, :mod:`scalebook.parallel.sequence`) makes the book's GPT
tensor-parallel in place. Here it runs on the ranks of a launch (:func:`scalebook.comm.launch`):

* :func:`measure_tensor_parallel` compares TP and TP+SP with the unsharded GPT (loss, every gradient) and
  records the collectives, saved activations and parameter bytes of each layout; :func:`tensor_parallel_study`
  validates the layouts and launches it;
* :func:`dtensor_tensor_parallel` applies PyTorch's own tensor parallelism (``parallelize_module`` with
  ``ColwiseParallel``, ``RowwiseParallel`` and ``SequenceParallel``) to the same GPT, the reference the tests
  and the benchmark compare with;
* :func:`tensor_parallel_layer_times` prices one layer's compute and communication on real hardware with the
  alpha-beta model, which is why tensor parallelism stays inside a node.

Source: Shoeybi et al. 2019, "Megatron-LM", Sec. 3; Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", Sec. 4; PyTorch, ``torch.distributed.tensor.parallel``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from scalebook import data, measure
from scalebook.accounting.comm import alpha_beta_time
from scalebook.accounting.params import layer_matmul_weights
from scalebook.comm import count_traffic, launch
from scalebook.configs import ModelConfig
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.sequence import (
    all_reduce_sequence_parallel_grads,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from scalebook.parallel.tensor import apply_tensor_parallel, full_gradients, sharding_of, validate_tensor_parallel
from scalebook.parity import max_relative_difference

# ----------------------------------------------------------------------------- time: why TP stays in a node


@dataclass(frozen=True)
class LayerTimes:
    """Seconds one Transformer layer spends per micro-batch (forward + backward) on one tensor-parallel rank."""

    compute: float
    communication: float

    @property
    def communication_fraction(self) -> float:
        """Share of the step spent communicating if nothing overlaps: comm / (compute + comm)."""
        return self.communication / (self.compute + self.communication)


def tensor_parallel_layer_times(
    cfg: ModelConfig,
    tp: int,
    *,
    seq_len: int,
    micro_batch: int,
    peak_flops: float,
    mfu: float,
    bandwidth: float,
    alpha: float,
    dtype_bytes: int = 2,
) -> LayerTimes:
    """Compute and communication time of one layer's forward and backward pass under tensor parallelism.

    Compute: the layer's training FLOPs, ``3 (2 W + 4 s h)`` per token (W its matmul weights, as in
    :func:`scalebook.accounting.flops_per_token`), split over ``tp`` ranks running at ``mfu`` of
    ``peak_flops``. Communication: four ring all-reduces of the ``s b h`` activations (two forward, two
    backward) over ``tp`` ranks in the alpha-beta model, on a link of ``bandwidth`` B/s per direction with
    latency ``alpha`` s. Sequence parallelism moves the same bytes in the same number of ring steps.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be a fraction in (0, 1], got {mfu!r}")
    tokens, h = seq_len * micro_batch, cfg.d_model
    flops = tokens * 3 * (2 * layer_matmul_weights(cfg) + 4 * seq_len * h)
    message = tokens * h * dtype_bytes
    comm = 4 * alpha_beta_time("all_reduce", message, tp, alpha=alpha, bandwidth=bandwidth)
    return LayerTimes(compute=flops / (tp * peak_flops * mfu), communication=comm)


# ------------------------------------------------------------------- PyTorch's reference: DTensor TP / SP


def _interleave_qkv(w: torch.Tensor, tp: int) -> torch.Tensor:
    """Reorder the rows of the fused (3h, ...) QKV weight so that a contiguous 1/tp chunk is [Q_r; K_r; V_r]."""
    return w.unflatten(0, (3, tp, -1)).transpose(0, 1).flatten(0, 2)


def _deinterleave_qkv(w: torch.Tensor, tp: int) -> torch.Tensor:
    return w.unflatten(0, (tp, 3, -1)).transpose(0, 1).flatten(0, 2)


def dtensor_tensor_parallel(model: GPT, mesh, *, sequence_parallel: bool = False) -> GPT:
    """``model``'s blocks made tensor-parallel by PyTorch's ``parallelize_module`` over the 1-D ``mesh``, in
    place: the reference for :func:`scalebook.parallel.tensor.apply_tensor_parallel`.

    ColwiseParallel shards ``c_attn`` by contiguous rows, so its Q, K and V rows are interleaved first (a
    chunk is then this rank's heads of all three) and the model's attention runs unchanged on the local
    ``3h/t`` features. The embeddings and the head stay replicated. Under sequence parallelism the blocks'
    LayerNorms run on sequence shards: the first block's input is split along the sequence and the final
    LayerNorm's input gathered. Read the gradients with :func:`dtensor_full_gradients`.
    """
    tp, sp = mesh.size(), sequence_parallel
    with torch.no_grad():
        for block in model.blocks:
            for p in (block.attn.c_attn.weight, block.attn.c_attn.bias):
                p.copy_(_interleave_qkv(p, tp))
    layout, local = Shard(1) if sp else Replicate(), {"use_local_output": True}
    plan = {
        "blocks.*.attn.c_attn": ColwiseParallel(input_layouts=layout),
        "blocks.*.attn.c_proj": RowwiseParallel(output_layouts=layout),
        "blocks.*.mlp.c_fc": ColwiseParallel(input_layouts=layout),
        "blocks.*.mlp.c_proj": RowwiseParallel(output_layouts=layout),
    }
    if sp:  # the residual stream between the blocks is a plain tensor holding this rank's tokens
        plan |= {
            "blocks.*.ln_1": SequenceParallel(),
            "blocks.*.ln_2": SequenceParallel(),
            "blocks.0": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1), **local),
            "ln_f": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(), **local),
        }
    return parallelize_module(model, mesh, plan)


def dtensor_full_gradients(model: GPT, tp: int) -> dict[str, torch.Tensor]:
    """Gradients of a :func:`dtensor_tensor_parallel` model in the unsharded GPT's layout (a collective)."""
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = _deinterleave_qkv(grad, tp) if "c_attn" in name else grad
    return grads


# -------------------------------------------------------------- async TP: a collective decomposed into steps


def _ring_step(outgoing: torch.Tensor, incoming: torch.Tensor, group) -> list:
    """Post one ring step, send ``outgoing`` to the next rank and receive ``incoming`` from the previous one, in
    one ``batch_isend_irecv`` (as NCCL needs); returns the works to wait for, so compute can run meanwhile."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    return dist.batch_isend_irecv([
        dist.P2POp(dist.irecv, incoming, group=group, group_peer=(rank - 1) % tp),
        dist.P2POp(dist.isend, outgoing, group=group, group_peer=(rank + 1) % tp),
    ])  # fmt: skip


def all_gather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, group=None):
    """``F.linear(all-gather of x_shard along the sequence, weight, bias)``, the all-gather decomposed into
    ``t - 1`` ring steps and each step's transfer overlapped with the matmul of the shard already here.

    ``x_shard`` is this rank's ``(b, s/t, h)`` tokens; the result is ``(b, s, out)``, the tokens in rank order,
    as a column-parallel layer under sequence parallelism computes it. At step ``k`` this rank holds rank
    ``r - k``'s shard: it posts the shard to rank ``r + 1`` and the receive of rank ``r - k - 1``'s, multiplies,
    then waits. Forward only (async TP's idea; PyTorch's ``fused_all_gather_matmul`` does the same on GPUs).
    """
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    pieces: list[torch.Tensor | None] = [None] * tp
    current = x_shard.contiguous()
    for step in range(tp):
        works, incoming = [], None
        if step < tp - 1:  # the next shard travels while this one is multiplied
            incoming = torch.empty_like(current)
            works = _ring_step(current, incoming, group)
        pieces[(rank - step) % tp] = F.linear(current, weight, bias)
        for work in works:
            work.wait()
        current = incoming
    return torch.cat(pieces, dim=1)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, group=None):
    """This rank's ``(b, s/t, out)`` tokens of ``sum over ranks of F.linear(x, weight)``, plus ``bias``: a
    row-parallel layer's matmul and reduce-scatter under sequence parallelism, decomposed by tokens.

    At step ``k`` this rank multiplies the tokens of rank ``r - k - 1``, adds the running sum received from
    rank ``r - 1`` and sends it on to rank ``r + 1``; the transfer overlaps the next step's matmul. After
    ``t - 1`` steps the sum that arrives is this rank's own tokens'. Forward only.
    """
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = x.chunk(tp, dim=1)
    works, received, outgoing = [], None, None
    for step in range(tp):
        total = F.linear(chunks[(rank - step - 1) % tp], weight)  # overlaps the transfer posted last step
        for work in works:
            work.wait()
        if received is not None:
            total = received + total
        if step < tp - 1:
            outgoing, received = total, torch.empty_like(total)
            works = _ring_step(outgoing, received, group)
    return total if bias is None else total + bias


# ---------------------------------------------------------------------------------- measuring it on ranks


def _traffic_by_op(traffic) -> dict[str, tuple[int, float]]:
    """``{op: (calls, bytes sent)}``; a library collective's bytes are the ring algorithm's for its message."""
    return {op: (count, float(sent)) for op, (count, sent) in traffic.by_op().items()}


def _bytes_by_sharding(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Bytes of the tensors of sharded parameters and of replicated ones, by the parameter names."""
    sharded = [t for name, t in tensors.items() if sharding_of(name) is not None]
    replicated = [t for name, t in tensors.items() if sharding_of(name) is None]
    return {"sharded": measure.tensor_bytes(sharded), "replicated": measure.tensor_bytes(replicated)}


def tensor_parallel_groups(tp: int):
    """This rank's group of ``tp`` consecutive ranks (every rank creates every group, in the same order)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for first in range(0, world, tp):
        group = dist.new_group(list(range(first, first + tp)))
        if first <= rank < first + tp:
            mine = group
    return mine


def sharded_copy(model: GPT, group, *, sequence_parallel: bool = False) -> GPT:
    """A tensor-parallel copy of ``model`` (which is left whole), with no gradients yet."""
    copied = copy.deepcopy(model)
    copied.zero_grad(set_to_none=True)
    return apply_tensor_parallel(copied, group, sequence_parallel=sequence_parallel)


def _check_study(config: GPTConfig, tps: tuple[int, ...], world: int, seq_len: int, micro_batch: int) -> None:
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    for tp in tps:
        validate_tensor_parallel(config, tp, sequence_parallel=True, seq_len=seq_len)
    if any(world % tp for tp in tps):
        raise ValueError(f"every tensor-parallel size in {tps} must divide the number of ranks ({world})")


def _measure_layout(reference: GPT, ref_loss: float, ref_grads: dict, batch, group, sp: bool, seed: int) -> dict:
    """One layout's loss, gradient errors, traffic (whole model and one block alone) and bytes on this rank."""
    idx, targets = batch
    tp = dist.get_world_size(group)
    model = sharded_copy(reference, group, sequence_parallel=sp)
    saved = measure.saved_activation_bytes(model, batch, layers=model.blocks)
    with count_traffic() as forward:
        logits, loss = model(idx, targets)
    with count_traffic() as backward:
        loss.backward()
    with count_traffic() as grad_sync:
        if sp:
            all_reduce_sequence_parallel_grads(model, group)
    grads = full_gradients(model, group)
    # One block alone: the per-layer traffic, free of the embedding, the head and the loss.
    shape = (idx.shape[0], idx.shape[1] // tp if sp else idx.shape[1], reference.config.n_embd)
    block_input = torch.randn(shape, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    with count_traffic() as layer_forward:
        out = model.blocks[0](block_input)
    with count_traffic() as layer_backward:
        out.backward(torch.ones_like(out))
    params = dict(model.named_parameters())
    return {
        "loss": loss.item(),
        "loss_error": abs(loss.item() - ref_loss),
        "grad_error": max((grads[n] - g).abs().max().item() for n, g in ref_grads.items()),
        "grad_rel_error": max_relative_difference(grads, ref_grads),
        "logits_shape": tuple(logits.shape),
        "activation_bytes": saved.in_layers,
        "layer_forward": _traffic_by_op(layer_forward),
        "layer_backward": _traffic_by_op(layer_backward),
        "layer_forward_messages": layer_forward.message_bytes_by_op(),
        "layer_backward_messages": layer_backward.message_bytes_by_op(),
        "model_forward": _traffic_by_op(forward),
        "model_backward": _traffic_by_op(backward),
        "grad_sync": _traffic_by_op(grad_sync),
        "param_bytes": _bytes_by_sharding(params),
        "grad_bytes": _bytes_by_sharding({n: p.grad for n, p in params.items()}),
    }


def _integer_valued(shape, generator) -> torch.Tensor:
    """Small whole numbers as float32: every product and sum of them is exact, in any order."""
    return torch.randint(-3, 4, shape, generator=generator).float()


def measure_decomposed_mlp(reference: GPT, group, *, seq_len: int, micro_batch: int, seed: int = 0) -> dict:
    """Async TP's decomposed collectives on this rank against the library's sequence-parallel MLP.

    With the first block's MLP of ``reference`` made tensor- and sequence-parallel over ``group``, and the same
    ``(b, s, h)`` input drawn on every rank (each keeps its ``s/t`` tokens): the largest difference between
    :func:`all_gather_matmul` + GeLU + :func:`matmul_reduce_scatter` and the MLP module (which all-gathers,
    multiplies, reduce-scatters); whether both decomposed functions give exactly the undecomposed results on
    integer-valued inputs and weights; and the messages each sent (``isend`` sizes) and the bytes of the
    library collectives they replace, as :func:`scalebook.comm.traffic.count_traffic` recorded them.
    """
    tp, rank, h = dist.get_world_size(group), dist.get_rank(group), reference.config.n_embd
    mlp = sharded_copy(reference, group, sequence_parallel=True).blocks[0].mlp
    generator = torch.Generator().manual_seed(seed)
    x_shard = torch.randn(micro_batch, seq_len, h, generator=generator).chunk(tp, dim=1)[rank]
    with torch.no_grad():
        with count_traffic() as library:
            plain = mlp(x_shard)  # the module gathers its input; c_proj reduce-scatters
        with count_traffic() as gather:
            hidden = all_gather_matmul(x_shard, mlp.c_fc.weight, mlp.c_fc.bias, group)
        with count_traffic() as scatter:
            decomposed = matmul_reduce_scatter(mlp.gelu(hidden), mlp.c_proj.weight, mlp.c_proj.bias, group)
        # Exactness: whole numbers, so any order of the sums gives the same floats. The input is one tensor cut
        # by tokens; each rank's weights and row-parallel input are its own.
        x_int = _integer_valued((micro_batch, seq_len, h), generator).chunk(tp, dim=1)[rank]
        own = torch.Generator().manual_seed(seed + 1 + rank)
        w_in, w_out = _integer_valued(mlp.c_fc.weight.shape, own), _integer_valued(mlp.c_proj.weight.shape, own)
        y_int = _integer_valued((micro_batch, seq_len, w_out.shape[1]), own)
        gathered = F.linear(gather_from_sequence_parallel_region(x_int, group), w_in)
        exact_gather = torch.equal(all_gather_matmul(x_int, w_in, None, group), gathered)
        scattered = reduce_scatter_to_sequence_parallel_region(F.linear(y_int, w_out), group)
        exact_scatter = torch.equal(matmul_reduce_scatter(y_int, w_out, None, group), scattered)
    return {
        "max_error": (decomposed - plain).abs().max().item(),
        "scale": plain.abs().max().item(),
        "exact": exact_gather and exact_scatter,
        "gather_messages": [c.message_bytes for c in gather.of("isend")],
        "scatter_messages": [c.message_bytes for c in scatter.of("isend")],
        "gather_sent": gather.bytes_sent(),
        "scatter_sent": scatter.bytes_sent(),
        "library": _traffic_by_op(library),
    }  # fmt: skip


def measure_tensor_parallel(
    tps: tuple[int, ...] = (2, 4), *, size: str = "tiny", seq_len: int = 64, micro_batch: int = 4, seed: int = 0
) -> dict:
    """Run on ``max(tps)`` ranks (:func:`scalebook.comm.launch`): compare TP and TP+SP with the unsharded GPT.

    Every rank builds the same GPT and batch of real text, computes the reference loss and gradients,
    then for each ``tp`` in ``tps`` (groups of consecutive ranks) and with and without sequence
    parallelism: the loss and gathered gradients of the sharded model and their largest deviation from
    the reference (``grad_error`` absolute, ``grad_rel_error`` by :func:`scalebook.parity.max_relative_difference`); the
    communication calls, message bytes and ring bytes sent of one block's forward and backward pass and
    of the whole model; the activation bytes saved for backward inside the blocks; the parameter bytes. And
    for each ``tp``, async TP's decomposed MLP against the library's (:func:`measure_decomposed_mlp`).
    Returns ``{"reference": {...}, (tp, sp): {...}, ("async", tp): {...}, ...}`` as seen by this rank.
    """
    torch.manual_seed(seed)
    config = GPTConfig.named(size)
    _check_study(config, tps, dist.get_world_size(), seq_len, micro_batch)
    reference = GPT(config)
    batch = data.get_batch(data.corpus_tokens(), micro_batch, seq_len, torch.Generator().manual_seed(seed))
    saved = measure.saved_activation_bytes(reference, batch, layers=reference.blocks)
    _, ref_loss = reference(*batch)
    ref_loss.backward()
    ref_params = dict(reference.named_parameters())
    ref_grads = {name: p.grad for name, p in ref_params.items()}
    results = {
        "reference": {
            "loss": ref_loss.item(),
            "activation_bytes": saved.in_layers,
            "param_bytes": _bytes_by_sharding(ref_params),
            "logits_shape": (micro_batch, seq_len, config.vocab_size),
        }
    }
    groups = {tp: tensor_parallel_groups(tp) for tp in tps}
    for tp in tps:
        for sp in (False, True):
            results[(tp, sp)] = _measure_layout(reference, ref_loss.item(), ref_grads, batch, groups[tp], sp, seed)
        results[("async", tp)] = measure_decomposed_mlp(reference, groups[tp], seq_len=seq_len,
                                                        micro_batch=micro_batch, seed=seed)  # fmt: skip
    return results


def tensor_parallel_study(
    tps: tuple[int, ...] = (2, 4),
    *,
    size: str = "tiny",
    seq_len: int = 64,
    micro_batch: int = 4,
    seed: int = 0,
    timeout: float = 300.0,
) -> dict:
    """Check every layout, then run :func:`measure_tensor_parallel` on ``max(tps)`` fresh ranks.

    An impossible layout raises ValueError here, before any process starts. Returns rank 0's results.
    """
    tps = tuple(tps)
    if not tps:
        raise ValueError("tps must name at least one tensor-parallel size, e.g. (2, 4)")
    _check_study(GPTConfig.named(size), tps, max(tps), seq_len, micro_batch)
    results = launch(measure_tensor_parallel, max(tps), tps, size=size, seq_len=seq_len,
                     micro_batch=micro_batch, seed=seed, timeout=timeout)  # fmt: skip
    return results[0]
