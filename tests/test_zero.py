"""ZeRO-1/2/3 as PyTorch-shaped building blocks train exactly like one process on the global batch, like
``ZeroRedundancyOptimizer`` + DDP and like FSDP2's ``fully_shard``, on the book's GPT and on a module that is
not it (a frozen layer, a weight tied across two modules, a buffer, a parameter unused in forward), with SGD
and with AdamW parameter groups, in float64 and with bf16/fp16 ``MixedPrecisionPolicy``.

One 2-rank launch runs every distributed case and returns raw results; the tests below only compare.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from scalebook import accounting, data
from scalebook.comm import count_traffic, launch
from scalebook.experiments import zero as zero_runs
from scalebook.model import GPT, GPTConfig
from scalebook.parallel import zero

TINY = GPTConfig.named("tiny", n_layer=2)  # width 128: every dim 0 is a multiple of 2, nothing is padded
# Odd widths: every parameter's dim 0 (131, 27, 81, ...) is odd, so both ranks' shards are padded.
UNEVEN = GPTConfig(vocab_size=131, block_size=16, n_layer=2, n_head=3, n_embd=27)
STEPS, BATCH = 3, 2  # optimizer steps; sequences (GPT) or rows (toy) per rank and step
# float64: a different summation order leaves about 1e-16 of rounding per step; a wrong shard, offset or
# average moves a weight by about lr (1e-3 for AdamW, 1e-1 for SGD), so 1e-10 separates them by far.
TOLERANCE = 1e-10
OPTIMIZERS = {
    # SGD's step is proportional to the gradient, so a missing division by N shows in every weight.
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "betas": (0.9, 0.95), "foreach": False}),
}


class Toy(nn.Module):
    """Not the book's GPT: a frozen layer, a weight shared by two modules, a buffer, a parameter unused in forward."""

    def __init__(self, width: int = 7):
        super().__init__()
        self.encode = nn.Linear(width, width)
        self.frozen = nn.Linear(width, width).requires_grad_(False)
        self.hidden = nn.Sequential(nn.Linear(width, 2 * width + 1), nn.Tanh(), nn.Linear(2 * width + 1, width))
        self.decode = nn.Linear(width, width, bias=False)
        self.decode.weight = self.encode.weight  # tied: one Parameter in two modules (two units)
        self.register_buffer("offset", torch.randn(width))
        self.unused = nn.Parameter(torch.randn(5))  # 1-D: AdamW's no-decay group, where a zero gradient is no step

    def forward(self, x, target):
        h = torch.tanh(self.frozen(self.encode(x)))
        return F.mse_loss(self.decode(self.hidden(h)) + self.offset, target)


