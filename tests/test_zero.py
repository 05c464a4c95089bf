"""ZeRO stages 0-3 compute the gradients of one process and train exactly like it, like ZeroRedundancyOptimizer
and like FSDP2; they hold the bytes that ``accounting.model_state_bytes`` says, and hand their collectives the
messages whose ring cost ``accounting.comm.data_parallel_bytes_per_step`` gives.

One launch per world size (2 and 4) runs every distributed experiment and returns the raw results; the
tests below only compare. References are PyTorch's own: ``torch.optim.AdamW`` in one process on the global
batch, ``DistributedDataParallel`` + ``ZeroRedundancyOptimizer``, and FSDP2 ``fully_shard``.
"""

import pytest
import torch
import torch.distributed as dist

from scalebook import accounting
from scalebook.accounting.comm import data_parallel_bytes_per_step
from scalebook.comm import count_traffic, launch
from scalebook.model import GPT, GPTConfig
from scalebook.parallel import zero

# Every unit of TINY has a multiple of 4 elements (no padding); every unit of UNEVEN is odd, so N = 2 and
# N = 4 both pad, and the equivalence runs check the padding too.
TINY = GPTConfig.named("tiny", n_layer=2)
UNEVEN = GPTConfig(vocab_size=131, block_size=16, n_layer=2, n_head=3, n_embd=27)
STEPS = 3
# float64, so that the rounding differences of a different summation order (about 1e-14 here), which
# Adam amplifies where a gradient is near zero, stay far below the tolerance; a wrong shard, offset or
# average moves parameters by about lr = 1e-3.
TOLERANCE = 1e-6
# Gradients are compared before any update, each tensor relative to its largest single-process entry: a
# different summation order leaves about 1e-15 in float64, while a missing division by N leaves N - 1 and a
# wrong shard or offset an error of order 1. Comparing weights alone is weak: Adam's step barely depends on
# the gradient's scale, so N times the right gradient moves most weights by ~1e-9 only.
GRAD_TOLERANCE = 1e-12


def _model(cfg, dtype):
    torch.manual_seed(0)
    return GPT(cfg).to(dtype)


def _params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _max_relative_difference(grads, reference):
    """max over tensors of max |g - g_ref| / max |g_ref|."""
    assert grads.keys() == reference.keys()
    return max(((grads[k].double() - reference[k].double()).abs().max() / reference[k].double().abs().max()).item()
               for k in reference)  # fmt: skip


def _fsdp2(recipe, dtype, mp_policy=None, reshard_after_forward=True):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model(recipe.config, dtype)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = mp_policy or MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False, **recipe.adamw())
    losses, grads = [], None
    for x, y in recipe.batches(dist.get_rank(), dist.get_world_size()):
        with count_traffic() as traffic:
            _, loss = model(x, y)
            loss.backward()
        if grads is None:  # the first step's gradient, before the update (and outside the traffic count)
            grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        with count_traffic() as update:
            optimizer.step()
        traffic.calls += update.calls
        optimizer.zero_grad()
        losses.append(loss.item())
    state = [t.to_local() for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    return {
        "params": {name: p.full_tensor() for name, p in model.named_parameters()},
        "grads": grads,
        "losses": losses,
        "traffic": sum(b for _, b in traffic.by_op().values()),
        "param_bytes": sum(p.to_local().nbytes for p in model.parameters()),
        "optimizer_bytes": sum(t.nbytes for t in state),
    }


def _zero_redundancy_optimizer(recipe, dtype):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = _model(recipe.config, dtype)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, allreduce_hook)  # all-reduces from Python, so the counter sees it
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.AdamW, foreach=False, **recipe.adamw()
    )
    grads = None
    for x, y in recipe.batches(dist.get_rank(), dist.get_world_size()):
        with count_traffic() as traffic:
            ddp(x, y)[1].backward()
        grads = grads or _grads(model)  # DDP's averaged gradient of the first step
        with count_traffic() as update:
            optimizer.step()
        traffic.calls += update.calls
        optimizer.zero_grad()
    return {"params": _params(model), "grads": grads, "traffic": traffic.by_op()}


