"""Tensor and sequence parallelism: same loss and gradients as the unsharded GPT and as PyTorch's DTensor
tensor parallelism, communication and activation memory as the formulas say, bad layouts refused up front."""

import math
import time
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from scalebook import accounting, configs, data
from scalebook.comm import launch
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.sequence import all_reduce_sequence_parallel_grads
from scalebook.parallel.tensor import (
    TensorParallelGPT,
    measure_tensor_parallel,
    shard_tensor,
    tensor_parallel_layer_times,
    tensor_parallel_study,
    unshard_tensor,
    validate_tensor_parallel,
)

# fp32 throughout; the sharded sums reorder additions, which moves results by ~1e-7 relative, far below this.
TOLERANCE = 1e-5
# Gradients, each tensor relative to its own largest reference entry: rounding leaves ~1e-6 in fp32, while a
# wrong factor (a partial sum left unreduced, an average where a sum belongs) is off by order 1 in that tensor.
RELATIVE_TOLERANCE = 1e-4


def _max_relative_error(grads, reference):
    return max(((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in reference.items())


SEQ_LEN, MICRO_BATCH = 32, 2


def _batch():
    tokens = data.tokenize(data.default_corpus())
    return data.get_batch(tokens, MICRO_BATCH, SEQ_LEN, torch.Generator().manual_seed(0))


# ------------------------------------------------------------------ PyTorch's reference: DTensor TP / SP


def _interleave_qkv(w: torch.Tensor, tp: int) -> torch.Tensor:
    """Reorder the rows of the fused (3h, ...) QKV weight so that a contiguous 1/tp chunk is [Q_r; K_r; V_r]."""
    return w.unflatten(0, (3, tp, -1)).transpose(0, 1).flatten(0, 2)


def _deinterleave_qkv(w: torch.Tensor, tp: int) -> torch.Tensor:
    return w.unflatten(0, (tp, 3, -1)).transpose(0, 1).flatten(0, 2)


def _head_local_attention(self, x):
    # The model's attention infers its width from x; after ColwiseParallel each rank sees 3h/t features.
    qkv = self.c_attn(x)
    B, T, width = qkv.shape
    q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in qkv.split(width // 3, dim=2))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


def _dtensor_loss_and_grads(model: GPT, idx, targets, mesh, sp: bool):
    """Loss and full gradients of ``model`` with its blocks parallelized by torch's parallelize_module."""
    tp = mesh.size()
    with torch.no_grad():
        for block in model.blocks:
            for p in (block.attn.c_attn.weight, block.attn.c_attn.bias):
                p.copy_(_interleave_qkv(p, tp))
    for block in model.blocks:
        block.attn.n_head //= tp
        block.attn.forward = types.MethodType(_head_local_attention, block.attn)
        plan = {
            "attn.c_attn": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate()),
            "attn.c_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
            "mlp.c_fc": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate()),
            "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
        }
        if sp:
            plan |= {"ln_1": SequenceParallel(), "ln_2": SequenceParallel()}
        parallelize_module(block, mesh, plan)
    B, T = idx.shape
    x = model.wte(idx) + model.wpe(torch.arange(T))
    if sp:
        x = DTensor.from_local(x, mesh, [Replicate()]).redistribute(mesh, [Shard(1)]).to_local()
    for block in model.blocks:
        x = block(x)
    if sp:
        x = DTensor.from_local(x, mesh, [Shard(1)]).full_tensor()
    logits = model.lm_head(model.ln_f(x))
    loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(-1))
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = _deinterleave_qkv(grad, tp) if "c_attn" in name else grad
    return loss.item(), grads


