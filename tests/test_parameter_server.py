"""The parameter server from send and receive trains exactly like all-reduce DDP, on the book's GPT and on any
module with any optimizer, and its traffic piles up on the server as ``parameter_server_bytes_per_step`` says."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from scalebook.accounting import bytes_sent_per_rank, parameter_server_bytes_per_step, parameter_server_time
from scalebook.comm import launch
from scalebook.experiments.ddp import train_data_parallel
from scalebook.experiments.parameter_server import ParameterServer, ring_all_reduce_traffic, train_parameter_server
from scalebook.model import GPT, GPTConfig
from scalebook.train import TrainConfig

MINI = GPTConfig.named("tiny", n_layer=2, n_embd=64, block_size=64)
TRAIN = TrainConfig(steps=3, batch_size=2, seq_len=64, warmup_steps=1, progress=False)
CAP_MB = 0.05  # several buckets for the book's DDP, as in tests/test_ddp.py
# Tolerances. On 2 ranks the server computes x0/2 + x1/2 and gloo's all-reduce sums the same two halved
# terms: a + b is the same in any order and halving is exact, so every run is equal bit for bit (0). On 3
# ranks the server adds in rank order and gloo's ring in another, so the mean gradient differs by rounding
# (~1e-7 relative); AdamW divides by sqrt(v), which turns that into up to a few 1e-6 on weights whose gradient
# is ~0 (tests/test_ddp.py measures 3e-6 between torch DDP and one process): 1e-5 on weights, 1e-6 on losses.
PARAM_TOL = {2: 0.0, 3: 1e-5}
LOSS_TOL = {2: 0.0, 3: 1e-6}


class Toy(nn.Module):
    """Not the book's GPT: an embedding, a frozen layer, a LayerNorm and a bias-free head."""

    def __init__(self, vocab: int = 32, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.frozen = nn.Linear(width, width).requires_grad_(False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens, targets):
        h = self.norm(torch.tanh(self.frozen(self.embed(tokens))))
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


TOY_OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


def train_toy(kind: str, optimizer: str, steps: int = 3) -> dict:
    """The toy on this rank, from its own seed, under the parameter server or torch DDP."""
    rank = dist.get_rank()
    torch.manual_seed(10 + rank)  # only the first pull (or DDP's broadcast) makes the replicas equal
    model = Toy()
    optimizer_class, kwargs = TOY_OPTIMIZERS[optimizer]
    if kind == "ps":
        wrapped = ParameterServer(model, optimizer_class, **kwargs)
    else:
        wrapped = DistributedDataParallel(model)
        opt = optimizer_class(model.parameters(), **kwargs)
    generator = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        tokens, targets = torch.randint(0, 32, (2, 4, 8), generator=generator)
        wrapped.zero_grad(set_to_none=True)
        loss = wrapped(tokens, targets)
        loss.backward()
        wrapped.step() if kind == "ps" else opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def misuse() -> dict:
    """The ValueErrors that need a process group, as messages."""
    out = {}
    for name, kwargs in (("optimizer", {"optimizer_class": "adamw"}), ("server", {"server": dist.get_world_size()})):
        try:
            ParameterServer(Toy(), **{"optimizer_class": torch.optim.SGD, "lr": 0.1, **kwargs})
            out[name] = "no error"
        except ValueError as error:
            out[name] = str(error)
    return out


def every_run() -> dict:
    """On each rank: the GPT under the parameter server, the book's DDP (version 3) and torch DDP; the toy under
    the parameter server and torch DDP with SGD and AdamW; the ring's traffic; the misuse checks."""
    results = {"ps": train_parameter_server(MINI, TRAIN, keep_params=True, keep_grads=True)}
    for version in ("overlapped", "torch"):
        results[version] = train_data_parallel(
            version, MINI, TRAIN, bucket_cap_mb=CAP_MB, keep_params=True, keep_grads=True
        )
    for optimizer in TOY_OPTIMIZERS:
        for kind in ("ps", "torch"):
            results[kind, optimizer] = train_toy(kind, optimizer)
    results["ring"] = ring_all_reduce_traffic(GPT(MINI).num_parameters())
    results["misuse"] = misuse()
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def launched(request):
    n = request.param
    return n, launch(every_run, n, timeout=180)


def largest_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def test_parameter_server_matches_all_reduce_ddp(launched):
    n, results = launched
    server = results[0]["ps"]
    assert server["is_server"] and not any(r["ps"]["is_server"] for r in results[1:])
    # Every replica ends with the server's weights, bit for bit.
    assert all(largest_gap(r["ps"]["params"], server["params"]) == 0 for r in results)
    for version in ("overlapped", "torch"):
        ddp = results[0][version]
        # The mean gradient, before clipping and the optimizer: rounding only (relative to its largest element).
        scale = max(g.abs().max().item() for g in ddp["grads"].values())
        assert largest_gap(server["grads"], ddp["grads"]) <= (0 if n == 2 else 1e-6) * scale
        assert max(abs(a - b) for a, b in zip(server["losses"], ddp["losses"], strict=True)) <= LOSS_TOL[n]
        assert largest_gap(server["params"], ddp["params"]) <= PARAM_TOL[n]


@pytest.mark.parametrize("optimizer", list(TOY_OPTIMIZERS))
def test_parameter_server_trains_any_module_with_any_optimizer_like_torch_ddp(launched, optimizer):
    n, results = launched
    for rank_results in results:
        ps, ddp = rank_results["ps", optimizer], rank_results["torch", optimizer]
        assert max(abs(a - b) for a, b in zip(ps["losses"], ddp["losses"], strict=True)) <= LOSS_TOL[n]
        assert largest_gap(ps["params"], ddp["params"]) <= PARAM_TOL[n]
        assert ps["params"]["frozen.weight"].equal(results[0]["ps", optimizer]["params"]["frozen.weight"])


def test_server_traffic_grows_with_the_ranks_and_the_ring_stays_flat(launched):
    n, results = launched
    message = 4 * sum(p.numel() for p in GPT(MINI).parameters())  # fp32 gradients, counted independently
    expected = parameter_server_bytes_per_step(message, n)
    assert expected["server_sent"] == expected["server_received"] == (n - 1) * message
    for rank, rank_results in enumerate(results):
        run = rank_results["ps"]
        role = "server" if rank == 0 else "worker"
        # Counted at every isend and irecv of the push and the pull, in every step.
        assert run["bytes_sent"] == [expected[f"{role}_sent"]] * TRAIN.steps
        assert run["bytes_received"] == [expected[f"{role}_received"]] * TRAIN.steps
        assert run["calls"] == [2 * (n - 1) if rank == 0 else 2] * TRAIN.steps
    # The ring: 2 (n-1)/n M sent by a rank on average, and as much received (uneven chunks move bytes
    # between ranks, not in or out of the total).
    ring = [r["ring"] for r in results]
    for direction in ("bytes_sent", "bytes_received"):
        assert sum(r[direction] for r in ring) == pytest.approx(n * bytes_sent_per_rank("all_reduce", message, n))
    assert sum(r["ps"]["bytes_sent"][0] for r in results) == sum(r["bytes_sent"] for r in ring)  # 2 (n-1) M


def test_misuse_is_one_clear_value_error(launched):
    _, results = launched
    messages = results[0]["misuse"]
    assert "torch.optim.Optimizer class" in messages["optimizer"]
    assert "server must be a rank of the group" in messages["server"]


def test_parameter_server_needs_a_process_group():
    with pytest.raises(ValueError, match="no process group"):
        ParameterServer(Toy(), torch.optim.SGD, lr=0.1)


def test_parameter_server_formulas():
    m = 1_000_000
    assert parameter_server_bytes_per_step(m, 1) == dict.fromkeys(
        ("server_sent", "server_received", "worker_sent", "worker_received"), 0.0
    )
    assert parameter_server_bytes_per_step(m, 8)["server_received"] == 7 * m
    # Against the ring, the bandwidth term is n times larger (alpha = 0) and the latency term n-1 times smaller.
    ring = 2 * 7 * (m / (8 * 1e9))
    assert parameter_server_time(m, 8, alpha=0.0, bandwidth=1e9) == pytest.approx(8 * ring)
    assert parameter_server_time(0, 8, alpha=1e-5, bandwidth=1e9) == pytest.approx(2e-5)
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        parameter_server_bytes_per_step(m, 0)
    with pytest.raises(ValueError, match="alpha"):
        parameter_server_time(m, 4, alpha=-1.0, bandwidth=1e9)
