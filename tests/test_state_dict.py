"""A checkpoint save never changes training (issue 34): a run that saves before its first step and in the middle
takes, bit for bit, the steps of a run that never saves (losses, weights, optimizer state); and what it saved
resumes those steps bit for bit, on one process and under ZeRO-1 on 2 ranks.

The trap: a parameter without optimizer state (before the first step; one that never had a gradient) still needs
tensors for a load to fill. Stepping it at lr 0 on every save, as the state adapter once did, moved AdamW's step
count to 1, so that its first real update used the bias correction of step 2.
"""

import pytest
import torch

from scalebook import data
from scalebook.comm import launch
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.dims import ParallelDims
from scalebook.parallel.parallelize import ParallelModel, parallelize
from scalebook.parallel.state_dict import get_state_dict
from scalebook.train import checkpoint

STEPS = 4
SAVES = (0, 2)  # before the first step, and after two
NO_GRADIENT_UNTIL = 2  # wpe.weight gets no gradient in steps 0 and 1: it has no AdamW state when step 2 saves
CONFIG = GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16)
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, "foreach": False}


def _runtime(layout: str):
    torch.manual_seed(0)
    gpt = GPT(CONFIG)
    if layout == "single":
        return ParallelModel(gpt, torch.optim.AdamW(gpt.parameters(), **ADAMW))
    return parallelize(gpt, ParallelDims(2, dp=2, data_parallel=layout), **ADAMW)


def _batches(pm) -> list:
    generator = torch.Generator().manual_seed(1)
    dp, rank = pm.dims.dp, pm.coords["dp"]
    return [data.get_batch(data.corpus_tokens(), 2, 16, generator, rank=rank, world_size=dp) for _ in range(STEPS)]


def _train(pm, root, *, saves=(), first: int = 0) -> dict:
    """Steps ``first`` to STEPS - 1, saving checkpoint s (through DCP, published) before step s for s in ``saves``;
    the losses, and the weights and optimizer state at the end."""
    saver, losses = checkpoint.Checkpointer(root, {}), []
    inner = getattr(pm.optimizer, "optim", pm.optimizer)  # ZeRO-1: the optimizer of this rank's shard
    for step, (x, y) in enumerate(_batches(pm)):
        if step < first:
            continue
        if step in saves:
            before = _cloned(inner.state_dict())
            saver.save(pm.state_dict(), step)
            # The save itself leaves the optimizer's state as it was, bit for bit: which parameters have state,
            # and every step count (wpe.weight has none at either save).
            assert _equal(inner.state_dict(), before), f"the save before step {step} changed the optimizer's state"
        losses.append(pm.forward_backward(x, y).item())
        if step < NO_GRADIENT_UNTIL:
            pm.model.wpe.weight.grad = None
        pm.step()
        pm.zero_grad()
    return {"losses": losses, "weights": {k: v.clone() for k, v in pm.model.state_dict().items()},
            "optimizer": inner.state_dict()}  # fmt: skip


def _resumed(layout: str, root, step: int) -> dict:
    """A fresh runtime loads checkpoint ``step`` as ``RunCheckpoints.resume`` does, then trains to the end."""
    pm = _runtime(layout)
    saver = checkpoint.Checkpointer(root, {})
    state = get_state_dict(pm, saved=saver.saved_names(step))
    saver.load(state, step)
    pm.load_state_dict(state)
    return _train(pm, root, first=step)


def _cloned(a):
    """A copy of ``a`` (nested dicts and lists of tensors) that later in-place updates cannot reach."""
    if isinstance(a, dict):
        return {k: _cloned(v) for k, v in a.items()}
    if isinstance(a, (list, tuple)):
        return type(a)(_cloned(v) for v in a)
    return a.clone() if torch.is_tensor(a) else a


def _equal(a, b) -> bool:
    """Bit for bit, through nested dicts and lists (optimizer state dicts: which parameters have state, too)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if torch.is_tensor(a):
        return torch.equal(a, b)
    return a == b


def _runs(layout: str, root) -> dict:
    root = root if layout == "single" else f"{root}/{layout}"
    out = {"plain": _train(_runtime(layout), f"{root}/plain"), "saving": _train(_runtime(layout), root, saves=SAVES)}
    for step in SAVES:
        out[f"from {step}"] = _resumed(layout, root, step)
    return out


def _zero1_runs(root) -> dict:
    return _runs("zero1", root)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _runs("single", tmp_path_factory.mktemp("single"))


@pytest.fixture(scope="module")
def zero1(tmp_path_factory):
    return launch(_zero1_runs, 2, str(tmp_path_factory.mktemp("zero1")), timeout=120)


def test_saving_before_the_first_step_and_midway_leaves_the_run_bit_for_bit_as_without(single):
    plain, saving = single["plain"], single["saving"]
    assert saving["losses"] == plain["losses"]
    assert _equal(saving["weights"], plain["weights"])
    assert _equal(saving["optimizer"], plain["optimizer"])  # the step counts of every parameter, wpe's included


@pytest.mark.parametrize("step", SAVES)
def test_a_resume_from_either_save_takes_the_same_steps_bit_for_bit(single, step):
    plain, resumed = single["plain"], single[f"from {step}"]
    assert resumed["losses"] == plain["losses"][step:]
    assert _equal(resumed["weights"], plain["weights"]) and _equal(resumed["optimizer"], plain["optimizer"])


def test_a_save_before_the_first_step_holds_no_optimizer_state_and_changes_none(tmp_path):
    pm = _runtime("single")
    state = pm.state_dict()
    assert not any(key.startswith("optim.") for key in state) and not pm.optimizer.state
    saved = get_state_dict(pm, saved=set(state))  # a load from it: nothing to create, nothing created
    assert saved.keys() == state.keys() and not pm.optimizer.state


@pytest.mark.parametrize("run", ["saving", "from 0", "from 2"])
def test_zero1_on_two_ranks_saves_and_resumes_bit_for_bit(zero1, run):
    for rank in zero1:
        plain, other = rank["plain"], rank[run]
        first = 0 if run == "saving" else int(run.split()[-1])
        assert other["losses"] == plain["losses"][first:]
        assert _equal(other["weights"], plain["weights"]) and _equal(other["optimizer"], plain["optimizer"])
