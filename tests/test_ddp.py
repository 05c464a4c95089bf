"""DDP from scratch: on any module, every version trains exactly like torch DDP; on the book's GPT, also like one
process on the global batch."""

import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from scalebook import accounting, configs, data
from scalebook.comm import count_traffic, launch
from scalebook.experiments.ddp import DataParallelRun, predicted_step_time, train_data_parallel
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.ddp import MIB, AllReduceDDP, BucketedDDP, OverlappedDDP
from scalebook.train import TrainConfig, train

MINI = GPTConfig.named("tiny", n_layer=2, n_embd=64, block_size=64)
TRAIN = TrainConfig(steps=5, batch_size=2, seq_len=64, warmup_steps=2, progress=False)
CAP_MB = 0.05  # about 52 KB: the mini model's 0.48 MB of gradients fill 7 buckets
VERSIONS = ("allreduce", "bucketed", "overlapped", "torch")
OURS = {"allreduce": AllReduceDDP, "bucketed": BucketedDDP, "overlapped": OverlappedDDP}
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
# fp64: only the order of the gradient sums differs between runs (rounding ~1e-16), so 1e-10 is loose.
# fp32: the losses agree to 1e-6, but AdamW divides by sqrt(v), so a weight whose gradient is ~0 (the
# key bias of attention has an exactly zero gradient) turns a 1e-7 rounding difference into a visible
# step: 3e-6 is the worst element measured over 5 steps at N=4 (torch DDP itself against one process);
# 1e-5 leaves room and is 0.3 % of the learning rate.
PARAM_TOL = {"fp32": 1e-5, "fp64": 1e-10}
LOSS_TOL = 1e-6


class Toy(nn.Module):
    """Not the book's GPT: a frozen layer, a weight shared by two modules, buffers (one constant, BatchNorm's
    running statistics updated by every forward), a layer only some ranks use and a layer no rank uses."""

    def __init__(self, vocab: int = 32, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.frozen = nn.Linear(width, width).requires_grad_(False)
        self.norm = nn.BatchNorm1d(width)
        self.hidden = nn.Linear(width, width)
        self.sometimes = nn.Linear(width, width)  # used only when the caller asks (rank 0 below)
        self.never = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter in two modules
        self.register_buffer("scale", torch.rand(width) + 0.5)

    def forward(self, tokens, targets, use_sometimes: bool):
        h = torch.tanh(self.frozen(self.embed(tokens) * self.scale))
        h = self.norm(h.flatten(0, 1)).view_as(h)
        h = h + torch.tanh(self.hidden(h))
        if use_sometimes:
            h = h + self.sometimes(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


TOY_OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    # weight decay moves a parameter whose gradient is zero, but not one whose gradient is None
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
}
TOY_CAP_MB = 0.001  # about 1 KiB: the toy's gradients fall into 4 buckets, so their order matters


def train_toy(version: str, optimizer: str, *, find_unused: bool = True, steps: int = 3) -> dict:
    """Train the toy on this rank: its own seed before wrapping, its own batches, rank 0 alone uses
    ``sometimes``. Returns the final parameters and buffers, the last gradients, and the all-reduced bytes."""
    rank = dist.get_rank()
    torch.manual_seed(10 + rank)  # only the broadcast at construction makes the replicas equal
    model = Toy()
    if version == "torch":
        wrapped = DistributedDataParallel(model, bucket_cap_mb=TOY_CAP_MB, find_unused_parameters=True)
    else:
        wrapped = OURS[version](model, **({} if version == "allreduce" else {"bucket_cap_mb": TOY_CAP_MB}),
                                find_unused_parameters=find_unused)  # fmt: skip
    opt = TOY_OPTIMIZERS[optimizer](model.parameters())
    generator = torch.Generator().manual_seed(100 + rank)
    with count_traffic() as traffic:
        for _ in range(steps):
            tokens, targets = torch.randint(0, 32, (2, 4, 8), generator=generator)
            opt.zero_grad(set_to_none=True)
            wrapped(tokens, targets, rank == 0).backward()  # torch DDP's loop: averaged when backward returns
            opt.step()
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "all_reduced_bytes": sum(c.message_bytes for c in traffic.of("all_reduce")) / steps,
    }


