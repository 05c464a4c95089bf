"""Communication hooks that average in 16 bits: the book's ``fp16_compress_hook`` gives torch's bits, halves the
bytes, and its rounding stays within fp16's bound; the book's bf16 hook runs on CPU ranks too."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from scalebook.accounting import data_parallel_bytes_per_step
from scalebook.comm import count_traffic, launch
from scalebook.experiments.ddp import DataParallelRun, train_data_parallel
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.ddp import GradBucket, bf16_compress_hook, fp16_compress_hook
from scalebook.precision import float_format
from scalebook.train import TrainConfig

MINI = GPTConfig.named("tiny", n_layer=2, n_embd=64, block_size=64)
TRAIN = TrainConfig(steps=3, batch_size=2, seq_len=64, warmup_steps=1, progress=False)
CAP_MB = 0.05  # several buckets for the book's DDP; torch DDP has one in its first step, several after
WORLD = 2
# Unit roundoff (half the gap above 1.0) and the spacing of subnormals, whose rounding is absolute.
U = {"fp16": float_format("fp16").eps / 2, "bf16": float_format("bf16").eps / 2}
SUBNORMAL = {"fp16": float_format("fp16").smallest_subnormal, "bf16": float_format("bf16").smallest_subnormal}


def direct_hook_check() -> dict:
    """One bucket of gradients spanning 12 orders of magnitude (some below fp16's smallest subnormal), through the
    book's hooks and torch's fp16 hook; with every rank's input, gathered, for the exact mean."""
    generator = torch.Generator().manual_seed(dist.get_rank())
    grads = torch.randn(4096, generator=generator) * 10.0 ** torch.randint(-10, 2, (4096,), generator=generator)
    gathered = [torch.empty_like(grads) for _ in range(WORLD)]
    dist.all_gather(gathered, grads)
    out = {"inputs": torch.stack(gathered).double()}
    for name, hook in (("fp16", fp16_compress_hook), ("bf16", bf16_compress_hook),
                       ("torch fp16", default_hooks.fp16_compress_hook)):  # fmt: skip
        bucket = GradBucket(0, grads.clone(), [])
        with count_traffic() as traffic:
            out[name] = hook(None, bucket).wait().clone()
        out[name, "message bytes"] = traffic.message_bytes_by_op()["all_reduce"]
    return out


def hook_runs() -> dict:
    """On each rank: the GPT under the book's version 3 and torch DDP with the fp16 hook, without a hook, with the
    book's bf16 hook, and (one step) over the book's ring all-reduce with and without the fp16 hook."""
    results = {"direct": direct_hook_check()}
    for version, hook in (("overlapped", "fp16"), ("torch", "fp16"), ("overlapped", None), ("overlapped", "bf16")):
        results[version, hook] = train_data_parallel(
            version, MINI, TRAIN, bucket_cap_mb=CAP_MB, keep_params=True, keep_grads=True, comm_hook=hook
        )
    for hook in ("fp16", None):
        results["ring", hook] = train_data_parallel(
            "overlapped", MINI, replace(TRAIN, steps=1), bucket_cap_mb=CAP_MB, all_reduce="ring", comm_hook=hook
        )
    return results


@pytest.fixture(scope="module")
def results():
    return launch(hook_runs, WORLD, timeout=180)


def largest_gap(a: dict, b: dict) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a)


def test_book_fp16_hook_trains_exactly_like_torch_fp16_compress_hook(results):
    # Same casts, same division, and gloo's fp16 sum of two terms (a + b in any order): equal bit for bit.
    ours, theirs = results[0]["overlapped", "fp16"], results[0]["torch", "fp16"]
    assert ours["losses"] == theirs["losses"]
    assert largest_gap(ours["grads"], theirs["grads"]) == 0
    assert largest_gap(ours["params"], theirs["params"]) == 0
    assert all(largest_gap(r["overlapped", "fp16"]["params"], ours["params"]) == 0 for r in results)


def test_fp16_hook_halves_the_bytes(results):
    n_params = GPT(MINI).num_parameters()
    for rank_results in results:
        fp32, fp16 = rank_results["overlapped", None], rank_results["overlapped", "fp16"]
        # Library all-reduces: the messages are half as large, so the ring charges half the bytes.
        assert fp32["bytes_sent"] == [data_parallel_bytes_per_step(n_params, WORLD)] * TRAIN.steps
        assert fp16["bytes_sent"] == [data_parallel_bytes_per_step(n_params, WORLD, grad_bytes=2)] * TRAIN.steps
        assert rank_results["torch", "fp16"]["bytes_sent"] == fp16["bytes_sent"]  # its hook is Python: counted
        # Over the book's ring: counted at every isend.
        assert rank_results["ring", "fp16"]["bytes_sent"][0] * 2 == rank_results["ring", None]["bytes_sent"][0]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_compression_error_stays_within_the_format_bound(results, dtype):
    direct = results[0]["direct"]
    x = direct["inputs"]  # (ranks, elements), float64
    exact = x.mean(0)
    # Each rank's value is rounded by the cast (relative u, or half a subnormal spacing below the normal range)
    # and halved (exact, or half a spacing), and the sum of the two halves is rounded once more (relative u, or
    # half a spacing): |error| <= 2 u (1 + u) (|x0| + |x1|)/2 + 2.5 spacings; 3 are allowed.
    bound = 2 * U[dtype] * (1 + U[dtype]) * x.abs().mean(0) + 3 * SUBNORMAL[dtype]
    error = (direct[dtype].double() - exact).abs()
    assert (error <= bound).all()
    assert error.max() > 0  # compression really rounds: a hook that sent fp32 would not
    assert direct[dtype, "message bytes"] * 2 == x.shape[1] * 4  # half of the fp32 bucket
    if dtype == "fp16":
        assert torch.equal(direct["fp16"], direct["torch fp16"])
        tiny = x.abs().max(0).values < SUBNORMAL["fp16"] / 2  # every term flushes to zero after the cast
        assert tiny.any() and (direct["fp16"][tiny] == 0).all()


def test_training_with_a_16_bit_hook_stays_close_to_fp32(results):
    fp32 = results[0]["overlapped", None]
    scale = max(g.abs().max().item() for g in fp32["grads"].values())
    gaps = {hook: largest_gap(results[0]["overlapped", hook]["grads"], fp32["grads"]) / scale
            for hook in ("fp16", "bf16")}  # fmt: skip
    # Relative to the largest gradient element: at most a few unit roundoffs of each format, and not zero.
    assert 0 < gaps["fp16"] <= 4 * U["fp16"]
    assert 0 < gaps["bf16"] <= 4 * U["bf16"]
    assert gaps["bf16"] > gaps["fp16"]


def test_torch_bf16_hook_and_unknown_hooks_are_refused_before_work():
    with pytest.raises(ValueError, match="needs CUDA and NCCL"):
        DataParallelRun("torch", MINI, TRAIN, comm_hook="bf16")
    with pytest.raises(ValueError, match="comm_hook must be None or one of"):
        DataParallelRun("overlapped", MINI, TRAIN, comm_hook="int8")
