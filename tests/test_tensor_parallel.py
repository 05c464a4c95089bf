"""Tensor and sequence parallelism: the book's GPT made tensor-parallel in place gives the same loss, gradients and
AdamW training as the unsharded GPT and as PyTorch's DTensor tensor parallelism, on a whole model and on a
pipeline stage; communication and activation memory are as the formulas say; bad layouts are refused up front."""

import copy
import math
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from scalebook import accounting, configs, data
from scalebook.accounting.async_tp import decomposed_transfers
from scalebook.comm import launch
from scalebook.experiments.tensor import (
    dtensor_full_gradients,
    dtensor_tensor_parallel,
    measure_tensor_parallel,
    sharded_copy,
    tensor_parallel_groups,
    tensor_parallel_layer_times,
    tensor_parallel_study,
)
from scalebook.model import GPT, GPTConfig
from scalebook.parallel import pipeline
from scalebook.parallel.sequence import all_reduce_sequence_parallel_grads
from scalebook.parallel.tensor import (
    apply_tensor_parallel,
    full_gradients,
    full_state_dict,
    shard_tensor,
    unshard_tensor,
    validate_tensor_parallel,
)
from scalebook.parity import max_relative_difference

# fp32 throughout; the sharded sums reorder additions, which moves results by ~1e-7 relative, far below this.
TOLERANCE = 1e-5
# Gradients, each tensor relative to its own largest reference entry: rounding leaves ~1e-6 in fp32, while a
# wrong factor (a partial sum left unreduced, an average where a sum belongs) is off by order 1 in that tensor.
RELATIVE_TOLERANCE = 1e-4
SEQ_LEN, MICRO_BATCH, STEPS, LR = 32, 2, 3, 1e-3


def _batch(seed=0):
    return data.get_batch(data.corpus_tokens(), MICRO_BATCH, SEQ_LEN, torch.Generator().manual_seed(seed))


def _reference():
    torch.manual_seed(0)
    return GPT(GPTConfig.named("tiny"))


def _loss_and_grads(model, batch):
    _, loss = model(*batch)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------------------ the workers (one launch)


def compare_with_unsharded_and_dtensor(mesh) -> dict:
    """Errors of our TP and TP+SP GPT (over ``mesh``'s ranks) against the unsharded GPT and DTensor's."""
    batch, group, tp = _batch(), mesh.get_group(), mesh.size()
    out = {}
    for sp in (False, True):
        reference = _reference()
        model = sharded_copy(reference, group, sequence_parallel=sp)
        dtensor = dtensor_tensor_parallel(copy.deepcopy(reference), mesh, sequence_parallel=sp)
        loss, ref_grads = _loss_and_grads(reference, batch)
        logits, tp_loss = model(*batch)
        tp_loss.backward()
        if sp:
            all_reduce_sequence_parallel_grads(model, group)
        grads = full_gradients(model, group)
        _, dt_loss = dtensor(*batch)
        dt_loss.backward()
        dt_grads = dtensor_full_gradients(dtensor, tp)
        out[sp] = {
            "logits_shape": tuple(logits.shape),
            "names": sorted(grads) == sorted(ref_grads) == sorted(dt_grads),
            "loss_vs_unsharded": abs(tp_loss.item() - loss),
            "loss_vs_dtensor": abs(tp_loss.item() - dt_loss.item()),
            "grad_vs_unsharded": max_relative_difference(grads, ref_grads),
            "grad_vs_dtensor": max_relative_difference(grads, dt_grads),
            "dtensor_vs_unsharded": max_relative_difference(dt_grads, ref_grads),
            "grad_scale": max(g.abs().max().item() for g in ref_grads.values()),
        }
    return out


def _adamw_losses(model, batches, group=None, sp=False) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(*batch)
        loss.backward()
        if sp:
            all_reduce_sequence_parallel_grads(model, group)
        optimizer.step()
        losses.append(loss.item())
    return losses