def pipeline_style_checks() -> dict:
    """A backward run entirely inside no_sync(), then sync_gradients() (what a pipeline schedule does): every
    version must average then, as version 2 does; and two backward passes outside no_sync() in a row (each
    averages what .grad holds, as torch DDP does) must not trip over the buckets of the first."""
    rank = dist.get_rank()
    out = {}
    tokens, targets = torch.randint(0, 32, (2, 4, 8), generator=torch.Generator().manual_seed(rank))
    grads = {}
    for version in OURS:
        torch.manual_seed(0)
        wrapped = OURS[version](Toy(), **({} if version == "allreduce" else {"bucket_cap_mb": TOY_CAP_MB}))
        with wrapped.no_sync():
            wrapped(tokens, targets, True).backward()
        local = {p: p.grad.clone() for p in wrapped.params if p.grad is not None}  # `never` has none
        wrapped.sync_gradients()
        grads[version] = [p.grad.clone() for p in wrapped.params]  # zeros for `never`: every rank sent its slot
        out["averaged", version] = all(not torch.equal(g, p.grad) for p, g in local.items())
    out["no_sync_then_sync_gap"] = max(
        (a - b).abs().max().item() for version in OURS for a, b in zip(grads[version], grads["bucketed"], strict=True)
    )
    wrapped = OverlappedDDP(Toy(), bucket_cap_mb=TOY_CAP_MB)
    wrapped(tokens, targets, True).backward()
    wrapped(tokens, targets, True).backward()
    out["second_backward"] = [p.grad.clone() for p in wrapped.params if p.grad is not None]
    return out


def toy_runs() -> dict:
    """On each of 2 ranks: the toy module under every version and torch DDP with both optimizers, our
    overlapped version without find_unused_parameters, and the pipeline-style checks."""
    results = {}
    for optimizer in TOY_OPTIMIZERS:
        for version in VERSIONS:
            results[version, optimizer] = train_toy(version, optimizer)
        results["overlapped default", optimizer] = train_toy("overlapped", optimizer, find_unused=False)
    results["pipeline style"] = pipeline_style_checks()
    return results


def every_version():
    """On each rank: the GPT runs of every version and torch DDP in fp32 and fp64, plus the checks that need
    ranks."""
    results = {}
    for dtype_name, dtype in DTYPES.items():
        for version in VERSIONS:
            results[version, dtype_name] = train_data_parallel(
                version, MINI, TRAIN, bucket_cap_mb=CAP_MB, dtype=dtype, keep_params=True, keep_grads=True
            )
    # The same runs over the book's ring all-reduce (Chapter 9), built from isend/irecv: bytes really sent.
    for version in VERSIONS:
        results[version, "ring"] = train_data_parallel(
            version, MINI, replace(TRAIN, steps=2), bucket_cap_mb=CAP_MB, keep_grads=True, all_reduce="ring"
        )
    # Accumulation: 2 micro-batches per rank, the first under no_sync().
    accumulate = TrainConfig(steps=5, batch_size=2, grad_accum=2, seq_len=64, warmup_steps=2, progress=False)
    results["accumulate"] = train_data_parallel(
        "overlapped", MINI, accumulate, bucket_cap_mb=CAP_MB, dtype=torch.float64, keep_params=True
    )
    # Each rank builds its model from its own seed; the wrapper must replace it by rank 0's weights.
    torch.manual_seed(dist.get_rank())
    wrapped = AllReduceDDP(GPT(MINI))
    results["after_wrap"] = {name: p.detach().clone() for name, p in wrapped.module.named_parameters()}
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def ranks(request):
    n = request.param
    return n, launch(every_version, n, timeout=180)