def _model(name: str, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return (GPT(UNEVEN) if name == "gpt" else Toy()).to(dtype)


def _batches(name: str, rank: int, world_size: int, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of each step's global batch; ``rank=0, world_size=1`` with N times the batch is all of it."""
    generator = torch.Generator().manual_seed(1)
    if name == "gpt":
        return [data.get_batch(data.corpus_tokens(), batch, 16, generator, rank=rank, world_size=world_size)
                for _ in range(STEPS)]  # fmt: skip
    rows = slice(rank * batch, (rank + 1) * batch)
    pairs = [torch.randn(2, batch * world_size, 7, generator=generator, dtype=torch.float64) for _ in range(STEPS)]
    return [(x[rows], y[rows]) for x, y in pairs]


def _loss(model, x, y):
    out = model(x, y)
    return out[1] if isinstance(out, tuple) else out


def _param_groups(model):
    """Weight decay on matrices only: the rule that needs ``p.dim()`` to survive sharding."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip


def _fsdp2_units(model):
    """FSDP2's groups: the blocks, or the toy's frozen and hidden layers (a tied weight must not be in a child)."""
    return list(model.blocks) if hasattr(model, "blocks") else [model.frozen, model.hidden]


def _wrap(model, method, opt_name, mp_policy=None):
    """The model as ``method`` trains it, and its optimizer."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    optimizer_class, options = OPTIMIZERS[opt_name]
    if method in ("zero1", "torch-zero1"):
        wrapper = zero.ZeroRedundancyOptimizer if method == "zero1" else ZeroRedundancyOptimizer
        ddp = DistributedDataParallel(model, find_unused_parameters=isinstance(model, Toy))
        return ddp, wrapper(_param_groups(model), optimizer_class=optimizer_class, **options)
    if method == "zero1-book-ddp":  # the book's DDP (Chapter 10), as the runtime composes them
        from scalebook.parallel.ddp import OverlappedDDP

        ddp = OverlappedDDP(model, find_unused_parameters=isinstance(model, Toy))
        return ddp, zero.ZeroRedundancyOptimizer(_param_groups(model), optimizer_class, **options)
    if method == "zero1-rs":
        return model, zero.ZeroRedundancyOptimizer(_param_groups(model), optimizer_class,
                                                   reduce_scatter_gradients=True, **options)  # fmt: skip
    if method.startswith(("zero2", "zero3")):
        prefetch = method.endswith("-prefetch")
        zero.fully_shard(model, stage=int(method[4]), mp_policy=mp_policy, forward_prefetch=prefetch,
                         backward_prefetch=prefetch)  # fmt: skip
    elif method.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(*((mp_policy.param_dtype, mp_policy.reduce_dtype) if mp_policy else ()))
        for module in [*_fsdp2_units(model), model]:
            fully_shard(module, mesh=mesh, reshard_after_forward=not method.startswith("fsdp2-keep"),
                        mp_policy=policy)  # fmt: skip
        if method.endswith("-prefetch"):
            _prefetch_neighbours(model, _fsdp2_units(model))
    return model, optimizer_class(_param_groups(model), **options)


def _prefetch_neighbours(root, units):
    """FSDP2's explicit prefetch: each unit gathers the next in the forward pass and the previous one in the
    backward pass; the root starts both."""
    root.set_modules_to_forward_prefetch(units[:1])
    root.set_modules_to_backward_prefetch(units[-1:])
    for i, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[i + 1 : i + 2])
        unit.set_modules_to_backward_prefetch(units[i - 1 : i] if i else [])


def _full_state(model, method) -> dict[str, torch.Tensor]:
    model = getattr(model, "module", model)  # DDP's wrapped module
    if method.startswith(("zero2", "zero3")):
        return zero.full_state_dict(model)
    state = model.state_dict()
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone() for k, v in state.items()}


def _train(name, method, opt_name, *, dtype=torch.float64, mp_policy=None, accumulate=1, max_norm=None,
           recompute=False, halve_lr=False) -> dict:  # fmt: skip
    """``STEPS`` steps of ``method``: the losses, the gradient norms before clipping, the full state after.
    ``recompute``: the GPT recomputes each block's forward inside the backward pass (activation checkpointing);
    ``halve_lr``: a scheduler halves every group's learning rate after each step."""
    world, rank = (1, 0) if method == "single" else (dist.get_world_size(), dist.get_rank())
    model = _model(name, dtype)
    model.gradient_checkpointing = recompute
    model, optimizer = _wrap(model, method, opt_name, mp_policy)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step) if halve_lr else None
    losses, norms = [], []
    for x, y in _batches(name, rank, world, BATCH * (dist.get_world_size() if method == "single" else 1)):
        with count_traffic() as traffic:  # the last step's collectives stay in `traffic`
            for i, (xs, ys) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate), strict=True)):
                if method.endswith("-nosync"):  # FSDP2's switch: reduce only in the last micro-batch
                    if method.startswith("fsdp2"):
                        model.set_requires_gradient_sync(i == accumulate - 1)
                    else:
                        zero.set_requires_gradient_sync(model, i == accumulate - 1)
                xs, ys = (t.to(dtype) if t.is_floating_point() else t for t in (xs, ys))
                loss = _loss(model, xs, ys) / accumulate
                loss.backward()
                if i == 0 and method.startswith(("zero2", "zero3")):
                    grad_bytes = zero.held_bytes(model).grads  # after the first micro-batch (the last step's)
        if hasattr(model, "sync_gradients"):
            model.sync_gradients()
        if max_norm is not None:
            clip = torch.nn.utils.clip_grad_norm_ if method == "single" else zero.clip_grad_norm_
            norms.append(clip(model.parameters(), max_norm).item())
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item() * accumulate)
    calls = [(c.op, c.message_bytes) for c in traffic.calls]
    out = {"state": _full_state(model, method), "losses": losses, "norms": norms, "calls": calls}
    return out | ({"grad_bytes": grad_bytes} if accumulate > 1 and method.startswith(("zero2", "zero3")) else {})