def adamw_training_and_state(group) -> dict:
    """STEPS AdamW steps of the sharded GPT (each rank its shards) against one process training the whole GPT;
    and ``full_state_dict`` of a freshly sharded model against the state_dict it came from."""
    batches = [_batch(seed) for seed in range(STEPS)]
    reference = _reference()
    out = {"fresh": {}, "trained": {}}
    for sp in (False, True):
        state = full_state_dict(sharded_copy(reference, group, sequence_parallel=sp), group)
        source = reference.state_dict()
        out["fresh"][sp] = (
            list(state) == list(source),
            max((state[n] - v).abs().max().item() for n, v in source.items()),
        )
    for sp in (False, True):
        model = sharded_copy(reference, group, sequence_parallel=sp)
        losses = _adamw_losses(model, batches, group, sp)
        out["trained"][sp] = (losses, full_state_dict(model, group))
    out["reference"] = (_adamw_losses(reference, batches), reference.state_dict())
    return out


def two_pipeline_stages(group, sp: bool) -> dict:
    """The two stages of a 2-stage pipeline (Chapter 13's ``pipeline_stage``: the first without ``ln_f`` and
    head, the last without ``wte``, whose head keeps the tied matrix), each made tensor-parallel and run one
    after the other: the first stage's hidden states, the loss and every gradient are the unsharded GPT's
    (the tied matrix's as the sum of its two copies' gradients, as the pipeline syncs them), and the two
    stages' full states together are its state_dict."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    reference, batch = _reference(), _batch()
    hidden = pipeline.pipeline_stage(copy.deepcopy(reference), 0, 2)(batch[0]).detach()
    first, last = (pipeline.pipeline_stage(copy.deepcopy(reference), stage, 2) for stage in (0, 1))
    loss, ref_grads = _loss_and_grads(reference, batch)
    for stage in (first, last):
        apply_tensor_parallel(stage, group, sequence_parallel=sp)
    x = first(batch[0])
    logits, tp_loss = last(x, batch[1])
    tp_loss.backward()
    if sp:
        for stage in (first, last):
            all_reduce_sequence_parallel_grads(stage, group)
    grads = full_gradients(first, group) | full_gradients(last, group)
    grads["wte.weight"] = grads["wte.weight"] + grads.pop("lm_head.weight")
    state = full_state_dict(first, group) | full_state_dict(last, group)
    # Under SP a stage's output holds this rank's T/t tokens of the sequence.
    return {
        "head": type(last.lm_head).__name__,
        "hidden_error": (x - (hidden.chunk(tp, dim=1)[rank] if sp else hidden)).abs().max().item(),
        "logits_shape": tuple(logits.shape),
        "loss_error": abs(tp_loss.item() - loss),
        "grad_error": max_relative_difference(grads, ref_grads),
        "state_names": sorted(state) == sorted(reference.state_dict()),
        "state_error": max((state[n] - v).abs().max().item() for n, v in reference.state_dict().items()),
    }


def refused_layout(group) -> dict:
    """apply_tensor_parallel on a GPT whose 6 heads do not split over 4 ranks: the error, and the model untouched."""
    model = GPT(GPTConfig.named("tiny", n_head=6, n_embd=120))
    try:
        apply_tensor_parallel(model, group)
    except ValueError as err:
        return {"error": str(err), "untouched": type(model.blocks[0].attn.c_attn) is nn.Linear}
    return {"error": None}


def every_measurement() -> dict:
    """Worker on 4 ranks. TP = 4 uses the 1-D mesh of all ranks; TP = 2 the "tp" dimension of a (2, 2) mesh,
    two tensor-parallel groups side by side, so that a rank's place in its group differs from its global rank."""
    study = measure_tensor_parallel((2, 4), seq_len=SEQ_LEN, micro_batch=MICRO_BATCH)
    meshes = {4: init_device_mesh("cpu", (4,)), 2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]}
    pairs = tensor_parallel_groups(2)
    return {
        "study": study,
        "dtensor": {tp: compare_with_unsharded_and_dtensor(mesh) for tp, mesh in meshes.items()},
        "adamw": adamw_training_and_state(pairs),
        "stages": {sp: two_pipeline_stages(pairs, sp) for sp in (False, True)},
        "refused": refused_layout(meshes[4].get_group()),
    }