def compare_with_unsharded_and_dtensor(mesh):
    """Errors of our TP and TP+SP models (over ``mesh``'s ranks) against the unsharded GPT and DTensor."""
    idx, targets = _batch()
    out = {}
    for sp in (False, True):
        torch.manual_seed(0)
        reference = GPT(GPTConfig.named("tiny"))
        _, loss = reference(idx, targets)
        loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}

        model = TensorParallelGPT.from_gpt(reference, mesh.get_group(), sequence_parallel=sp)
        logits, tp_loss = model(idx, targets)
        tp_loss.backward()
        if sp:
            all_reduce_sequence_parallel_grads(model, mesh.get_group())
        grads = model.full_gradients()

        reference.zero_grad(set_to_none=True)
        dt_loss, dt_grads = _dtensor_loss_and_grads(reference, idx, targets, mesh, sp)
        out[sp] = {
            "logits_shape": tuple(logits.shape),
            "names": sorted(grads) == sorted(ref_grads) == sorted(dt_grads),
            "loss_vs_unsharded": abs(tp_loss.item() - loss.item()),
            "loss_vs_dtensor": abs(tp_loss.item() - dt_loss),
            "grad_vs_unsharded": max((grads[n] - g).abs().max().item() for n, g in ref_grads.items()),
            "relative_grad_vs_unsharded": _max_relative_error(grads, ref_grads),
            "relative_dtensor_vs_unsharded": _max_relative_error(dt_grads, ref_grads),
            "grad_vs_dtensor": max((grads[n] - dt_grads[n]).abs().max().item() for n in ref_grads),
            "dtensor_vs_unsharded": max((dt_grads[n] - g).abs().max().item() for n, g in ref_grads.items()),
            "grad_scale": max(g.abs().max().item() for g in ref_grads.values()),
        }
    return out


def every_measurement():
    """Worker on 4 ranks: the package's study for TP = 2 and 4, and the DTensor comparisons. TP = 4 uses
    the 1-D mesh of all ranks; TP = 2 the "tp" dimension of a (2, 2) mesh, two TP groups side by side."""
    study = measure_tensor_parallel((2, 4), seq_len=SEQ_LEN, micro_batch=MICRO_BATCH)
    meshes = {4: init_device_mesh("cpu", (4,)), 2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]}
    return {"study": study, "dtensor": {tp: compare_with_unsharded_and_dtensor(mesh) for tp, mesh in meshes.items()}}


@pytest.fixture(scope="module")
def measured():
    """Rank by rank: one 4-rank launch (starting ranks costs far more than the tiny model's steps)."""
    return launch(every_measurement, 4, timeout=120)