@pytest.fixture(scope="module")
def toy_results():
    return launch(toy_runs, 2, timeout=120)


def single_process(dtype, batch_size, grad_accum):
    """The book's one-process training loop on the same global batches (one thread, like each rank)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(TRAIN.seed)
        model = GPT(MINI).to(dtype)
        cfg = TrainConfig(steps=TRAIN.steps, batch_size=batch_size, grad_accum=grad_accum, seq_len=TRAIN.seq_len,
                          warmup_steps=TRAIN.warmup_steps, progress=False)  # fmt: skip
        result = train(model, data.corpus_tokens(), cfg)
    finally:
        torch.set_num_threads(threads)
    return result.losses, {name: p.detach() for name, p in model.named_parameters()}


def single_process_gradients(dtype, n):
    """The gradient of the mean loss over the whole global batch of the first step (2n sequences), computed
    by one process in one forward and backward, from the weights every replica starts with (rank 0's)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(TRAIN.seed)
        model = GPT(MINI).to(dtype)
        x, y = data.get_batch(data.corpus_tokens(), TRAIN.batch_size * n, TRAIN.seq_len,
                              torch.Generator().manual_seed(TRAIN.seed))  # fmt: skip
        model(x, y)[1].backward()
    finally:
        torch.set_num_threads(threads)
    return {name: p.grad for name, p in model.named_parameters()}


def max_param_diff(a, b):
    return max((a[name].double() - b[name].double()).abs().max().item() for name in b)


# ----- Any module, against torch DDP --------------------------------------------------------------------------
# Two ranks: both implementations divide each gradient by 2 (exact in binary) and add the two halves (a + b
# is b + a exactly), so every weight, buffer and gradient must agree bit for bit. Any other scale, a
# gradient reduced twice, a missed buffer broadcast or a skipped rank shows as a nonzero difference.


@pytest.mark.parametrize("optimizer", TOY_OPTIMIZERS)
@pytest.mark.parametrize("version", OURS)
def test_any_module_trains_bit_for_bit_like_torch_ddp(toy_results, version, optimizer):
    for rank in range(2):
        ours, theirs = toy_results[rank][version, optimizer], toy_results[rank]["torch", optimizer]
        assert ours["state"].keys() == theirs["state"].keys()
        assert max_param_diff(ours["state"], theirs["state"]) == 0.0, rank
        # With find_unused_parameters, a parameter no rank used keeps a None gradient, as in torch DDP.
        assert [n for n, g in ours["grads"].items() if g is None] == ["frozen.weight", "frozen.bias",
                                                                     "never.weight", "never.bias"]  # fmt: skip
        used = {n: g for n, g in ours["grads"].items() if g is not None}
        assert max_param_diff(used, {n: theirs["grads"][n] for n in used}) == 0.0


@pytest.mark.parametrize("optimizer", TOY_OPTIMIZERS)
def test_replicas_of_any_module_stay_identical_and_start_from_rank_0(toy_results, optimizer):
    rank0, rank1 = (toy_results[r]["overlapped", optimizer]["state"] for r in range(2))
    # BatchNorm's running statistics are left out: each rank's last forward updated its own, and (as in
    # torch DDP, matched above) the next forward would start from rank 0's again.
    replicated = [name for name in rank0 if not name.startswith("norm.running") and name != "norm.num_batches_tracked"]
    assert max_param_diff({n: rank1[n] for n in replicated}, {n: rank0[n] for n in replicated}) == 0.0
    torch.manual_seed(10)  # rank 0's seed: the frozen layer and the constant buffer never change after it
    start = Toy().state_dict()
    for name in ("frozen.weight", "frozen.bias", "scale"):
        assert torch.equal(rank1[name], start[name]), name


def test_a_shared_weight_is_reduced_once(toy_results):
    # One all-reduce of every trainable element (the tied matrix once), in 4-byte floats, per step; with
    # find_unused_parameters one more, of a 4-byte flag per trainable tensor.
    model = Toy()
    trainable = [p for p in model.parameters() if p.requires_grad]  # parameters() lists a shared one once
    assert sum(p.numel() for p in trainable) < sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False)
                                                   if p.requires_grad)  # fmt: skip
    gradient_bytes = 4 * sum(p.numel() for p in trainable)
    for optimizer in TOY_OPTIMIZERS:
        assert toy_results[0]["overlapped default", optimizer]["all_reduced_bytes"] == gradient_bytes
        assert toy_results[0]["overlapped", optimizer]["all_reduced_bytes"] == gradient_bytes + 4 * len(trainable)


