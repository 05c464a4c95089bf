"""Mixture of experts: routing and capacity by hand; expert parallelism equal to an independent MoE written out
here as a loop over the experts (outputs, input gradients, the router's and every expert's gradients, per
tensor); balancing works. On the GPT, a dropless MoE option whose expert-parallel run (alone, and inside data
parallelism) gives one process's loss and every one of its gradients, per tensor, and whose gathered state is
the single-process state.

Hugging Face's ``MixtralSparseMoeBlock`` is not the reference: it renormalises the top-k probabilities to sum
to one, its experts are SwiGLU MLPs without biases, and it has no capacity; the book's MoE keeps the raw softmax
probabilities as gates (Switch/GShard), runs GELU MLPs with biases, and drops the assignments beyond each
expert's capacity (GShard order). The loop below follows the book's definition
(the docstrings of ``scalebook.moe`` and ``scalebook.parallel.expert``), not their code."""

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from scalebook import moe as moe_module
from scalebook.comm import launch
from scalebook.experiments.expert import compare_expert_parallel, train_load_balance
from scalebook.model import GPT, MLP, GPTConfig
from scalebook.moe import MoE, MoEConfig, Routing, aux_loss, route
from scalebook.parallel import expert
from scalebook.parity import max_relative_difference

# Relative to each tensor's largest reference entry (parity.max_relative_difference), per tensor. Float32 sums of
# the same terms in another order (all-reduce of the router's gradients, experts run on other batches of
# tokens): measured at most 4e-7 against the loop (outputs, input gradients, router and expert gradients, ep = 2
# and 4) and 5e-7 on the GPT. 1e-5 leaves 20x headroom, and a gradient off by a factor (a missing 1/ep), a token
# sent to the wrong expert or a wrong gate misses it by far.
TOLERANCE = 1e-5
TOKENS_PER_RANK = 32


def test_the_moe_layer_is_the_models_and_expert_parallelism_re_exports_it():
    """The layer lives with the model (``scalebook.moe``: the model never imports the parallel package); the chapters
    still reach it as ``expert.MoE`` etc., the same objects, so ``apply_expert_parallel`` finds the model's layers."""
    for name in ("MoEConfig", "MoE", "Expert", "Routing", "route", "aux_loss", "dispatch", "combine", "moe_mlp"):
        assert getattr(expert, name) is getattr(moe_module, name), name
    assert type(GPT(GPTConfig(n_experts=2, n_layer=1)).blocks[0].mlp) is expert.MoE


def test_capacity_and_dropping_follow_gshard_order():
    config = MoEConfig(d_model=2, d_ff=4, n_experts=2, top_k=1, capacity_factor=1.0)
    router = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    # Four tokens, three prefer expert 0: capacity ceil(1.0 * 1 * 4 / 2) = 2, so the third is dropped.
    hidden = torch.tensor([[2.0, 0.0], [3.0, 0.0], [0.0, 1.0], [4.0, 0.0]])
    routing = route(hidden, router, config)
    assert routing.capacity == 2
    assert routing.experts.squeeze(1).tolist() == [0, 0, 1, 0]
    assert routing.slots.squeeze(1).tolist() == [0, 1, 0, -1]
    assert routing.load.tolist() == [3, 1]
    # Without a capacity factor every expert has room for all four tokens: nothing drops.
    dropless = route(hidden, router, MoEConfig(d_model=2, d_ff=4, n_experts=2, top_k=1,
                                               capacity_factor=None))  # fmt: skip
    assert dropless.capacity == 4 and dropless.slots.squeeze(1).tolist() == [0, 1, 0, 2]


def test_moe_with_one_expert_and_ample_capacity_is_that_expert_times_gate_one():
    config = MoEConfig(d_model=8, d_ff=16, n_experts=1, top_k=1, capacity_factor=1.0)
    moe = MoE(config)
    x = torch.randn(2, 5, 8)
    assert torch.allclose(moe(x), moe.experts[0](x), atol=1e-6)