def _resumes_bit_identically(name, method) -> bool:
    """Two steps, save this rank's model and optimizer state, one more step; a fresh run that loads the saved
    state and takes the same third step must end with the same parameters, to the bit."""
    runs, saved = [], None
    for resume in (False, True):
        model, optimizer = _wrap(_model(name), method, "adamw")
        batches = _batches(name, dist.get_rank(), dist.get_world_size())
        if resume:
            model.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            batches = batches[2:]
        for step, (x, y) in enumerate(batches):
            _loss(model, x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 1 and not resume:
                saved = (_clone(model.state_dict()), _clone(optimizer.state_dict()))
        runs.append(_full_state(model, method))
    return all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def _clone(tree):
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree.clone() if isinstance(tree, torch.Tensor) else tree


def _bad_requests() -> dict[str, str]:
    """The message of the ValueError each bad request raises (run on every rank: some need the group)."""
    requests = {
        "stage": lambda: zero.fully_shard(_model("toy"), stage=4),
        "quantized stage 2": lambda: zero.fully_shard(_model("toy"), stage=2, quantized_gather=True),
        "policy outside": lambda: zero.fully_shard(_model("toy"), policy=[nn.Linear(2, 2)]),
        "twice": lambda: zero.fully_shard(zero.fully_shard(_model("toy"))),
        "mp_policy": lambda: zero.fully_shard(_model("toy"), mp_policy=zero.MixedPrecisionPolicy(torch.int8)),
        "optimizer class": lambda: zero.ZeroRedundancyOptimizer(
            _model("toy").parameters(), torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), lr=0.1
        ),  # fmt: skip
    }
    only_rank0 = dist.new_group([0])  # every rank must create it; rank 1 is not a member
    requests["group"] = lambda: zero.fully_shard(_model("toy"), process_group=only_rank0)
    requests["other rank's state"] = lambda: _load_other_ranks_state()
    messages = {}
    for name, request in requests.items():
        try:
            request()
            messages[name] = "no error"
        except ValueError as error:
            messages[name] = str(error)
    return messages


def _load_other_ranks_state():
    optimizer = zero.ZeroRedundancyOptimizer(_model("toy").parameters(), torch.optim.AdamW, lr=1e-3)
    state = optimizer.state_dict()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, state)
    optimizer.load_state_dict(gathered[1 - dist.get_rank()])


METHODS = ("zero1", "zero1-book-ddp", "zero1-rs", "torch-zero1", "zero2", "fsdp2-keep", "zero3", "fsdp2")
# Prefetching (ours: the next unit in the last forward's order, the previous one in the backward) and FSDP2's
# explicit prefetch of the neighbouring unit; stage 2 gathers only in the first forward after a step.
PREFETCH_METHODS = ("zero3-prefetch", "fsdp2-prefetch", "zero2-prefetch", "fsdp2-keep-prefetch", "zero3", "fsdp2")
PRECISIONS = {
    "bf16": zero.MixedPrecisionPolicy(torch.bfloat16),
    "fp16, fp32 reduce": zero.MixedPrecisionPolicy(torch.float16, torch.float32),
}


# Gradient accumulation with the reduction left to the last micro-batch, ours and FSDP2's, and FSDP2 reducing
# every micro-batch (the default, which our zero2 and zero3 do as well).
ACCUMULATE_NOSYNC = ("zero2-nosync", "zero3-nosync", "fsdp2-nosync", "fsdp2")