def test_without_find_unused_parameters_an_unused_layer_gets_a_zero_gradient_everywhere(toy_results):
    for rank in range(2):
        grads = toy_results[rank]["overlapped default", "sgd"]["grads"]
        assert torch.count_nonzero(grads["never.weight"]) == 0 and grads["frozen.weight"] is None
        # Plain SGD with momentum leaves a parameter whose gradient was always zero where it was.
        ours = toy_results[rank]["overlapped default", "sgd"]["state"]
        assert max_param_diff(ours, toy_results[rank]["torch", "sgd"]["state"]) == 0.0


def test_sync_gradients_averages_what_backward_passes_under_no_sync_left(toy_results):
    checks = toy_results[0]["pipeline style"]
    # Nothing was launched during backward; sync_gradients() sends every bucket, in order, like version 2.
    assert all(checks["averaged", version] for version in OURS)
    assert checks["no_sync_then_sync_gap"] == 0.0
    # Two backward passes outside no_sync(): the replicas still agree, bit for bit.
    rank0, rank1 = (toy_results[r]["pipeline style"]["second_backward"] for r in range(2))
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1, strict=True))


# ----- The book's GPT: against torch DDP and one process ---------------------------------------------------


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_every_version_matches_torch_ddp(ranks, dtype_name):
    n, results = ranks
    reference = results[0]["torch", dtype_name]
    for version in VERSIONS[:3]:
        run = results[0][version, dtype_name]
        assert max(abs(a - b) for a, b in zip(run["losses"], reference["losses"], strict=True)) <= LOSS_TOL, version
        assert max_param_diff(run["params"], reference["params"]) <= PARAM_TOL[dtype_name], version


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_every_version_matches_single_process_on_the_global_batch(ranks, dtype_name):
    n, results = ranks
    # Each rank's 2 sequences are one micro-batch of the single process: n micro-batches of 2 per step.
    losses, params = single_process(DTYPES[dtype_name], TRAIN.batch_size, n)
    for version in VERSIONS:
        run = results[0][version, dtype_name]
        assert max(abs(a - b) for a, b in zip(run["losses"], losses, strict=True)) <= LOSS_TOL, version
        assert max_param_diff(run["params"], params) <= PARAM_TOL[dtype_name], version


# The gradient before clipping and AdamW: a wrong scale (say a sum instead of a mean, x n) shows here at full
# size, where AdamW's scale invariance and clipping would hide it in the weights. Each replica's averaged
# gradient and the one-process gradient differ only in rounding: the order of the sums over sequences and
# ranks, and one thread count against another. Measured worst case over all versions and ranks, relative
# to the largest element of the whole gradient: 1.2e-7 in fp32 and 3.4e-16 in fp64 (at 4 ranks); the
# tolerances leave a factor of 8 and 30. A missing 1/n is an error of n - 1 = 1 or 3 in those units.
GRAD_RTOL = {"fp32": 1e-6, "fp64": 1e-14}


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_every_version_averages_gradients_like_one_process_on_the_global_batch(ranks, dtype_name):
    n, results = ranks
    expected = single_process_gradients(DTYPES[dtype_name], n)
    scale = max(g.abs().max().item() for g in expected.values())
    worst = {}
    for version in VERSIONS:
        for rank in range(n):
            got = results[rank][version, dtype_name]["grads"]
            assert got.keys() == expected.keys()
            worst[version, rank] = max_param_diff(got, expected) / scale
    assert all(w <= GRAD_RTOL[dtype_name] for w in worst.values()), worst


