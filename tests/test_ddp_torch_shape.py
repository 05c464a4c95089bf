"""The book's DDP has torch DDP's shape: a loop written for torch DDP (``loss.backward(); optimizer.step()``, with
or without ``no_sync()`` accumulation) trains exactly as under torch DDP, because the gradients are averaged by
the time ``backward()`` returns; a model with parameters of two dtypes works; ``sync_gradients()`` is harmless.

Why bit for bit is the right bar on 2 ranks: both implementations divide each local gradient by 2 (exact in
binary floating point, short of subnormals) and gloo adds the two halves, and for two terms ``a + b`` is ``b + a``
exactly. So every element's average is the same bits whatever the bucket layout, the order of the buckets or
the bucket size (torch DDP rebuilds its buckets after the first step; ours never do). On 4 ranks gloo's ring
adds each element in an order set by its offset in the flat buffer, so exactness would need torch's bucket
layout step by step: test_ddp.py compares 4 ranks with torch DDP at a tolerance instead.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from scalebook.comm import count_traffic, launch
from scalebook.parallel.ddp import AllReduceDDP, BucketedDDP, OverlappedDDP, assign_buckets

OURS = {"allreduce": AllReduceDDP, "bucketed": BucketedDDP, "overlapped": OverlappedDDP}
CAP_MB = 0.002  # about 2 KiB: each model below fills several buckets, so their order and launch times matter
STEPS = 3
WORLD = 2
# What a loop does with the wrapper each step: "torch" is the loop written for torch DDP, one backward per step;
# "no_sync" accumulates two micro-batches, the first under no_sync(); "legacy" is the torch loop plus two calls
# to sync_gradients() after backward (an old loop's call site); "pipeline" runs both micro-batches under
# no_sync() and then calls sync_gradients(), as a pipeline schedule does (ours only).
LOOPS = ("torch", "no_sync", "legacy", "pipeline")


class Net(nn.Module):
    """A small non-GPT module in one dtype (fp32) or two: with ``mixed``, the hidden layers are bfloat16 and
    the normalisation and the head float32 (an fp32-norm / bf16-linear model)."""

    def __init__(self, mixed: bool, width: int = 24, classes: int = 10):
        super().__init__()
        low = torch.bfloat16 if mixed else torch.float32
        self.inner = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width)).to(low)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x, y):
        h = self.inner(x.to(self.inner[0].weight.dtype)).float()
        return F.cross_entropy(self.head(self.norm(h)), y)


def wrap(version: str, model: nn.Module) -> nn.Module:
    if version == "torch":
        return DistributedDataParallel(model, bucket_cap_mb=CAP_MB)
    kwargs = {} if version == "allreduce" else {"bucket_cap_mb": CAP_MB}
    return OURS[version](model, **kwargs)


def train(version: str, loop: str, mixed: bool) -> dict:
    """``STEPS`` SGD steps of ``Net`` on this rank under ``version`` driven by ``loop``; each step's averaged
    gradients as the optimizer receives them, the final parameters, and the all-reduce calls per step."""
    rank = dist.get_rank()
    torch.manual_seed(rank)  # different weights on every rank: only the wrapper's broadcast makes them equal
    model = Net(mixed)
    wrapped = wrap(version, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    grads, calls = [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        micro = 1 if loop in ("torch", "legacy") else 2
        with count_traffic() as traffic:
            for i in range(micro):
                x, y = torch.randn(4, 24, generator=generator), torch.randint(0, 10, (4,), generator=generator)
                local = loop == "pipeline" or i < micro - 1
                with wrapped.no_sync() if local else contextlib.nullcontext():
                    (wrapped(x, y) / micro).backward()
            if loop == "legacy" and version != "torch":
                wrapped.sync_gradients()
                wrapped.sync_gradients()
            if loop == "pipeline":
                wrapped.sync_gradients()
        calls.append(len(traffic.of("all_reduce")))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}, "calls": calls}


def event_order(version: str) -> list[tuple[str, str]]:
    """One backward pass of the mixed model under ``version``, as a list of events in the order they happened:
    ("grad", name) when a parameter's gradient is ready, ("launch", i) / ("done", i) when bucket i's all-reduce
    starts / completes (recorded by a communication hook), and ("returned", "") when backward() returns."""
    torch.manual_seed(0)
    model = Net(mixed=True)
    wrapped = wrap(version, model)
    events = []

    def recording_hook(state, bucket):
        events.append(("launch", str(bucket.index())))
        tensor = bucket.buffer().div_(WORLD)

        def done(future):
            events.append(("done", str(bucket.index())))
            return future.value()[0]

        return dist.all_reduce(tensor, async_op=True).get_future().then(done)

    wrapped.register_comm_hook(None, recording_hook)
    for name, p in model.named_parameters():  # registered after the wrapper's hooks, so they run after them
        p.register_post_accumulate_grad_hook(lambda p, name=name: events.append(("grad", name)))
    x, y = torch.randn(4, 24), torch.randint(0, 10, (4,))
    wrapped(x, y).backward()
    events.append(("returned", ""))
    return events


class RaiseInBackward(torch.autograd.Function):
    """The identity whose backward raises, as an out-of-memory error inside backward would."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("planted failure inside backward")