def run_everything() -> dict:
    out = {"runs": {}, "mixed": {}, "accumulate": {}, "clip": {}}
    for name in ("gpt", "toy"):
        for opt_name in OPTIMIZERS:
            for method in METHODS:
                out["runs"][(name, opt_name, method)] = _train(name, method, opt_name)
            if dist.get_rank() == 0:
                out["runs"][(name, opt_name, "single")] = _train(name, "single", opt_name)
        for precision, policy in PRECISIONS.items():
            for method in ("zero2", "fsdp2-keep", "zero3", "fsdp2"):
                out["mixed"][(name, precision, method)] = _train(name, method, "adamw", dtype=torch.float32,
                                                                 mp_policy=policy)  # fmt: skip
        for method in ("zero1-rs", "zero2", "zero3", "single", *ACCUMULATE_NOSYNC):
            if method != "single" or dist.get_rank() == 0:
                out["accumulate"][(name, method)] = _train(name, method, "adamw", accumulate=2)
        for method in ("zero3", "single"):
            if method != "single" or dist.get_rank() == 0:
                out["clip"][(name, method)] = _train(name, method, "sgd", max_norm=0.05)
    out["scheduled"] = {
        method: _train("toy", method, "sgd", halve_lr=True)
        for method in ("zero1", "zero1-rs", "single")
        if method != "single" or dist.get_rank() == 0
    }
    out["prefetch"] = {(name, method): _train(name, method, "adamw")
                       for name in ("gpt", "toy") for method in PREFETCH_METHODS}  # fmt: skip
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # recompute whole blocks, their hooks too
        out["recompute"] = {method: _train("gpt", method, "adamw", recompute=True)
                            for method in ("zero2", "zero3", "zero3-prefetch")}  # fmt: skip
    out["timelines"] = {prefetch: zero_runs.train(zero_runs.Recipe(TINY), "ZeRO-3", timeline=True,
                                                  forward_prefetch=prefetch, backward_prefetch=prefetch)["timelines"]
                        for prefetch in (False, True)}  # fmt: skip
    out["resume"] = {(name, method): _resumes_bit_identically(name, method)
                     for name in ("gpt", "toy") for method in ("zero1", "zero2", "zero3")}  # fmt: skip
    out["errors"] = _bad_requests()
    one_step = zero_runs.Recipe(TINY, steps=1)
    out["bytes"] = {stage: zero_runs.train(one_step, zero_runs.STAGE_METHODS[stage]) for stage in zero_runs.STAGES}
    out["bytes"]["FSDP2"] = zero_runs.train(one_step, "FSDP2")
    out["bytes"]["int8"] = zero_runs.train(one_step, "ZeRO-3", quantized_gather=True)
    return out


@pytest.fixture(scope="module")
def ranks():
    return launch(run_everything, 2, timeout=300)


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()  # the unsharded module's keys, tied and buffer entries included
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


CASES = [(name, opt) for name in ("gpt", "toy") for opt in OPTIMIZERS]


@pytest.mark.parametrize("name, opt_name", CASES)
@pytest.mark.parametrize("method", METHODS)
def test_every_method_matches_one_process_on_the_global_batch(ranks, name, opt_name, method):
    reference = ranks[0]["runs"][(name, opt_name, "single")]["state"]
    for rank in ranks:  # full_state_dict and the replicated models agree on every rank
        assert _max_difference(rank["runs"][(name, opt_name, method)]["state"], reference) < TOLERANCE


@pytest.mark.parametrize("name, opt_name", CASES)
@pytest.mark.parametrize("ours, theirs", [("zero1", "torch-zero1"), ("zero2", "fsdp2-keep"), ("zero3", "fsdp2")])
def test_each_stage_equals_its_pytorch_counterpart_bitwise(ranks, name, opt_name, ours, theirs):
    # The same averaged gradients and an elementwise optimizer: sharding changes which rank computes an
    # element, not its arithmetic. With 2 ranks, a sum of two gradients is rounded once in any order.
    runs = ranks[0]["runs"]
    assert _max_difference(runs[(name, opt_name, ours)]["state"], runs[(name, opt_name, theirs)]["state"]) == 0.0
    assert runs[(name, opt_name, ours)]["losses"] == runs[(name, opt_name, theirs)]["losses"]


