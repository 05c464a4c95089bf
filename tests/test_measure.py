"""Measured bytes: storages counted once, model states matching the accounting formulas exactly."""

import torch

from scalebook import accounting, measure
from scalebook.model import GPT, GPTConfig
from scalebook.train import TrainConfig, make_optimizer


def test_shared_storage_is_counted_once():
    base = torch.zeros(10, 10)
    assert measure.tensor_bytes([base, base.t(), base[2:5]]) == 400
    assert measure.tensor_bytes([base, torch.zeros(3, dtype=torch.float16)]) == 406


def test_tied_embedding_is_counted_once():
    model = GPT(GPTConfig.named("tiny"))
    held = measure.model_state_bytes(model)
    assert held.params == 4 * model.num_parameters()
    assert held.grads == 0 and held.optimizer == 0


def test_fp32_adam_states_equal_the_formula_after_a_step():
    model = GPT(GPTConfig.named("tiny", n_layer=2))
    opt = make_optimizer(model, TrainConfig())
    idx = torch.randint(0, 256, (2, 33))
    model(idx[:, :-1], idx[:, 1:])[1].backward()
    opt.step()
    held = measure.model_state_bytes(model, opt)
    predicted = accounting.model_state_bytes(model.num_parameters(), precision="fp32", optimizer="adam")
    assert (held.params, held.grads, held.optimizer) == (predicted.params, predicted.grads, predicted.optimizer)
    assert held.total == predicted.total == 16 * model.num_parameters()