def after_a_failed_backward(version: str) -> str:
    """A backward pass that raises after the head's gradients are ready (their hooks have run), then the next
    forward: the error it raises, or "" if it trains on (the engine never ran the pass's callback, so that
    wrapper would never average again, silently)."""
    model = Net(mixed=False)
    wrapped = wrap(version, model)
    x, y = torch.randn(4, 24), torch.randint(0, 10, (4,))
    handle = model.norm.register_forward_hook(lambda module, inputs, output: RaiseInBackward.apply(output))
    with contextlib.suppress(RuntimeError):
        wrapped(x, y).backward()
    handle.remove()
    try:
        wrapped(x, y).backward()
    except RuntimeError as error:
        return str(error)
    return ""


def runs() -> dict:
    results = {}
    for mixed in (False, True):
        for version in ("torch", *OURS):
            for loop in LOOPS:
                if version == "torch" and loop == "pipeline":
                    continue  # torch DDP has no sync_gradients()
                results[version, loop, mixed] = train(version, loop, mixed)
    for version in ("torch", *OURS):
        results["events", version] = event_order(version)
    for version in OURS:
        results["failed backward", version] = after_a_failed_backward(version)
    return results


@pytest.fixture(scope="module")
def results():
    return launch(runs, WORLD, timeout=180)


def assert_bitwise_equal(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype, name
        assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16 and fp32"])
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("version", OURS)
def test_a_loop_written_for_torch_ddp_gives_torch_ddps_gradients_bit_for_bit(results, version, loop, mixed):
    # "pipeline" (every micro-batch under no_sync, then sync_gradients()) accumulates the same local sum
    # as torch's no_sync loop before averaging it once, so it too must match torch's no_sync loop exactly.
    reference_loop = "no_sync" if loop == "pipeline" else loop
    for rank in range(WORLD):
        ours, theirs = results[rank][version, loop, mixed], results[rank]["torch", reference_loop, mixed]
        for step in range(STEPS):
            assert_bitwise_equal(ours["grads"][step], theirs["grads"][step])
        assert_bitwise_equal(ours["params"], theirs["params"])
    for step in range(STEPS):  # and the replicas hold one gradient
        assert_bitwise_equal(
            results[1][version, loop, mixed]["grads"][step], results[0][version, loop, mixed]["grads"][step]
        )


@pytest.mark.parametrize("version", OURS)
def test_no_sync_and_sync_gradients_cost_no_extra_collectives(results, version):
    # Accumulating two micro-batches costs the collectives of one backward pass, as in torch DDP. Calling
    # sync_gradients() after a backward pass that averaged sends nothing: averaging equal replicas again would
    # give the same bits (m/2 + m/2 = m), so only the count of collectives can tell.
    for mixed in (False, True):
        plain = results[0][version, "torch", mixed]["calls"]
        assert all(calls > 0 for calls in plain)
        for loop in ("no_sync", "pipeline", "legacy"):
            assert results[0][version, loop, mixed]["calls"] == plain, loop


def test_a_model_of_two_dtypes_is_bucketed_per_dtype():
    model = Net(mixed=True)
    buckets = assign_buckets(list(model.parameters()), int(CAP_MB * 1024 * 1024))
    assert all(len({p.dtype for p in bucket}) == 1 for bucket in buckets)
    assert {bucket[0].dtype for bucket in buckets} == {torch.bfloat16, torch.float32}
    # every parameter once, and each dtype's buckets in reverse order of definition (backward's order)
    assert sorted(map(id, (p for bucket in buckets for p in bucket))) == sorted(map(id, model.parameters()))
    for dtype in (torch.bfloat16, torch.float32):
        mine = [p for bucket in buckets for p in bucket if p.dtype == dtype]
        assert mine == [p for p in reversed(list(model.parameters())) if p.dtype == dtype]


def positions(events, kind):
    return [i for i, (k, _) in enumerate(events) if k == kind]


@pytest.mark.parametrize("version", ["torch", *OURS])
def test_every_all_reduce_completes_before_backward_returns(results, version):
    events = results[0]["events", version]
    launched, done, returned = positions(events, "launch"), positions(events, "done"), positions(events, "returned")
    assert len(launched) == len(done) > 1
    assert max(done) < returned[0]


def test_only_the_overlapped_version_communicates_while_gradients_are_still_being_computed(results):
    for version in ("torch", *OURS):
        events = results[0]["events", version]
        first_launch, last_grad = min(positions(events, "launch")), max(positions(events, "grad"))
        if version in ("overlapped", "torch"):
            assert first_launch < last_grad, version
        else:  # versions 1 and 2 start when the engine calls back, after the last gradient
            assert first_launch > last_grad, version


@pytest.mark.parametrize("version", OURS)
def test_a_backward_pass_that_raised_stops_the_next_forward(results, version):
    # Torch DDP stops too ("Expected to have finished reduction in the prior iteration"); training on would
    # step un-averaged gradients from then on.
    for rank in range(WORLD):
        assert "the previous backward pass through this wrapper raised" in results[rank]["failed backward", version]
