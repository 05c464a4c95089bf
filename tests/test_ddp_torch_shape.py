"""The book's DDP has torch DDP's shape: a loop written for torch DDP (``loss.backward(); optimizer.step()``, with
or without ``no_sync()`` accumulation) trains exactly as under torch DDP, because the gradients are averaged by
the time ``backward()`` returns; a model with parameters of two dtypes works; ``sync_gradients()`` is harmless;
``gradient_as_bucket_view=True`` makes each ``.grad`` a view of its bucket, as in torch DDP, with the same bits.

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
from scalebook.measure import tensor_bytes
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


def wrap(version: str, model: nn.Module, view: bool = False) -> nn.Module:
    if version == "torch":
        return DistributedDataParallel(model, bucket_cap_mb=CAP_MB, gradient_as_bucket_view=view)
    kwargs = {} if version == "allreduce" else {"bucket_cap_mb": CAP_MB, "gradient_as_bucket_view": view}
    return OURS[version](model, **kwargs)


def lies_inside(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether ``t``'s bytes lie within ``buffer``'s (data_ptr ranges)."""
    return buffer.data_ptr() <= t.data_ptr() and t.data_ptr() + t.nbytes <= buffer.data_ptr() + buffer.nbytes


def grad_layout(model: nn.Module, wrapped: nn.Module) -> dict:
    """Where the gradients live: the parameter names whose ``.grad`` share one storage; for the book's
    bucketed versions also each bucket's names, whether each ``.grad`` lies inside its bucket's buffer (by
    data_ptr range), and the bytes held by gradients and buckets together, each storage once."""
    shared = {}
    for name, p in model.named_parameters():
        shared.setdefault(p.grad.untyped_storage().data_ptr(), []).append(name)
    layout = {"shared": sorted(sorted(names) for names in shared.values())}
    if isinstance(wrapped, BucketedDDP):
        names = {p: name for name, p in model.named_parameters()}
        layout["buckets"] = sorted(sorted(names[p] for p in bucket.params) for bucket in wrapped.buckets)
        layout["inside"] = {names[p]: lies_inside(p.grad, wrapped.bucket_of[p].buffer) for p in model.parameters()}
        layout["held"] = tensor_bytes([*(p.grad for p in model.parameters()), *(b.buffer for b in wrapped.buckets)])
    return layout


def train(version: str, loop: str, mixed: bool, view: bool = False) -> dict:
    """``STEPS`` SGD steps of ``Net`` on this rank under ``version`` driven by ``loop`` (with
    ``gradient_as_bucket_view=view``); each step's averaged gradients as the optimizer receives them, the
    final parameters, the all-reduce calls per step, and where the last step's gradients live."""
    rank = dist.get_rank()
    torch.manual_seed(rank)  # different weights on every rank: only the wrapper's broadcast makes them equal
    model = Net(mixed)
    wrapped = wrap(version, model, view)
    ready_in_bucket = []  # with the view, one backward per step: is .grad in its bucket as soon as it is ready?
    if view and loop == "torch" and isinstance(wrapped, BucketedDDP):
        for p in model.parameters():  # registered after the wrapper's hooks, so they run after them
            p.register_post_accumulate_grad_hook(
                lambda p: ready_in_bucket.append(lies_inside(p.grad, wrapped.bucket_of[p].buffer))
            )
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
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    layout = grad_layout(model, wrapped)
    return {"grads": grads, "params": params, "calls": calls, "layout": layout, "ready_in_bucket": ready_in_bucket}


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
    for mixed in (False, True):  # gradient_as_bucket_view: torch's and the book's bucketed versions
        for version in ("torch", "bucketed", "overlapped"):
            for loop in ("torch", "no_sync") if version == "torch" else ("torch", "no_sync", "pipeline"):
                results[version, loop, mixed, "view"] = train(version, loop, mixed, view=True)
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


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16 and fp32"])
@pytest.mark.parametrize("version", ["bucketed", "overlapped"])
def test_gradient_as_bucket_view_gives_torch_ddps_gradients_bit_for_bit(results, version, mixed):
    # The same bar as without the option (see the module docstring): the view changes where the sum lands,
    # not how it is computed, so torch's gradients with the option, ours with it, and torch's without it
    # must all be the same bits, with accumulation (no_sync, pipeline) too.
    for rank in range(WORLD):
        for loop in ("torch", "no_sync", "pipeline"):
            reference_loop = "no_sync" if loop == "pipeline" else loop
            ours = results[rank][version, loop, mixed, "view"]
            theirs = results[rank]["torch", reference_loop, mixed, "view"]
            without = results[rank]["torch", reference_loop, mixed]
            for step in range(STEPS):
                assert_bitwise_equal(ours["grads"][step], theirs["grads"][step])
                assert_bitwise_equal(theirs["grads"][step], without["grads"][step])
            assert_bitwise_equal(ours["params"], theirs["params"])


@pytest.mark.parametrize("version", ["bucketed", "overlapped"])
def test_gradient_as_bucket_view_keeps_one_copy_of_the_gradients_as_torch_ddp_does(results, version):
    for mixed in (False, True):
        # By hand: the gradients have the parameters' shapes and dtypes.
        grad_bytes = sum(p.numel() * p.element_size() for p in Net(mixed).parameters())
        for loop in ("torch", "no_sync", "pipeline"):
            view = results[0][version, loop, mixed, "view"]["layout"]
            assert all(view["inside"].values()), (loop, mixed)  # every .grad lies in its own bucket's buffer
            assert view["shared"] == view["buckets"], (loop, mixed)  # one storage per bucket, holding its .grads
            assert view["held"] == grad_bytes, (loop, mixed)
        copy = results[0][version, "torch", mixed]["layout"]
        assert not any(copy["inside"].values()) and all(len(names) == 1 for names in copy["shared"])
        assert copy["held"] == 2 * grad_bytes  # the default: .grad and the bucket beside it
        # torch's .grad views group the parameters as our buckets do (its buckets, rebuilt after step 1, are ours)
        assert results[0]["torch", "torch", mixed, "view"]["layout"]["shared"] == view["buckets"]
        assert all(len(names) == 1 for names in results[0]["torch", "torch", mixed]["layout"]["shared"])


def test_with_the_view_version_3_moves_each_gradient_into_its_bucket_as_soon_as_it_is_ready(results):
    # The loop sets .grad to None before each step (zero_grad's default), so autograd allocates each gradient
    # afresh. Version 3 copies it into the bucket and points .grad there in the gradient's hook, freeing the fresh
    # tensor at once, as torch's reducer does: the two copies never pile up. Version 2 packs at the end of
    # backward, so under set_to_none its fresh gradients and the buckets coexist until then.
    for mixed in (False, True):
        n_params = len(list(Net(mixed).parameters()))
        overlapped = results[0]["overlapped", "torch", mixed, "view"]["ready_in_bucket"]
        bucketed = results[0]["bucketed", "torch", mixed, "view"]["ready_in_bucket"]
        assert len(overlapped) == len(bucketed) == STEPS * n_params
        assert all(overlapped) and not any(bucketed)
