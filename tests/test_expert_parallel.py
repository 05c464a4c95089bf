"""Mixture of experts: routing and capacity by hand, expert parallelism equal to one rank, balancing works.
On the GPT, a dropless MoE option whose expert-parallel run (alone, and inside data parallelism) gives one
process's loss and every one of its gradients, and whose gathered state is the single-process state."""

import pytest
import torch

from scalebook.comm import launch
from scalebook.experiments.expert import compare_expert_parallel, gpt_expert_parallel_errors, train_load_balance
from scalebook.model import GPT, MLP, GPTConfig
from scalebook.parallel import expert

# Float32 sums of the same terms in another order (all-reduce of router gradients, experts run on other
# batches of tokens): ~1e-8 here, against gradients of ~5e-2; 1e-5 is a safe bound, and a gradient off by
# a factor (a missing 1/ep) misses it by far.
TOLERANCE = 1e-5


def test_capacity_and_dropping_follow_gshard_order():
    config = expert.MoEConfig(d_model=2, d_ff=4, n_experts=2, top_k=1, capacity_factor=1.0)
    router = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    # Four tokens, three prefer expert 0: capacity ceil(1.0 * 1 * 4 / 2) = 2, so the third is dropped.
    hidden = torch.tensor([[2.0, 0.0], [3.0, 0.0], [0.0, 1.0], [4.0, 0.0]])
    routing = expert.route(hidden, router, config)
    assert routing.capacity == 2
    assert routing.experts.squeeze(1).tolist() == [0, 0, 1, 0]
    assert routing.slots.squeeze(1).tolist() == [0, 1, 0, -1]
    assert routing.load.tolist() == [3, 1]
    # Without a capacity factor every expert has room for all four tokens: nothing drops.
    dropless = expert.route(hidden, router, expert.MoEConfig(d_model=2, d_ff=4, n_experts=2, top_k=1,
                                                             capacity_factor=None))  # fmt: skip
    assert dropless.capacity == 4 and dropless.slots.squeeze(1).tolist() == [0, 1, 0, 2]


def test_moe_with_one_expert_and_ample_capacity_is_that_expert_times_gate_one():
    config = expert.MoEConfig(d_model=8, d_ff=16, n_experts=1, top_k=1, capacity_factor=1.0)
    moe = expert.MoE(config)
    x = torch.randn(2, 5, 8)
    assert torch.allclose(moe(x), moe.experts[0](x), atol=1e-6)


def test_gpt_with_experts_has_moe_mlps_of_the_dense_shape():
    dense = GPT(GPTConfig(n_layer=2, n_embd=32))
    moe = GPT(GPTConfig(n_layer=2, n_embd=32, n_experts=4, expert_top_k=2))
    assert all(isinstance(block.mlp, MLP) for block in dense.blocks)
    assert all(isinstance(block.mlp, expert.MoE) for block in moe.blocks)
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
    routing = expert.Routing(
        experts=None, gates=None, slots=None, probs=torch.full((6, 3), 1 / 3), load=torch.tensor([4, 4, 4]), capacity=4
    )
    assert abs(expert.aux_loss(routing, 3).item() - 1.0) < 1e-6


def test_bias_update_raises_underloaded_and_lowers_overloaded_experts():
    moe = expert.MoE(expert.MoEConfig(n_experts=4, bias_update=0.5))
    moe.update_bias(torch.tensor([10, 2, 2, 2]))
    assert moe.bias.tolist() == [-0.5, 0.5, 0.5, 0.5]


def expert_parallel_checks() -> dict:
    """One launch, two claims: ExpertParallelMoE against one MoE on all ranks (ep = world); the MoE-GPT with
    ep = 2 (inside dp = world) against one process."""
    results = {"moe": compare_expert_parallel(tokens_per_rank=32), "gpt": gpt_expert_parallel_errors(2)}
    try:  # 3 experts do not deal out to 2 or 4 ranks
        expert.apply_expert_parallel(GPT(GPTConfig(n_layer=1, n_embd=32, n_experts=3)))
    except ValueError as error:
        results["bad"] = str(error)
    return results


@pytest.fixture(scope="module", params=[2, 4])
def launched(request):
    return request.param, launch(expert_parallel_checks, request.param, timeout=120)


def test_expert_parallel_outputs_and_gradients_equal_one_rank_moe(launched):
    ep, results = launched
    config = expert.MoEConfig()
    for result in results:
        r = result["moe"]
        # Each rank's loss is the mean over its own tokens; the reference's, the mean over all of them.
        errors = [r[k] for k in ("output_error", "input_grad_error", "router_grad_error", "expert_grad_error")]
        assert max(errors) < TOLERANCE, r
        assert r["grad_scale"] > 100 * TOLERANCE  # the gradients are large enough for a wrong 1/ep to show
        # Two all-to-alls forward, two backward, each sending all but this rank's own share of (E, C, d).
        per_call = expert.dispatch_bytes_per_rank(32, config, ep)
        assert r["forward"]["all_to_all_single"] == (2, 2 * per_call)
        assert r["backward"]["all_to_all_single"] == (2, 2 * per_call)
    assert any(r["moe"]["dropped"] > 0 for r in results)  # the capacity really dropped tokens in this test


def test_gpt_loss_gradients_and_state_equal_one_process_under_expert_parallelism(launched):
    dp, results = launched
    for rank, r in enumerate(result["gpt"] for result in results):
        # 4 experts over ep = 2: two per rank in each of the 2 blocks (c_fc, c_proj weight and bias each).
        assert r["experts_here"] == 2 and r["sharded"] == 2 * 2 * 4, r
        assert r["grad_names_match"] and r["state_equal"], r
        assert r["loss_error"] < TOLERANCE and r["grad_error"] < TOLERANCE, (dp, rank, r)
        assert r["grad_scale"] > 1000 * TOLERANCE  # a gradient off by a factor (1/ep, 1/dp) would show
    assert all(f"n_experts (3) must be divisible by the expert-parallel size ep ({dp})" in r["bad"] for r in results)


def test_bias_balancing_lowers_imbalance_against_no_balancing():
    late = slice(60, 100)
    none = train_load_balance("none", steps=100, batch_size=4)["imbalance"][late]
    bias = train_load_balance("bias", steps=100, batch_size=4)["imbalance"][late]
    assert sum(bias) / len(bias) < 0.8 * sum(none) / len(none)


def test_bad_moe_config_raises():
    with pytest.raises(ValueError, match="top_k"):
        expert.MoEConfig(n_experts=2, top_k=3)
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
