"""Mixture of experts: routing and capacity by hand, expert parallelism equal to one rank, balancing works."""

import pytest
import torch

from scalebook.comm import launch
from scalebook.parallel import expert

# Float32 sums of the same terms in another order (all-reduce of router gradients): ~1e-8 here, against
# gradients of ~5e-2; 1e-5 is a safe bound, and a gradient off by a factor (a missing 1/ep) misses it by far.
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


def test_moe_with_one_expert_and_ample_capacity_is_that_expert_times_gate_one():
    config = expert.MoEConfig(d_model=8, d_ff=16, n_experts=1, top_k=1, capacity_factor=1.0)
    moe = expert.MoE(config)
    x = torch.randn(2, 5, 8)
    y, _ = moe(x)
    assert torch.allclose(y, moe.experts[0](x), atol=1e-6)


def test_aux_loss_is_one_for_uniform_routing():
    routing = expert.Routing(
        experts=None, gates=None, slots=None, probs=torch.full((6, 3), 1 / 3), load=torch.tensor([4, 4, 4]), capacity=4
    )
    assert abs(expert.aux_loss(routing, 3).item() - 1.0) < 1e-6


def test_bias_update_raises_underloaded_and_lowers_overloaded_experts():
    moe = expert.MoE(expert.MoEConfig(n_experts=4, bias_update=0.5))
    moe.update_bias(torch.tensor([10, 2, 2, 2]))
    assert moe.bias.tolist() == [-0.5, 0.5, 0.5, 0.5]


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_outputs_and_gradients_equal_one_rank_moe(ep):
    results = launch(expert.compare_expert_parallel, ep, tokens_per_rank=32)
    config = expert.MoEConfig()
    for r in results:
        # Each rank's loss is the mean over its own tokens; the reference's, the mean over all of them.
        errors = [r[k] for k in ("output_error", "input_grad_error", "router_grad_error", "expert_grad_error")]
        assert max(errors) < TOLERANCE, r
        assert r["grad_scale"] > 100 * TOLERANCE  # the gradients are large enough for a wrong 1/ep to show
        # Two all-to-alls forward, two backward, each sending all but this rank's own share of (E, C, d).
        per_call = expert.dispatch_bytes_per_rank(32, config, ep)
        assert r["forward"]["all_to_all_single"] == (2, 2 * per_call)
        assert r["backward"]["all_to_all_single"] == (2, 2 * per_call)
    assert any(r["dropped"] > 0 for r in results)  # the capacity really dropped tokens in this test


def test_bias_balancing_lowers_imbalance_against_no_balancing():
    late = slice(60, 100)
    none = expert.train_load_balance("none", steps=100, batch_size=4)["imbalance"][late]
    bias = expert.train_load_balance("bias", steps=100, batch_size=4)["imbalance"][late]
    assert sum(bias) / len(bias) < 0.8 * sum(none) / len(none)


def test_bad_moe_config_raises():
    with pytest.raises(ValueError, match="top_k"):
        expert.MoEConfig(n_experts=2, top_k=3)
    with pytest.raises(ValueError, match="balancing must be one of"):
        expert.train_load_balance("random")