@pytest.fixture(scope="module")
def measured():
    """Rank by rank: one 4-rank launch (starting ranks costs far more than the tiny model's steps)."""
    return launch(every_measurement, 4, timeout=120)


@pytest.fixture(scope="module")
def study(measured):
    return measured[0]["study"]


# ------------------------------------------------------------------------------------- same numbers


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_and_sp_match_unsharded_gpt_and_dtensor_loss_and_gradients(measured, tp):
    for sp, r in measured[0]["dtensor"][tp].items():
        print(f"tp={tp} sp={sp}: " + ", ".join(f"{k}={v:.1e}" for k, v in r.items() if isinstance(v, float)))
        assert r["names"], "every parameter must have a gradient in all three models"
        # The reference must be doing real work: gradients far above the tolerance.
        assert r["grad_scale"] > 1e-2
        assert r["loss_vs_unsharded"] < TOLERANCE and r["loss_vs_dtensor"] < TOLERANCE, (sp, r)
        for key in ("grad_vs_unsharded", "grad_vs_dtensor", "dtensor_vs_unsharded"):
            assert r[key] < RELATIVE_TOLERANCE, (sp, key, r[key])
        # Vocabulary-parallel head: each rank holds V/t logits per token, never the whole vocabulary.
        assert r["logits_shape"] == (MICRO_BATCH, SEQ_LEN, 256 // tp)


def test_every_rank_sees_the_same_loss_and_activation_bytes(measured):
    for key in ((2, False), (2, True), (4, False), (4, True)):
        assert len({m["study"][key]["loss"] for m in measured}) == 1
        assert len({m["study"][key]["activation_bytes"] for m in measured}) == 1
        assert measured[0]["study"][key]["grad_rel_error"] < RELATIVE_TOLERANCE
        assert measured[0]["study"][key]["loss_error"] < TOLERANCE


@pytest.mark.parametrize("sp", [False, True])
def test_full_state_dict_of_a_sharded_gpt_is_the_state_dict_it_came_from(measured, sp):
    for rank in range(4):
        same_names, error = measured[rank]["adamw"]["fresh"][sp]
        assert same_names, "same keys, in the same order (the tied head included), as GPT.state_dict()"
        assert error == 0.0  # shards are copies and gathering is concatenation: exact


@pytest.mark.parametrize("sp", [False, True])
def test_adamw_on_the_shards_trains_like_one_process(measured, sp):
    ref_losses, ref_state = measured[0]["adamw"]["reference"]
    for rank in range(4):
        losses, state = measured[rank]["adamw"]["trained"][sp]
        # Losses agree to rounding: the sharded sums reorder additions (~1e-7).
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < TOLERANCE
        assert losses[-1] < losses[0]  # it does train
        # Adam divides each gradient by its running RMS, so an element whose gradient is near eps (1e-8) turns
        # the ~1e-9 rounding of that gradient into an update a few percent of LR apart (3e-5 measured). A weight
        # updated twice per step (a tied one) or never would be off by about LR per step: 10x the bound.
        diff = max((state[n] - v).abs().max().item() for n, v in ref_state.items())
        assert diff < LR / 10, (rank, diff)


@pytest.mark.parametrize("sp", [False, True])
def test_pipeline_stages_run_tensor_parallel_like_the_unsharded_gpt(measured, sp):
    for rank in range(4):
        r = measured[rank]["stages"][sp]
        assert r["head"] == "ColumnParallelLinear"  # on the last stage, holding the vocabulary shard without wte
        assert r["logits_shape"] == (MICRO_BATCH, SEQ_LEN, 128)
        assert r["hidden_error"] < TOLERANCE and r["loss_error"] < TOLERANCE, r
        assert r["grad_error"] < RELATIVE_TOLERANCE, r
        assert r["state_names"] and r["state_error"] == 0.0


def test_apply_refuses_heads_that_do_not_split_before_touching_the_model(measured):
    r = measured[0]["refused"]
    assert r["error"] is not None and "n_head (6) must be divisible by tp (4)" in r["error"]
    assert r["untouched"]


def test_apply_refuses_a_module_that_is_not_a_gpt():
    with pytest.raises(ValueError, match=r"scalebook.model.GPT"):
        apply_tensor_parallel(nn.Linear(4, 4))


# ----------------------------------------------------------------------- communication and memory


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_layer_calls_charged_the_ring_bytes_by_hand_and_the_closed_form_agrees(study, tp, sp):
    # Measured: each call and its message size. Modelled: the bytes. A library collective's sends are hidden, so
    # count_traffic charges each call what the ring algorithm sends per rank; here that charge is written out
    # from the s b h message: (t - 1) / t of it for an all-gather or a reduce-scatter, 2 (t - 1) / t for an
    # all-reduce. Exact equality: (t - 1) / t is 1/2 or 3/4, exact in binary, and the message an integer.
    r = study[(tp, sp)]
    h, elem = 128, 4  # tiny GPT width, fp32
    message = SEQ_LEN * MICRO_BATCH * h * elem
    ring_step = (tp - 1) / tp * message  # one all-gather or reduce-scatter of the activation
    if sp:
        # Forward: all-gather before attention and MLP, reduce-scatter after each; the backward swaps them
        # and all-gathers the two saved sequence shards once more.
        assert r["layer_forward"] == {"all_gather_single": (2, 2 * ring_step),
                                      "reduce_scatter_single": (2, 2 * ring_step)}  # fmt: skip
        assert r["layer_backward"] == {"all_gather_single": (4, 4 * ring_step),
                                       "reduce_scatter_single": (2, 2 * ring_step)}  # fmt: skip
    else:
        # One all-reduce after attention and one after the MLP (forward), their conjugates in the backward.
        assert r["layer_forward"] == {"all_reduce": (2, 2 * 2 * ring_step)}
        assert r["layer_backward"] == {"all_reduce": (2, 2 * 2 * ring_step)}
    # accounting's closed form gives the same bytes as the hand count above (forward 4, backward 4 or 6 ring steps).
    formula = accounting.tensor_parallel_bytes_per_layer(SEQ_LEN, MICRO_BATCH, h, tp, sp=sp, dtype_bytes=elem)
    assert (formula["forward"], formula["backward"]) == (4 * ring_step, (6 if sp else 4) * ring_step)


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
        ({"n_experts": 4}, 2, False, None, r"n_experts \(4\) must be 0.*expert parallelism"),
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


@pytest.mark.parametrize("tp", [2, 4])
def test_decomposed_all_gather_and_reduce_scatter_match_the_library_mlp_in_t_minus_1_shard_messages(study, tp):
    r = study[("async", tp)]
    # Real weights: the decomposed matmuls add the same products in other groupings (~1e-7 relative in fp32).
    assert r["max_error"] <= 1e-6 * r["scale"], (r["max_error"], r["scale"])
    assert r["exact"]  # whole-number inputs and weights: identical to the undecomposed all-gather/reduce-scatter
    h, elem = 128, 4
    message = SEQ_LEN * MICRO_BATCH * h * elem  # the gathered input; the reduce-scatter's input has the same size
    shards = decomposed_transfers(message, tp)
    assert r["gather_messages"] == r["scatter_messages"] == shards == [message / tp] * (tp - 1)
    # The same bytes as the library's all-gather and reduce-scatter, cut into tp - 1 steps.
    assert r["library"] == {"all_gather_single": (1, sum(shards)), "reduce_scatter_single": (1, sum(shards))}
    assert r["gather_sent"] == r["scatter_sent"] == sum(shards)


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