@pytest.fixture(scope="module")
def study(measured):
    return measured[0]["study"]


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_and_sp_match_unsharded_gpt_and_dtensor_loss_and_gradients(measured, tp):
    for sp, r in measured[0]["dtensor"][tp].items():
        print(f"tp={tp} sp={sp}: " + ", ".join(f"{k}={v:.1e}" for k, v in r.items() if isinstance(v, float)))
        assert r["names"], "every parameter must have a gradient in all three models"
        # The reference must be doing real work: gradients far above the tolerance.
        assert r["grad_scale"] > 1e-2
        for key in ("loss_vs_unsharded", "loss_vs_dtensor", "grad_vs_unsharded", "grad_vs_dtensor"):
            assert r[key] < TOLERANCE, (sp, key, r[key])
        assert r["dtensor_vs_unsharded"] < TOLERANCE
        assert r["relative_grad_vs_unsharded"] < RELATIVE_TOLERANCE, (sp, r["relative_grad_vs_unsharded"])
        assert r["relative_dtensor_vs_unsharded"] < RELATIVE_TOLERANCE
        # Vocabulary-parallel head: each rank holds V/t logits per token, never the whole vocabulary.
        assert r["logits_shape"] == (MICRO_BATCH, SEQ_LEN, 256 // tp)


def test_every_rank_sees_the_same_loss_and_activation_bytes(measured):
    for key in ((2, False), (2, True), (4, False), (4, True)):
        assert len({m["study"][key]["loss"] for m in measured}) == 1
        assert len({m["study"][key]["activation_bytes"] for m in measured}) == 1
        assert measured[0]["study"][key]["grad_error"] < TOLERANCE
        assert measured[0]["study"][key]["grad_rel_error"] < RELATIVE_TOLERANCE
        assert measured[0]["study"][key]["loss_error"] < TOLERANCE


# ----------------------------------------------------------------------- communication and memory


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_layer_traffic_matches_the_formula(study, tp, sp):
    # The bytes are count_traffic's ring-algorithm charge for each recorded call: this checks the calls and
    # their sizes against the closed form (the sizes themselves: test_layer_messages_are_whole_activations).
    r = study[(tp, sp)]
    h, elem = 128, 4  # tiny GPT width, fp32
    message = SEQ_LEN * MICRO_BATCH * h * elem
    formula = accounting.tensor_parallel_bytes_per_layer(SEQ_LEN, MICRO_BATCH, h, tp, sp=sp, dtype_bytes=elem)
    if sp:
        # Forward: all-gather before attention and MLP, reduce-scatter after each; the backward swaps them
        # and all-gathers the two saved sequence shards once more.
        assert {op: n for op, (n, _) in r["layer_forward"].items()} == {
            "all_gather_single": 2, "reduce_scatter_single": 2}  # fmt: skip
        assert {op: n for op, (n, _) in r["layer_backward"].items()} == {
            "all_gather_single": 4, "reduce_scatter_single": 2}  # fmt: skip
        ring_step = (tp - 1) / tp * message
        assert r["layer_forward"]["all_gather_single"][1] == r["layer_forward"]["reduce_scatter_single"][1]
        assert sum(b for _, b in r["layer_forward"].values()) == 4 * ring_step
    else:
        assert r["layer_forward"] == {"all_reduce": (2, 2 * 2 * (tp - 1) / tp * message)}
        assert r["layer_backward"] == {"all_reduce": (2, 2 * 2 * (tp - 1) / tp * message)}
    assert sum(b for _, b in r["layer_forward"].values()) == formula["forward"]
    assert sum(b for _, b in r["layer_backward"].values()) == formula["backward"]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_layer_messages_are_whole_activations(study, tp, sp):
    # Measured by count_traffic: the sizes handed to the collectives. Every message is the s b h activation
    # (an all-gather's output, a reduce-scatter's input, an all-reduce's tensor), 4-byte elements.
    r = study[(tp, sp)]
    message = SEQ_LEN * MICRO_BATCH * 128 * 4
    if sp:
        assert r["layer_forward_messages"] == {"all_gather_single": 2 * message, "reduce_scatter_single": 2 * message}
        assert r["layer_backward_messages"] == {"all_gather_single": 4 * message, "reduce_scatter_single": 2 * message}
    else:
        assert r["layer_forward_messages"] == r["layer_backward_messages"] == {"all_reduce": 2 * message}


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_forward_moves_the_same_bytes_as_tp(study, tp):
    tp_bytes = sum(b for _, b in study[(tp, False)]["layer_forward"].values())
    sp_bytes = sum(b for _, b in study[(tp, True)]["layer_forward"].values())
    assert tp_bytes == sp_bytes > 0


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (2, True), (4, False), (4, True)])
def test_saved_activations_match_korthikanti_within_5_percent(study, tp, sp):
    cfg = configs.ModelConfig.from_gpt_config(GPTConfig.named("tiny"))
    measured = study["reference" if tp == 1 else (tp, sp)]["activation_bytes"]
    formula = accounting.activation_bytes(cfg, seq_len=SEQ_LEN, micro_batch=MICRO_BATCH, tp=tp, sp=sp,
                                          dtype_bytes=4, dropout=False)  # fmt: skip
    assert abs(measured - formula) / formula < 0.05, (measured, formula)


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_parameters_and_gradients_take_one_tp_th_per_rank(study, tp):
    full = study["reference"]["param_bytes"]
    for sp in (False, True):
        r = study[(tp, sp)]
        assert r["param_bytes"]["sharded"] * tp == full["sharded"]
        assert r["grad_bytes"]["sharded"] * tp == full["sharded"]
        assert r["param_bytes"]["replicated"] == full["replicated"]


def test_model_level_collectives_add_embedding_head_and_loss(study):
    # 4 layers x 2, plus the embedding's g, plus 3 statistics of the vocabulary-parallel cross-entropy.
    assert study[(2, False)]["model_forward"]["all_reduce"][0] == 4 * 2 + 1 + 3
    # 4 layers x 2, plus the f before the LM head.
    assert study[(2, False)]["model_backward"]["all_reduce"][0] == 4 * 2 + 1
    # Under SP the partial gradients of norms, row-parallel biases and position embeddings: one all-reduce.
    assert study[(2, True)]["grad_sync"]["all_reduce"][0] == 1
    assert study[(2, False)]["grad_sync"] == {}