@pytest.mark.parametrize("name", ["gpt", "toy"])
@pytest.mark.parametrize(
    "ours, theirs",
    [("zero3-prefetch", "fsdp2-prefetch"), ("zero2-prefetch", "fsdp2-keep-prefetch"), ("zero3-prefetch", "zero3")],
)
def test_prefetching_equals_fsdp2s_explicit_prefetch_bitwise(ranks, name, ours, theirs):
    # Prefetching changes when a unit's all-gather is issued and waited for, never what it gathers or adds.
    runs = ranks[0]["prefetch"]
    assert _max_difference(runs[(name, ours)]["state"], runs[(name, theirs)]["state"]) == 0.0
    assert runs[(name, ours)]["losses"] == runs[(name, theirs)]["losses"]


def test_prefetching_issues_fsdp2s_collectives_in_fsdp2s_order(ranks):
    # The launch's NCCL-rules check holds every rank to the same sequence; this is the sequence itself. With
    # prefetch the backward gathers the next unit before reduce-scattering the current one, as FSDP2 does.
    # (The GPT only: on the toy our default units, its four children, are not FSDP2's two.)
    for rank in ranks:
        runs = rank["prefetch"]
        assert runs[("gpt", "zero3-prefetch")]["calls"] == runs[("gpt", "fsdp2-prefetch")]["calls"]
        assert runs[("gpt", "zero3")]["calls"] != runs[("gpt", "zero3-prefetch")]["calls"]
        assert sorted(runs[("gpt", "zero3")]["calls"]) == sorted(runs[("gpt", "zero3-prefetch")]["calls"])


def _timeline(timed, kind, phase) -> dict:
    """{unit: the step's one event of ``kind`` in ``phase`` for that unit} (stage 3: one gather per unit and pass)."""
    events = [e for e in timed["events"] if e.kind == kind and e.phase == phase]
    assert len({e.unit for e in events}) == len(events)
    return {e.unit: e for e in events}


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_timeline_shows_a_prefetched_gather_in_flight_before_the_previous_unit_computes(ranks, prefetch):
    # Units: 0 the root (its computation spans the blocks'), then the blocks in forward order. The backward pass
    # runs the root first, then the blocks in reverse. Step 0 is skipped: the forward order is not known yet.
    blocks = list(range(1, TINY.n_layer + 1))
    order = {"forward": [0, *blocks], "backward": [0, *reversed(blocks)]}
    for rank in ranks:
        for timed in rank["timelines"][prefetch][1:]:
            for phase, units in order.items():
                gathers, waits = _timeline(timed, "all-gather", phase), _timeline(timed, "wait", phase)
                compute = _timeline(timed, "compute", phase)
                assert sorted(gathers) == sorted(compute) == sorted(units)
                for previous, unit in zip(units, units[1:], strict=False):
                    issued_early = gathers[unit].start < compute[previous].start
                    assert issued_early == prefetch, (phase, unit)
                for unit in units:  # a unit computes only on gathered parameters
                    assert waits[unit].end <= compute[unit].start and gathers[unit].end == waits[unit].end


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", ["gpt", "toy"])
@pytest.mark.parametrize("ours, theirs", [("zero2", "fsdp2-keep"), ("zero3", "fsdp2")])
def test_mixed_precision_equals_fsdp2_with_the_same_policy(ranks, precision, name, ours, theirs):
    # Both cast the fp32 shards to the 16-bit dtype before gathering, compute in it, reduce in reduce_dtype
    # and step fp32 shards; with 2 ranks the reduction rounds once, so the results are bitwise equal.
    mixed = ranks[0]["mixed"]
    assert _max_difference(mixed[(name, precision, ours)]["state"], mixed[(name, precision, theirs)]["state"]) == 0.0
    assert mixed[(name, precision, ours)]["losses"] == mixed[(name, precision, theirs)]["losses"]