def test_ddp_over_the_from_scratch_ring_sends_the_formula_bytes_at_its_isend_calls(ranks):
    n, results = ranks
    grad_bytes = 4 * GPT(MINI).num_parameters()
    for version in VERSIONS:
        per_rank = [results[rank][version, "ring"]["bytes_sent"] for rank in range(n)]
        for step in range(2):
            sent = [per_rank[rank][step] for rank in range(n)]
            # Each element leaves n - 1 ranks in the reduce-scatter and n - 1 in the all-gather: 2 (n - 1) M
            # in all, 2 (n - 1) / n M per rank on average (uneven chunks make single ranks differ a little).
            assert sum(sent) == 2 * (n - 1) * grad_bytes, (version, step, sent)
            assert all(0 < b < 2 * grad_bytes for b in sent)
        # The ring adds in gloo's order (Chapter 9), so the averaged gradient is the same, bit for bit.
        assert max_param_diff(results[0][version, "ring"]["grads"], results[0][version, "fp32"]["grads"]) == 0.0


def test_replicas_stay_bit_identical_across_ranks(ranks):
    n, results = ranks
    for key in [(v, d) for v in VERSIONS for d in DTYPES] + ["accumulate"]:
        for rank in range(1, n):
            assert max_param_diff(results[rank][key]["params"], results[0][key]["params"]) == 0.0, key


def test_initial_weights_are_broadcast_from_rank_0(ranks):
    n, results = ranks
    torch.manual_seed(0)
    rank0 = {name: p.detach() for name, p in GPT(MINI).named_parameters()}
    for rank in range(n):
        assert max_param_diff(results[rank]["after_wrap"], rank0) == 0.0


def test_no_sync_accumulation_equals_one_large_batch(ranks):
    n, results = ranks
    losses, params = single_process(torch.float64, TRAIN.batch_size, 2 * n)  # the same 4n sequences per step
    run = results[0]["accumulate"]
    assert max(abs(a - b) for a, b in zip(run["losses"], losses, strict=True)) <= LOSS_TOL
    assert max_param_diff(run["params"], params) <= PARAM_TOL["fp64"]


def test_every_version_all_reduces_every_gradient_once_per_step_and_calls_differ(ranks):
    # What is measured here is the message sizes of the library all_reduce calls; their internal sends are
    # hidden, so count_traffic charges each call the ring algorithm's 2 (n - 1) / n of its message (modelled, not
    # counted: the bytes really sent are checked at isend over the from-scratch ring, above). Written out here:
    # if every fp32 gradient is in exactly one all-reduce per step, the charge is 2 (n - 1) / n x 4 Psi.
    n, results = ranks
    model = GPT(MINI)
    psi = sum(p.numel() for p in model.parameters())  # the tied embedding once
    ring_all_reduce = 2 * (n - 1) / n * 4 * psi
    runs = {version: results[0][version, "fp32"] for version in VERSIONS}
    for version, run in runs.items():
        # rel 1e-12: the per-call charges are floats summed in call order
        assert all(math.isclose(b, ring_all_reduce, rel_tol=1e-12) for b in run["bytes_sent"]), version
    assert runs["allreduce"]["calls"] == [len(list(model.parameters()))] * TRAIN.steps  # one per tensor
    # torch DDP puts everything in one bucket for its first step, then rebuilds buckets in gradient order.
    torch_buckets = runs["torch"]["calls"][1]
    assert runs["torch"]["calls"][0] == 1 and torch_buckets > 1
    assert runs["bucketed"]["calls"] == runs["overlapped"]["calls"] == [torch_buckets] * TRAIN.steps