# ------------------------------------------------------------------------------- layouts and sharding


def test_qkv_shard_takes_whole_heads_of_q_k_and_v():
    h, tp = 8, 2
    full = torch.arange(3 * h * 3, dtype=torch.float32).view(3 * h, 3)
    q, k, v = full.split(h)
    for rank in range(tp):
        rows = slice(rank * h // tp, (rank + 1) * h // tp)
        expected = torch.cat([q[rows], k[rows], v[rows]])
        assert torch.equal(shard_tensor(full, "qkv", rank, tp), expected)
    for layout in ("qkv", 0, 1, None):
        pieces = [shard_tensor(full, layout, r, tp) for r in range(tp)]
        assert torch.equal(unshard_tensor(pieces, layout), full)


@pytest.mark.parametrize(
    ("overrides", "tp", "sp", "seq_len", "message"),
    [
        ({}, 3, False, None, r"n_head \(4\) must be divisible by tp \(3\).*choose tp from \[1, 2, 4\]"),
        ({"n_head": 6, "n_embd": 126}, 4, False, None, r"n_head \(6\).*n_embd \(126\) must be divisible"),
        ({"vocab_size": 250}, 4, False, None, r"vocab_size \(250\) must be divisible.*pad the vocabulary to 252"),
        ({}, 4, True, 30, r"seq_len \(30\) must be divisible by tp \(4\) under sequence parallelism"),
        ({}, 2, True, None, r"pass seq_len"),
        ({"dropout": 0.1}, 2, False, None, r"dropout must be 0"),
        ({}, 2, False, 256, r"seq_len \(256\) exceeds block_size \(128\)"),
        ({}, 0, False, None, r"tp must be a positive integer"),
    ],
)
def test_invalid_layouts_raise_one_clear_value_error(overrides, tp, sp, seq_len, message):
    config = GPTConfig.named("tiny", **overrides)
    with pytest.raises(ValueError, match=message):
        validate_tensor_parallel(config, tp, sequence_parallel=sp, seq_len=seq_len)


def test_study_refuses_a_bad_layout_before_starting_any_process():
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"seq_len \(30\) must be divisible by tp \(4\)"):
        tensor_parallel_study((2, 4), seq_len=30)
    with pytest.raises(ValueError, match=r"n_head \(4\) must be divisible by tp \(8\)"):
        tensor_parallel_study((8,))
    assert time.monotonic() - start < 2.0, "validation must not launch ranks"
    assert not dist.is_initialized()


# ----------------------------------------------------------------------------------------- formulas


def test_tp_bytes_formula_by_hand():
    # s=4, b=1, h=2, 1-byte elements: M = 8 bytes. A ring all-reduce over 2 ranks sends M per rank,
    # an all-gather or a reduce-scatter M/2.
    plain = accounting.tensor_parallel_bytes_per_layer(4, 1, 2, 2, dtype_bytes=1)
    assert plain == {"forward": 16, "backward": 16}
    sp = accounting.tensor_parallel_bytes_per_layer(4, 1, 2, 2, sp=True, dtype_bytes=1)
    assert sp == {"forward": 16, "backward": 16 + 8}
    kept = accounting.tensor_parallel_bytes_per_layer(4, 1, 2, 2, sp=True, dtype_bytes=1, regather_inputs=False)
    assert kept == {"forward": 16, "backward": 16}


def test_layer_times_by_hand():
    cfg = configs.get_model("llama-2-70b")
    link = configs.get_link("nvlink-4")
    times = tensor_parallel_layer_times(cfg, 8, seq_len=4096, micro_batch=1, peak_flops=1e15, mfu=0.5,
                                        bandwidth=link.bandwidth, alpha=0.0)  # fmt: skip
    h, s = 8192, 4096
    # Llama 2 70B layer: Q and O (h x h), K and V (h x 1024: 8 KV heads of 128), SwiGLU 3 x h x 28672.
    weights = 2 * h * h + 2 * h * 1024 + 3 * h * 28672
    flops = s * 3 * (2 * weights + 4 * s * h)
    assert math.isclose(times.compute, flops / (8 * 1e15 * 0.5))
    message = s * h * 2
    assert math.isclose(times.communication, 4 * 2 * 7 / 8 * message / (450e9))