def test_gpt_with_experts_has_moe_mlps_of_the_dense_shape():
    dense = GPT(GPTConfig(n_layer=2, n_embd=32))
    moe = GPT(GPTConfig(n_layer=2, n_embd=32, n_experts=4, expert_top_k=2))
    assert all(isinstance(block.mlp, MLP) for block in dense.blocks)
    assert all(isinstance(block.mlp, MoE) for block in moe.blocks)
    layer = moe.blocks[0].mlp
    assert len(layer.experts) == 4 and layer.config.capacity_factor is None  # dropless unless asked
    assert layer.experts[0].c_fc.weight.shape == dense.blocks[0].mlp.c_fc.weight.shape
    # Four experts of the dense MLP's size, and a router of n_embd x 4, in each of the two blocks.
    mlp_params = sum(p.numel() for p in dense.blocks[0].mlp.parameters())
    assert moe.num_parameters() - dense.num_parameters() == 2 * (3 * mlp_params + 32 * 4)
    logits, loss = moe(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
    loss.backward()
    assert logits.shape == (2, 8, 256) and all(p.grad is not None for p in moe.parameters())


def test_aux_loss_is_one_for_uniform_routing():
    routing = Routing(
        experts=None, gates=None, slots=None, probs=torch.full((6, 3), 1 / 3), load=torch.tensor([4, 4, 4]), capacity=4
    )
    assert abs(aux_loss(routing, 3).item() - 1.0) < 1e-6


def test_bias_update_raises_underloaded_and_lowers_overloaded_experts():
    moe = MoE(MoEConfig(n_experts=4, bias_update=0.5))
    moe.update_bias(torch.tensor([10, 2, 2, 2]))
    assert moe.bias.tolist() == [-0.5, 0.5, 0.5, 0.5]


def moe_inputs(config: MoEConfig, tokens: int, seed: int = 0):
    """The full MoE's weights (built under ``seed``), the tokens and the loss weights, on every rank and here."""
    torch.manual_seed(seed)
    moe = MoE(config)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, config.d_model, generator=gen)
    weight = torch.randn(tokens, config.d_model, generator=gen)  # loss = mean over tokens of sum_d w * y
    return moe, x, weight


def loop_moe(x: torch.Tensor, w: dict[str, torch.Tensor], config: MoEConfig, groups: int) -> torch.Tensor:
    """The MoE by its definition, one expert at a time: per group of tokens, router logits, softmax, the top-k
    experts of each token with their probabilities as gates (not renormalised); each expert takes the tokens
    that chose it, every first choice (in token order) before any second choice, up to its capacity
    ceil(capacity_factor * k * tokens / E) and drops the rest; runs its MLP (d -> d_ff -> d, tanh GELU) on
    them; each token sums its experts' outputs times their gates."""
    E, k = config.n_experts, config.top_k
    outputs = []
    for h in x.chunk(groups):
        n = h.shape[0]
        probs = torch.softmax(h @ w["router.weight"].t(), dim=-1)
        chosen = probs.detach().topk(k, dim=-1).indices.tolist()
        capacity = n if config.capacity_factor is None else math.ceil(config.capacity_factor * k * n / E)
        out = torch.zeros_like(h)
        for e in range(E):
            tokens = [t for j in range(k) for t in range(n) if chosen[t][j] == e][:capacity]
            if not tokens:
                continue
            tokens = torch.tensor(tokens)
            hidden = F.gelu(F.linear(h[tokens], w[f"experts.{e}.c_fc.weight"], w[f"experts.{e}.c_fc.bias"]),
                            approximate="tanh")  # fmt: skip
            y = F.linear(hidden, w[f"experts.{e}.c_proj.weight"], w[f"experts.{e}.c_proj.bias"])
            out = out.index_add(0, tokens, y * probs[tokens, e].unsqueeze(-1))
        outputs.append(out)
    return torch.cat(outputs)


def expert_parallel_on_rank(config: MoEConfig) -> dict:
    """ExpertParallelMoE on this rank's tokens (one group per rank), the router's gradient averaged over the ranks
    as a data-parallel wrapper would, the experts' by ``reduce_expert_gradients``: this rank's output, its tokens'
    input gradients divided by ep (a token's share of the local mean is ep times its share of the global one), and
    the router's and this rank's experts' gradients under the full MoE's names."""
    rank, ep = dist.get_rank(), dist.get_world_size()
    moe, x, weight = moe_inputs(config, ep * TOKENS_PER_RANK)
    model = expert.ExpertParallelMoE.from_moe(moe)
    mine = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    x_mine = x[mine].clone().requires_grad_()
    y = model(x_mine)
    ((weight[mine] * y).sum() / TOKENS_PER_RANK).backward()
    dist.all_reduce(model.router.weight.grad.div_(ep))
    expert.reduce_expert_gradients(model)
    grads = {"router.weight": model.router.weight.grad}
    for j, layer in enumerate(model.experts):
        grads.update({f"experts.{model.first_expert + j}.{name}": p.grad for name, p in layer.named_parameters()})
    return {"output": y.detach(), "input_grad": x_mine.grad / ep, "grads": grads}