def _single_process(recipe, world_size, dtype):
    from dataclasses import replace

    model = _model(recipe.config, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False, **recipe.adamw())
    grads = None
    for x, y in replace(recipe, batch_size=recipe.batch_size * world_size).batches(0, 1):
        model(x, y)[1].backward()
        grads = grads or _grads(model)
        optimizer.step()
        optimizer.zero_grad()
    return _params(model), grads


def _one_step(cfg, stage, **options):
    engine = zero.zero_data_parallel(_model(cfg, torch.float32), stage, **options)
    recipe = zero.Recipe(cfg, steps=1, seq_len=min(32, cfg.block_size))
    (x, y), *_ = recipe.batches(dist.get_rank(), dist.get_world_size())
    with count_traffic() as traffic:
        engine.step(x, y)
    messages = {op: sum(c.message_bytes for c in traffic.of(op)) for op in {c.op for c in traffic.calls}}
    return {"held": engine.held_bytes(), "peak": engine.peak_bytes, "traffic": traffic.by_op(), "messages": messages}


def run_everything():
    """On each rank: parameters after STEPS steps of every method, and one step's bytes of every stage."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    world, rank = dist.get_world_size(), dist.get_rank()
    uneven = zero.Recipe(UNEVEN, steps=STEPS, seq_len=16)
    out = {"params": {}, "grads": {}}
    runs = {f"ZeRO-{stage}": zero.train_zero(uneven, stage, torch.float64) for stage in zero.STAGES}
    runs["ZeroRedundancyOptimizer"] = _zero_redundancy_optimizer(uneven, torch.float64)
    runs["FSDP2"] = _fsdp2(uneven, torch.float64)
    for name, run in runs.items():
        out["params"][name], out["grads"][name] = run["params"], run["grads"]
    tiny = zero.Recipe(TINY, steps=STEPS)
    ours = zero.train_zero(tiny, 3, mixed_precision=True)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    theirs = _fsdp2(tiny, torch.float32, bf16)
    out["params"]["ZeRO-3 bf16"], out["params"]["FSDP2 bf16"] = ours["params"], theirs["params"]
    out["grads"]["ZeRO-3 bf16"], out["grads"]["FSDP2 bf16"] = ours["grads"], theirs["grads"]
    out["bf16 losses"] = {"ZeRO-3": ours["losses"], "FSDP2": theirs["losses"]}
    one_step = zero.Recipe(TINY, steps=1)
    out["torch ZeRO-1 traffic"] = _zero_redundancy_optimizer(one_step, torch.float32)["traffic"]
    out["FSDP2 one step"] = {}
    for reshard in (True, None, False):
        run = _fsdp2(one_step, torch.float32, reshard_after_forward=reshard)
        out["FSDP2 one step"][reshard] = {k: run[k] for k in ("traffic", "param_bytes", "optimizer_bytes")}
    if rank == 0:
        out["params"]["single process"], out["grads"]["single process"] = _single_process(uneven, world, torch.float64)
    out["bytes"] = {
        (cfg.n_embd, precision, stage): _one_step(cfg, stage, mixed_precision=precision == "mixed")
        for cfg in (TINY, UNEVEN)
        for precision in ("fp32", "mixed")
        for stage in zero.STAGES
    }
    out["quantized"] = _one_step(TINY, 3, quantized_gather=True)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["N=2", "N=4"])
def results(request):
    return request.param, launch(run_everything, request.param, timeout=240)


def _max_difference(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _unit_sizes(cfg):
    """Elements of the root unit and of one block, counted from the model's modules."""
    model = GPT(cfg)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    return model.num_parameters() - cfg.n_layer * block, block