def test_buckets_hold_the_same_parameters_as_torch_ddp(ranks):
    n, results = ranks
    ours = results[0]["overlapped", "fp32"]["buckets"]
    theirs = results[0]["torch", "fp32"]["buckets"]
    # Within a bucket torch keeps the order gradients arrived in (a LayerNorm's weight before its bias).
    assert [sorted(b) for b in ours] == [sorted(b) for b in theirs]


def test_every_version_finishes_its_all_reduces_inside_backward_and_only_v3_overlaps(ranks):
    # Like torch DDP, every version averages by the time backward() returns: the last all-reduce ends with the
    # "sync" span, the wait at the end of backward(). Versions 1 and 2 launch after the last gradient (the end
    # of the "backward" span); version 3 and torch DDP while gradients are still being computed.
    n, results = ranks
    for version in VERSIONS:
        spans = results[0][version, "fp32"]["spans"]
        (backward,), (wait,) = ([s for s in spans if s.kind == kind] for kind in ("backward", "sync"))
        reduces = [s for s in spans if s.kind == "all-reduce"]
        assert reduces and all(backward.start <= s.start and s.end <= wait.end for s in reduces), version
        first_launch = min(s.start for s in reduces)
        assert (first_launch < backward.end) == (version in ("overlapped", "torch")), version


# ----- Without ranks: bad input and the alpha-beta prediction ------------------------------------------------


@pytest.mark.parametrize("comm_heavy", [False, True], ids=["compute-bound", "link-bound"])
def test_predicted_overlap_matches_a_bucket_by_bucket_simulation(comm_heavy):
    gpt2 = configs.get_model("gpt2")
    peak = configs.get_hardware("h100-sxm").peak("bf16")
    bandwidth = 5e9 if comm_heavy else 450e9  # a slow link makes the all-reduces outlast backward
    got = predicted_step_time(gpt2, 4 * 1024, 8, seq_len=1024, peak_flops=peak, mfu=0.4, bandwidth=bandwidth,
                              alpha=5e-6, bucket_cap_mb=10)  # fmt: skip
    k = math.ceil(4 * 124_439_808 / (10 * MIB))
    link_free = 0.0
    for i in range(k):
        ready = got["compute"] / 3 + (i + 1) * (2 * got["compute"] / 3) / k
        link_free = max(ready, link_free) + got["comm"] / k
    assert got["overlapped"] == pytest.approx(link_free, rel=1e-12)
    assert (got["comm"] > 2 * got["compute"] / 3) == comm_heavy


def test_bad_bucket_cap_raises_before_any_communication():
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number"):
        BucketedDDP(GPT(MINI), bucket_cap_mb=0)


def test_bad_gradient_as_bucket_view_raises():
    with pytest.raises(ValueError, match="gradient_as_bucket_view must be True or False"):
        BucketedDDP(GPT(MINI), gradient_as_bucket_view="yes")
    with pytest.raises(ValueError, match="gradient_as_bucket_view needs buckets"):
        DataParallelRun("allreduce", MINI, TRAIN, gradient_as_bucket_view=True)