@pytest.mark.parametrize("name", ["gpt", "toy"])
@pytest.mark.parametrize("method", ["zero1-rs", "zero2", "zero3"])
def test_gradient_accumulation_over_two_micro_batches_matches_one_process(ranks, name, method):
    runs = ranks[0]["accumulate"]
    assert _max_difference(runs[(name, method)]["state"], runs[(name, "single")]["state"]) < TOLERANCE


@pytest.mark.parametrize("name", ["gpt", "toy"])
@pytest.mark.parametrize("method", ["zero2-nosync", "zero3-nosync"])
def test_accumulating_full_gradients_until_the_last_micro_batch_matches_one_process_and_fsdp2(ranks, name, method):
    runs = ranks[0]["accumulate"]
    assert _max_difference(runs[(name, method)]["state"], runs[(name, "single")]["state"]) < TOLERANCE
    # Both sum the same micro-batch gradients (a + b == b + a in floating point) and reduce once, as FSDP2 does.
    assert _max_difference(runs[(name, method)]["state"], runs[(name, "fsdp2-nosync")]["state"]) == 0.0
    assert _max_difference(runs[(name, "zero3")]["state"], runs[(name, "fsdp2")]["state"]) == 0.0


@pytest.mark.parametrize("name", ["gpt", "toy"])
def test_accumulation_trades_reduce_scatters_for_full_gradient_memory(ranks, name):
    """Two micro-batches: reducing each sends two reduce-scatters per unit and holds a shard of the gradients after
    the first; keeping them sends one per unit and holds every trainable gradient whole (hand counts, float64)."""
    runs, model = ranks[0]["accumulate"], _model(name)
    trainable = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))  # the tied weight once
    # Units that reduce: the GPT's root and 2 blocks; the toy's root (tied weight, unused parameter), its encoder
    # (the bias; the weight is tied) and hidden layers (the frozen layer reduces nothing, the decoder owns nothing).
    units = 3
    # Kept whole: every gradient that backward produced (the toy's unused parameter gets none until the reduction).
    full = 8 * sum(p.numel() for p in trainable if not (name == "toy" and p is model.unused))
    shard = 8 * sum(-(-p.shape[0] // 2) * p[0].numel() for p in trainable)  # ceil(rows / 2) rows on each rank
    for stage in ("zero2", "zero3"):
        counts = {m: sum(op == "reduce_scatter_single" for op, _ in runs[(name, m)]["calls"])
                  for m in (stage, f"{stage}-nosync")}  # fmt: skip
        assert counts == {stage: 2 * units, f"{stage}-nosync": units}
        assert runs[(name, stage)]["grad_bytes"] == shard and runs[(name, f"{stage}-nosync")]["grad_bytes"] == full


@pytest.mark.parametrize("method", ["zero1", "zero1-rs"])
def test_a_scheduler_setting_param_groups_lr_reaches_the_wrapped_optimizer(ranks, method):
    # SGD's step is proportional to lr: a learning rate left at its first value would move every weight.
    scheduled = ranks[0]["scheduled"]
    assert _max_difference(scheduled[method]["state"], scheduled["single"]["state"]) < TOLERANCE
    assert _max_difference(scheduled["single"]["state"], ranks[0]["runs"][("toy", "sgd", "single")]["state"]) > 1e-3


@pytest.mark.parametrize("method", ["zero2", "zero3", "zero3-prefetch"])
def test_activation_checkpointing_recomputes_blocks_inside_backward_and_still_matches(ranks, method):
    # The recomputed forward of a block runs while its unit is gathered for backward: it must stay gathered.
    reference = ranks[0]["runs"][("gpt", "adamw", "single")]["state"]
    assert _max_difference(ranks[0]["recompute"][method]["state"], reference) < TOLERANCE


@pytest.mark.parametrize("name", ["gpt", "toy"])
def test_clip_grad_norm_over_shards_equals_torch_clip_on_the_whole_gradient(ranks, name):
    ours, reference = ranks[0]["clip"][(name, "zero3")], ranks[0]["clip"][(name, "single")]
    assert min(reference["norms"]) > 0.05  # every step clips
    assert ours["norms"] == pytest.approx(reference["norms"], rel=1e-12)  # fp64, summed in another order
    assert _max_difference(ours["state"], reference["state"]) < TOLERANCE


@pytest.mark.parametrize("name", ["gpt", "toy"])
@pytest.mark.parametrize("method", ["zero1", "zero2", "zero3"])
def test_state_dicts_of_each_rank_resume_training_bit_identically(ranks, name, method):
    assert all(rank["resume"][(name, method)] for rank in ranks)


@pytest.mark.parametrize(
    "request_, message",
    [
        ("stage", "stage must be 2 or 3"),
        ("quantized stage 2", "use stage=3"),
        ("policy outside", "not a submodule"),
        ("twice", "already sharded"),
        ("mp_policy", "floating dtypes"),
        ("optimizer class", "must be a torch.optim.Optimizer class"),
        ("other rank's state", "load this rank's file"),
    ],
)
def test_bad_requests_raise_one_clear_value_error(ranks, request_, message):
    for rank in ranks:
        assert message in rank["errors"][request_]


def test_a_rank_outside_the_process_group_is_refused(ranks):
    assert "not a member of process_group" in ranks[1]["errors"]["group"]


def test_without_a_process_group_both_wrappers_refuse_before_any_work():
    with pytest.raises(ValueError, match="no process group"):
        zero.fully_shard(_model("toy"))
    with pytest.raises(ValueError, match="no process group"):
        zero.ZeroRedundancyOptimizer(_model("toy").parameters(), torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("stage", zero_runs.STAGES)
def test_held_bytes_equal_model_state_bytes(ranks, stage):
    # DDP, our ZeRO-1 (reduce-scatter), fully_shard(stage=2) and (stage=3) with AdamW, after one fp32 step.
    formula = accounting.model_state_bytes(GPT(TINY).num_parameters(), zero_stage=stage, dp=2, precision="fp32")
    for rank in ranks:
        held = rank["bytes"][stage]["held"]
        assert (held.params, held.grads, held.optimizer) == (formula.params, formula.grads, formula.optimizer)


# The ring algorithm's bytes per rank for one call on an M-byte message over d ranks, written out here (not
# accounting.comm's): an all-reduce sends 2 (d - 1) / d M, an all-gather or a reduce-scatter (d - 1) / d M.
RING_FACTOR = {"all_reduce": 2, "all_gather_single": 1, "reduce_scatter_single": 1}


@pytest.mark.parametrize("stage", zero_runs.STAGES)
def test_messages_are_one_reduction_and_the_stages_all_gathers_of_every_element(ranks, stage):
    # Measured: the calls and their message sizes. Modelled: the bytes a library collective sends (its sends are
    # hidden from count_traffic, which charges each call the ring's bytes); the charge is checked against the
    # ring formula applied here to every recorded message, and against the per-step total by hand.
    psi, d = GPT(TINY).num_parameters(), 2
    reduction = "all_reduce" if stage == 0 else "reduce_scatter_single"
    gathers = {0: 0, 1: 1, 2: 1, 3: 2}[stage]  # stage 2 gathers the updated shards in the next forward
    expected = {reduction: 4 * psi} | ({"all_gather_single": gathers * 4 * psi} if gathers else {})
    # By hand, fp32 at d = 2: DDP's all-reduce 2 (1/2) 4 Psi; ZeRO-1/2 a reduce-scatter and an all-gather of
    # (1/2) 4 Psi each; ZeRO-3 one reduce-scatter and two all-gathers.
    by_hand = {0: 4 * psi, 1: 4 * psi, 2: 4 * psi, 3: 6 * psi}[stage]
    for rank in ranks:
        run = rank["bytes"][stage]
        assert run["messages"] == expected
        ring = {op: 0.0 for op in run["traffic"]}
        for op, message in run["calls"]:
            ring[op] += RING_FACTOR[op] * (d - 1) / d * message
        # rel 1e-12: the same per-call products, summed in the same order, but computed with other roundings
        assert {op: b for op, (_, b) in run["traffic"].items()} == pytest.approx(ring, rel=1e-12)
        assert sum(ring.values()) == pytest.approx(by_hand, rel=1e-12)


def test_fsdp2_sends_and_holds_exactly_our_stage3_bytes(ranks):
    for rank in ranks:
        assert rank["bytes"]["FSDP2"]["traffic"] == rank["bytes"][3]["traffic"]
        assert rank["bytes"]["FSDP2"]["held"] == rank["bytes"][3]["held"]


def test_quantized_gather_sends_int8_codes_and_one_fp32_scale_per_256_values(ranks):
    model = GPT(TINY)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    root = model.num_parameters() - TINY.n_layer * block
    blocks_per_shard = [-(-size // 2 // zero.QUANT_BLOCK) for size in [root] + [block] * TINY.n_layer]
    # Two gathers (forward, backward) per unit; each rank's piece: 256 int8 codes + a 4-byte scale per block.
    message = sum(2 * b * (zero.QUANT_BLOCK + 4) for b in blocks_per_shard)
    for rank in ranks:
        assert rank["bytes"]["int8"]["messages"]["all_gather_single"] == 2 * message
        assert rank["bytes"]["int8"]["messages"]["reduce_scatter_single"] == 4 * model.num_parameters()


def test_zero_paper_figure1_numbers():
    # Rajbhandari et al. 2020, Fig. 1: 7.5B parameters, K = 12, N_d = 64.
    published_gb = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in published_gb.items():
        total = accounting.model_state_bytes(7.5e9, zero_stage=stage, dp=64, precision="mixed").total
        assert round(total / 1e9, 1) == pytest.approx(gb)


@pytest.mark.parametrize("numel", [1000, 1050])  # whole blocks, and a last block of 50 padded with zeros
def test_int8_blockwise_quantization_matches_torch_fake_quantize(numel):
    # ZeRO++'s symmetric int8 code, one scale per block of 100: s = max |x| / 127 (the largest value of a block
    # maps to +-127), q = round(x / s). The scales are computed here, not taken from the code, and torch's own
    # fake_quantize (per channel = per block, zero point 0, range [-128, 127]) gives the dequantized values.
    torch.manual_seed(0)
    x = torch.randn(numel) * 0.02
    x[300:400] = 0.0  # an all-zero block must not divide by zero
    blocks = F.pad(x, (0, -numel % 100)).view(-1, 100)
    scales = blocks.abs().amax(dim=1) / 127
    q, got_scales = zero.quantize_int8_blockwise(x, block=100)
    assert q.dtype == torch.int8 and got_scales.dtype == torch.float32
    # Exact: the same max and one division by 127 in float32.
    assert torch.equal(got_scales, scales)
    assert got_scales[3] == 0 and torch.equal(q.view(-1, 100)[3], torch.zeros(100, dtype=torch.int8))
    nonzero = scales > 0
    codes = torch.round(blocks[nonzero] / scales[nonzero, None])
    assert codes.abs().max() == 127  # each block's largest value uses the whole range
    assert torch.equal(q.view(-1, 100)[nonzero].float(), codes)
    reference = torch.fake_quantize_per_channel_affine(
        blocks, scales, torch.zeros(len(scales), dtype=torch.int32), 0, -128, 127
    )
    # Exact: q * s in float32 on both sides.
    assert torch.equal(zero.dequantize_int8_blockwise(q, got_scales), reference.view(-1))
    assert (zero.dequantize_int8_blockwise(q, got_scales)[:numel] - x).abs().max() <= scales.max() / 2


def test_record_timeline_refuses_a_module_that_is_not_sharded():
    with pytest.raises(ValueError, match="not sharded"), zero.record_timeline(_model("toy")):
        pass