def _padded_count(cfg, n):
    root, block = _unit_sizes(cfg)
    return sum(n * -(-size // n) for size in [root] + [block] * cfg.n_layer)


@pytest.mark.parametrize("stage", zero.STAGES)
def test_every_stage_matches_single_process_adamw_on_the_global_batch(results, stage):
    _, ranks = results
    reference = ranks[0]["params"]["single process"]
    assert _max_difference(ranks[0]["params"][f"ZeRO-{stage}"], reference) < TOLERANCE


@pytest.mark.parametrize("method", [f"ZeRO-{stage}" for stage in zero.STAGES] + ["ZeroRedundancyOptimizer", "FSDP2"])
def test_first_step_gradients_match_single_process_before_the_update(results, method):
    _, ranks = results
    reference = ranks[0]["grads"]["single process"]
    assert min(g.abs().max().item() for g in reference.values()) > 1e-6  # every tensor has a gradient to compare
    for rank in ranks:  # every rank must hold the same averaged gradient
        assert _max_relative_difference(rank["grads"][method], reference) < GRAD_TOLERANCE, method


def test_zero3_mixed_precision_gradients_match_fsdp2_bf16_reduce(results):
    n, ranks = results
    ours, theirs = ranks[0]["grads"]["ZeRO-3 bf16"], ranks[0]["grads"]["FSDP2 bf16"]
    if n == 2:
        assert _max_relative_difference(ours, theirs) == 0.0  # one rounding of a two-term sum
    else:
        # Different owners add in different orders: up to two bf16 roundings (2 x 2^-7 relative) apart,
        # where a missing division by N would be N - 1 = 3 apart.
        assert _max_relative_difference(ours, theirs) < 2**-6


def test_zero1_matches_zero_redundancy_optimizer(results):
    _, ranks = results
    params = ranks[0]["params"]
    assert _max_difference(params["ZeRO-1"], params["ZeroRedundancyOptimizer"]) < TOLERANCE
    assert _max_difference(params["ZeroRedundancyOptimizer"], params["single process"]) < TOLERANCE


def test_zero3_matches_fsdp2_fully_shard(results):
    _, ranks = results
    params = ranks[0]["params"]
    assert _max_difference(params["ZeRO-3"], params["FSDP2"]) < TOLERANCE


def test_zero3_mixed_precision_matches_fsdp2_bf16_policy(results):
    # Both compute in bf16 from fp32 master weights and reduce the gradients in bf16.
    n, ranks = results
    ours, theirs = ranks[0]["params"]["ZeRO-3 bf16"], ranks[0]["params"]["FSDP2 bf16"]
    losses = ranks[0]["bf16 losses"]
    assert losses["ZeRO-3"][0] == losses["FSDP2"][0]  # the same bf16 forward pass
    if n == 2:
        # A sum of two gradients is rounded once, whatever the order: the results are bitwise equal.
        assert _max_difference(ours, theirs) == 0.0
    else:
        # Four ranks add in an order set by which rank owns an element, and FSDP2's per-parameter shards
        # own elements differently from our flat shards: bf16 rounding differs (about 4e-3 relative),
        # so compare the losses, which differ from an fp32 run by about 3e-4 already at the first step.
        assert max(abs(a - b) for a, b in zip(losses["ZeRO-3"], losses["FSDP2"], strict=True)) < 1e-4


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
@pytest.mark.parametrize("stage", zero.STAGES)
def test_held_bytes_equal_model_state_bytes(results, precision, stage):
    n, ranks = results
    formula = accounting.model_state_bytes(GPT(TINY).num_parameters(), zero_stage=stage, dp=n, precision=precision)
    for rank in ranks:
        held = rank["bytes"][(TINY.n_embd, precision, stage)]["held"]
        assert (held.params, held.grads, held.optimizer) == (formula.params, formula.grads, formula.optimizer)


@pytest.mark.parametrize("stage", zero.STAGES)
def test_uneven_units_pad_to_a_multiple_of_n(results, stage):
    n, ranks = results
    psi, padded = GPT(UNEVEN).num_parameters(), _padded_count(UNEVEN, n)
    assert 0 < padded - psi < (UNEVEN.n_layer + 1) * n  # fewer than N elements of padding per unit
    formula = accounting.model_state_bytes(padded, zero_stage=stage, dp=n, precision="fp32")
    held = ranks[0]["bytes"][(UNEVEN.n_embd, "fp32", stage)]["held"]
    assert (held.params, held.grads, held.optimizer) == (formula.params, formula.grads, formula.optimizer)


@pytest.mark.parametrize("precision, width", [("fp32", 4), ("mixed", 2)])
def test_peak_adds_full_copies_of_the_root_and_one_block(results, precision, width):
    # Stage 2 holds full gradients only for the units in backward, stage 3 full parameters only for the
    # units in use: the root (tied embedding and head, needed at both ends) and one block at a time.
    _, ranks = results
    root, block = _unit_sizes(TINY)
    states = ranks[0]["bytes"]
    stage2, stage3 = states[(TINY.n_embd, precision, 2)], states[(TINY.n_embd, precision, 3)]
    assert stage2["peak"].grads - stage2["held"].grads == (root + block) * width
    assert stage3["peak"].grads - stage3["held"].grads == (root + block) * width
    assert stage3["peak"].params - stage3["held"].params == (root + block) * width
    assert stage2["peak"].params == stage2["held"].params


@pytest.mark.parametrize("cfg", [TINY, UNEVEN], ids=["tiny", "uneven"])
@pytest.mark.parametrize("precision, width", [("fp32", 4), ("mixed", 2)])
@pytest.mark.parametrize("stage", zero.STAGES)
def test_messages_are_one_reduction_and_the_stages_all_gathers_of_every_element(results, cfg, precision, width, stage):
    # Measured by count_traffic: the size of every message handed to a collective.
    n, ranks = results
    padded = _padded_count(cfg, n)
    reduction = "all_reduce" if stage == 0 else "reduce_scatter_single"
    gathers = {0: 0, 1: 1, 2: 1, 3: 2}[stage]
    expected = {reduction: width * padded} | ({"all_gather_single": gathers * width * padded} if gathers else {})
    for rank in ranks:
        assert rank["bytes"][(cfg.n_embd, precision, stage)]["messages"] == expected


@pytest.mark.parametrize("cfg", [TINY, UNEVEN], ids=["tiny", "uneven"])
@pytest.mark.parametrize("precision, width", [("fp32", 4), ("mixed", 2)])
@pytest.mark.parametrize("stage", zero.STAGES)
def test_ring_cost_of_the_calls_equals_data_parallel_bytes_per_step(results, cfg, precision, width, stage):
    # count_traffic charges each recorded collective call the ring algorithm's bytes for its message size:
    # this checks the calls and sizes against the closed form, not a measured byte count on the wire.
    n, ranks = results
    padded = _padded_count(cfg, n)  # the flat messages include the padding
    formula = data_parallel_bytes_per_step(padded, n, zero_stage=stage, grad_bytes=width, param_bytes=width)
    for rank in ranks:
        traffic = rank["bytes"][(cfg.n_embd, precision, stage)]["traffic"]
        assert sum(sent for _, sent in traffic.values()) == formula
    expected_ops = {"all_reduce"} if stage == 0 else {"reduce_scatter_single", "all_gather_single"}
    assert set(traffic) == expected_ops


def test_pytorch_zero1_all_reduces_then_broadcasts_one_and_a_half_times_ddp(results):
    n, ranks = results
    psi = GPT(TINY).num_parameters()
    for rank in ranks:
        traffic = rank["torch ZeRO-1 traffic"]
        assert set(traffic) == {"all_reduce", "broadcast"}
        assert traffic["all_reduce"][1] == data_parallel_bytes_per_step(psi, n, zero_stage=0)
        assert traffic["broadcast"][1] == 4 * psi * (n - 1) / n  # each parameter once, from its owner


def test_fsdp2_sends_our_stage3_bytes_unless_it_keeps_parameters_gathered(results):
    n, ranks = results
    psi = GPT(TINY).num_parameters()
    root, _ = _unit_sizes(TINY)
    root_gather = 4 * root * (n - 1) / n
    for rank in ranks:
        runs = rank["FSDP2 one step"]
        assert runs[True]["traffic"] == data_parallel_bytes_per_step(psi, n, zero_stage=3)
        assert runs[None]["traffic"] == data_parallel_bytes_per_step(psi, n, zero_stage=3) - root_gather
        assert runs[False]["traffic"] == data_parallel_bytes_per_step(psi, n, zero_stage=2)


def test_fsdp2_holds_our_stage3_parameter_and_adam_bytes(results):
    n, ranks = results
    for rank in ranks:
        ours = rank["bytes"][(TINY.n_embd, "fp32", 3)]["held"]
        assert rank["FSDP2 one step"][True]["param_bytes"] == ours.params
        assert rank["FSDP2 one step"][True]["optimizer_bytes"] == ours.optimizer


def test_quantized_gather_sends_int8_codes_and_one_fp32_scale_per_256_values(results):
    n, ranks = results
    root, block = _unit_sizes(TINY)
    blocks_per_shard = [-(-size // n // zero.QUANT_BLOCK) for size in [root] + [block] * TINY.n_layer]
    # Two gathers (forward, backward) per unit; each rank's piece: 256 int8 codes + a 4-byte scale per block.
    message = sum(n * b * (zero.QUANT_BLOCK + 4) for b in blocks_per_shard)
    traffic = ranks[0]["quantized"]["traffic"]
    assert traffic["all_gather_single"][1] == 2 * message * (n - 1) / n
    plain = ranks[0]["bytes"][(TINY.n_embd, "fp32", 3)]["traffic"]["all_gather_single"][1]
    assert 3.8 < plain / traffic["all_gather_single"][1] < 4.0


def test_zero3_sends_one_and_a_half_times_ddp():
    # ZeRO paper, Sec. 7.2: DDP and ZeRO-1/2 move 2 Psi per rank, ZeRO-3 3 Psi (times (N-1)/N).
    psi, n = 1000, 4
    assert data_parallel_bytes_per_step(psi, n, zero_stage=0) == 2 * 3 / 4 * psi * 4
    assert data_parallel_bytes_per_step(psi, n, zero_stage=1) == 2 * 3 / 4 * psi * 4
    assert data_parallel_bytes_per_step(psi, n, zero_stage=2) == 2 * 3 / 4 * psi * 4
    assert data_parallel_bytes_per_step(psi, n, zero_stage=3) == 3 * 3 / 4 * psi * 4
    assert data_parallel_bytes_per_step(psi, n, zero_stage=1, grad_bytes=4, param_bytes=2) == 3 / 4 * psi * 6


def test_zero_paper_figure1_numbers():
    # Rajbhandari et al. 2020, Fig. 1: 7.5B parameters, K = 12, N_d = 64.
    published_gb = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in published_gb.items():
        total = accounting.model_state_bytes(7.5e9, zero_stage=stage, dp=64, precision="mixed").total
        assert round(total / 1e9, 1) == pytest.approx(gb)


def test_int8_blockwise_quantization_matches_torch_fake_quantize():
    torch.manual_seed(0)
    x = torch.randn(1000) * 0.02
    x[300:400] = 0.0  # an all-zero block must not divide by zero
    q, scales = zero.quantize_int8_blockwise(x, block=100)
    reference = torch.fake_quantize_per_channel_affine(
        x.view(10, 100), scales, torch.zeros(10, dtype=torch.int32), 0, -128, 127
    )
    assert q.dtype == torch.int8 and scales.shape == (10,)
    assert torch.equal(zero.dequantize_int8_blockwise(q, scales), reference.view(-1))
    assert (zero.dequantize_int8_blockwise(q, scales) - x).abs().max() <= scales.max() / 2


def test_adam_update_matches_torch_adamw():
    torch.manual_seed(0)
    param, grads = torch.randn(50), [torch.randn(50) for _ in range(3)]
    reference = torch.nn.Parameter(param.clone())
    optimizer = torch.optim.AdamW([reference], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    exp_avg, exp_avg_sq = torch.zeros(50), torch.zeros(50)
    for step, grad in enumerate(grads, start=1):
        reference.grad = grad
        optimizer.step()
        zero.adam_update(param, grad, exp_avg, exp_avg_sq, step=step, lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                         weight_decay=0.1)  # fmt: skip
    assert torch.equal(param, reference.detach())


def test_flat_unit_pads_to_a_multiple_of_the_world_size():
    params = [torch.nn.Parameter(torch.zeros(3, 5)), torch.nn.Parameter(torch.zeros(4))]
    unit = zero.FlatUnit(torch.nn.Module(), [("a", params[0]), ("b", params[1])], world_size=4, rank=3)
    assert (unit.numel, unit.shard_numel, unit.padded_numel) == (19, 5, 20)
    assert unit.owned == slice(15, 20)
    flat = unit.flatten([torch.ones(3, 5), torch.full((4,), 2.0)], torch.float32)
    assert flat.tolist() == [1.0] * 15 + [2.0] * 4 + [0.0]


def test_bad_requests_raise_value_error_before_any_work():
    model = GPT(TINY)
    with pytest.raises(ValueError, match="stage must be one of"):
        zero.zero_data_parallel(model, 4)
    with pytest.raises(ValueError, match="use stage=3"):
        zero.zero_data_parallel(model, 2, quantized_gather=True)
    with pytest.raises(ValueError, match="no process group"):
        zero.zero_data_parallel(model, 1)