def test_ddp_bucket_copy_adds_one_gradient_per_parameter_by_hand():
    n = 1000
    # fp32 Adam: weight 4 + gradient 4 + m 4 + v 4 = 16 bytes per parameter, and DDP's bucket 4 more.
    fp32 = accounting.model_state_bytes(n, precision="fp32", ddp_bucket_copy=True)
    assert fp32.total == 20 * n and fp32.grads == 8 * n
    assert dict(fp32.rows())[accounting.memory.DDP_BUCKET_ROW] == 4 * n
    # The bucket has the reduced gradients' dtype: bf16 in "mixed" (2), fp32 when they accumulate in fp32.
    assert accounting.model_state_bytes(n, precision="mixed", ddp_bucket_copy=True).total == 18 * n
    assert accounting.model_state_bytes(n, precision="mixed-fp32-grads", ddp_bucket_copy=True).total == 24 * n
    # Off by default (torch's gradient_as_bucket_view=True, or a count without DDP): nothing added.
    assert accounting.model_state_bytes(n, precision="fp32").total == 16 * n
    # ZeRO-1 keeps DDP's buckets whole on every rank: at dp = 4, 4 + 4 + 4 + 8 / 4 = 14 bytes per parameter;
    # tensor and pipeline parallelism divide the model, the bucket with it.
    assert accounting.model_state_bytes(8000, precision="fp32", zero_stage=1, dp=4, ddp_bucket_copy=True).total == (
        14 * 8000
    )
    assert accounting.model_state_bytes(8000, precision="fp32", tp=2, pp=2, ddp_bucket_copy=True).grads == 8 * 2000
    with pytest.raises(ValueError, match="ZeRO stage 2 does not keep"):
        accounting.model_state_bytes(n, zero_stage=2, dp=2, ddp_bucket_copy=True)
    with pytest.raises(ValueError, match="ddp_bucket_copy must be True or False"):
        accounting.model_state_bytes(n, ddp_bucket_copy=1)


def test_wrapping_without_a_process_group_raises():
    with pytest.raises(ValueError, match="no process group"):
        AllReduceDDP(GPT(MINI))


def test_unknown_version_raises():
    with pytest.raises(ValueError, match="version must be one of"):
        DataParallelRun("sharded", MINI, TRAIN)


def test_predicted_step_time_by_hand_for_gpt2_on_8_h100():
    gpt2 = configs.get_model("gpt2")
    peak = configs.get_hardware("h100-sxm").peak("bf16")
    bandwidth = configs.get_link("nvlink-4").bandwidth
    tokens = 8 * 1024
    got = predicted_step_time(gpt2, tokens, 8, seq_len=1024, peak_flops=peak, mfu=0.4, bandwidth=bandwidth,
                              alpha=5e-6)  # fmt: skip
    # Narayanan et al.'s count by hand, B s = 8 x 1024 tokens of GPT-2 small (L 12, h 768, V 50257, s 1024):
    # 72 B s L h^2 (1 + s / 6h + V / 12 L h) = 7.0e12 FLOPs, at 40 % of the H100's 989.5 TFLOP/s (dense bf16).
    B, s, L, h, V = 8, 1024, 12, 768, 50257
    flops = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    assert peak == 989.5e12 and flops == pytest.approx(6.99956e12, rel=1e-5)
    compute = flops / (0.4 * peak)
    grad_bytes = 4 * 124_439_808  # GPT-2 small's exact parameter count (HF GPT2LMHeadModel, tied head)
    buckets = math.ceil(grad_bytes / (25 * MIB))
    # Ring all-reduce of each bucket: 2 (n - 1) steps of (alpha + (M / k) / (n B)).
    comm = buckets * 2 * 7 * (5e-6 + grad_bytes / buckets / (8 * bandwidth))
    assert got["compute"] == pytest.approx(compute, rel=1e-12)
    assert got["comm"] == pytest.approx(comm, rel=1e-12)
    assert got["serial"] == pytest.approx(compute + comm, rel=1e-12)
    # Overlap, simulated bucket by bucket: buckets complete at an even pace during backward (2/3 of the
    # compute); one all-reduce at a time, each starting when its bucket is complete and the link is free.
    link_free = 0.0
    for i in range(buckets):
        ready = compute / 3 + (i + 1) * (2 * compute / 3) / buckets
        link_free = max(ready, link_free) + comm / buckets
    assert got["overlapped"] == pytest.approx(link_free, rel=1e-12)
    # The last bucket is complete only when backward ends: its all-reduce is never hidden.
    assert got["overlapped"] >= compute + comm / buckets
    single = predicted_step_time(gpt2, tokens, 1, seq_len=1024, peak_flops=peak, mfu=0.4, bandwidth=bandwidth,
                                 alpha=5e-6)  # fmt: skip
    assert single["comm"] == 0.0 and single["serial"] == single["overlapped"] == pytest.approx(compute)