def gpt_expert_parallel_step(ep: int, seed: int = 0) -> dict:
    """On every rank: the MoE-GPT (4 experts per MLP) trained one step on dp = world ranks, its experts sharded
    over blocks of ep of them, next to the same GPT on the whole batch in this process
    (``experiments.expert.gpt_expert_parallel_errors``, returning the tensors, so that the test compares them per
    tensor): the logged loss, every gathered gradient, both runs', and whether the gathered state is the
    single process's."""
    rank, dp = dist.get_rank(), dist.get_world_size()
    ep_groups = [dist.new_group(list(range(b, b + ep))) for b in range(0, dp, ep)]  # every rank makes all
    replica_groups = [dist.new_group(list(range(e, dp, ep))) for e in range(ep)]
    torch.manual_seed(seed)
    reference = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, n_experts=4))
    model = copy.deepcopy(reference)
    gen = torch.Generator().manual_seed(seed + 1)
    idx, targets = (torch.randint(0, 64, (2 * dp, 16), generator=gen) for _ in range(2))
    _, reference_loss = reference(idx, targets)
    reference_loss.backward()
    expert.apply_expert_parallel(model, ep_groups[rank // ep])
    _, loss = model(idx[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2])  # this rank's two sequences
    loss.backward()
    sharded = set(expert.expert_parameters(model))
    for p in model.parameters():
        if p not in sharded:
            dist.all_reduce(p.grad.div_(dp))
    expert.reduce_expert_gradients(model, replica_groups[rank % ep] if dp > ep else None)
    logged = loss.detach().clone()
    dist.all_reduce(logged.div_(dp))
    state = expert.full_state_dict(model)
    return {
        "experts_here": len(model.blocks[0].mlp.experts),
        "sharded": len(sharded),
        "loss": logged.item(),
        "reference_loss": reference_loss.item(),
        "grads": expert.full_gradients(model),
        "reference_grads": {name: p.grad for name, p in reference.named_parameters()},
        "state_equal": state.keys() == reference.state_dict().keys()
        and all(torch.equal(state[k], v) for k, v in reference.state_dict().items()),
    }


def expert_parallel_checks() -> dict:
    """One launch, three claims: ExpertParallelMoE on all ranks (ep = world) against the loop, with its bytes
    and dropped tokens; the MoE-GPT with ep = 2 (inside dp = world) against one process; 3 experts refused."""
    results = {
        "moe": compare_expert_parallel(tokens_per_rank=TOKENS_PER_RANK),  # all-to-all bytes, dropped share
        "loop": expert_parallel_on_rank(MoEConfig()),
        "gpt": gpt_expert_parallel_step(2),
    }
    try:  # 3 experts do not deal out to 2 or 4 ranks
        expert.apply_expert_parallel(GPT(GPTConfig(n_layer=1, n_embd=32, n_experts=3)))
    except ValueError as error:
        results["bad"] = str(error)
    return results


@pytest.fixture(scope="module", params=[2, 4])
def launched(request):
    return request.param, launch(expert_parallel_checks, request.param, timeout=120)


def loop_reference(config: MoEConfig, ep: int) -> dict:
    """The per-expert loop on all ep * TOKENS_PER_RANK tokens in ep groups (one per rank), the same weights copied
    in, the loss the mean over all tokens: its output, input gradient and every parameter's gradient."""
    moe, x, weight = moe_inputs(config, ep * TOKENS_PER_RANK)
    w = {name: t.detach().clone().requires_grad_() for name, t in moe.state_dict().items() if name != "bias"}
    x = x.requires_grad_()
    y = loop_moe(x, w, config, groups=ep)
    ((weight * y).sum() / (ep * TOKENS_PER_RANK)).backward()
    return {"output": y.detach(), "input_grad": x.grad, "grads": {name: t.grad for name, t in w.items()}}


def test_expert_parallel_outputs_and_gradients_equal_a_per_expert_loop(launched):
    ep, results = launched
    config = MoEConfig()
    reference = loop_reference(config, ep)
    for rank, result in enumerate(results):
        mine = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
        r = result["loop"]
        errors = {
            "output": max_relative_difference({"y": r["output"]}, {"y": reference["output"][mine]}),
            "input_grad": max_relative_difference({"x": r["input_grad"]}, {"x": reference["input_grad"][mine]}),
            # The router and the experts this rank holds, each tensor against the loop's.
            "params": max_relative_difference(r["grads"], {n: reference["grads"][n] for n in r["grads"]}),
        }
        assert max(errors.values()) < TOLERANCE, (ep, rank, errors)
        assert len(r["grads"]) == 1 + 4 * config.n_experts // ep  # router, and c_fc, c_proj weight and bias each
        # Two all-to-alls forward, two backward, each sending all but this rank's own share of (E, C, d).
        per_call = expert.dispatch_bytes_per_rank(TOKENS_PER_RANK, config, ep)
        assert result["moe"]["forward"]["all_to_all_single"] == (2, 2 * per_call)
        assert result["moe"]["backward"]["all_to_all_single"] == (2, 2 * per_call)
    assert any(r["moe"]["dropped"] > 0 for r in results)  # the capacity really dropped tokens in this test


def test_gpt_loss_gradients_and_state_equal_one_process_under_expert_parallelism(launched):
    dp, results = launched
    for rank, r in enumerate(result["gpt"] for result in results):
        # 4 experts over ep = 2: two per rank in each of the 2 blocks (c_fc, c_proj weight and bias each).
        assert r["experts_here"] == 2 and r["sharded"] == 2 * 2 * 4, r
        assert r["state_equal"], rank
        loss_error = abs(r["loss"] - r["reference_loss"]) / r["reference_loss"]
        grad_error = max_relative_difference(r["grads"], r["reference_grads"])  # names must match, too
        assert loss_error < TOLERANCE and grad_error < TOLERANCE, (dp, rank, loss_error, grad_error)
    assert all(f"n_experts (3) must be divisible by the expert-parallel size ep ({dp})" in r["bad"] for r in results)


def test_bias_balancing_lowers_imbalance_against_no_balancing():
    late = slice(60, 100)
    none = train_load_balance("none", steps=100, batch_size=4)["imbalance"][late]
    bias = train_load_balance("bias", steps=100, batch_size=4)["imbalance"][late]
    assert sum(bias) / len(bias) < 0.8 * sum(none) / len(none)


def test_balancing_rates_reach_the_layers():
    # With a rate of zero either method is no balancing at all, step for step; with the defaults (aux 0.01, bias
    # update 0.005) the runs part from the unbalanced one, so the rates are really applied to every MoE layer.
    none = train_load_balance("none", steps=5, batch_size=2)
    assert train_load_balance("aux_loss", steps=5, batch_size=2, aux_loss_weight=0.0) == none
    assert train_load_balance("bias", steps=5, batch_size=2, bias_update=0.0) == none
    assert train_load_balance("aux_loss", steps=5, batch_size=2)["loss"] != none["loss"]
    assert train_load_balance("bias", steps=5, batch_size=2)["imbalance"] != none["imbalance"]


def test_bad_moe_config_raises():
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(n_experts=2, top_k=3)
    with pytest.raises(ValueError, match="expert_top_k"):
        GPTConfig(n_experts=2, expert_top_k=3)
    with pytest.raises(ValueError, match="n_experts must be an integer >= 0"):
        GPTConfig(n_experts=-1)
    with pytest.raises(ValueError, match="expert_capacity_factor"):
        GPTConfig(n_experts=2, expert_capacity_factor=0.0)
    with pytest.raises(ValueError, match="balancing must be one of"):
        train_load_balance("random")
    with pytest.raises(ValueError, match="n_experts \\(3\\) must be divisible by the expert-parallel size ep \\(2\\)"):
        expert.validate_expert_parallel(3, 2)
    with pytest.raises(ValueError, match="no mixture-of-experts layer"):
        expert.apply_expert_parallel(GPT(GPTConfig(n_layer=1)))
