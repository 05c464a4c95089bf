"""Every strategy keeps its tensors on the model's device: building it with ``parallelize`` and running one step
(forward and backward of every micro-batch, the gradient norm, the optimizer step) allocates nothing on the
default device and copies nothing to the host, so that the same code runs on GPUs.

How the check works, and why this way. On this machine the model lives on the CPU, which is also torch's default
device, so a misplaced tensor cannot be seen by its device: ``torch.zeros(n)`` lands on the CPU either way, and
only on a GPU would it meet a CUDA tensor and fail. The test therefore checks the cause rather than the effect:
a ``TorchFunctionMode`` sees every torch call, and records those made *from the package's own source files*
(the caller's frame is under ``code/scalebook``) that would put a tensor off the model's device on a GPU:

* a factory (``torch.zeros``, ``torch.arange``, ...) called without ``device=``: it lands on the default device;
  ``*_like`` and ``Tensor.new_*`` inherit their tensor's device and are not factories here;
* ``Tensor.cpu()`` or ``Tensor.numpy()``: a copy to the host.

Calls made by PyTorch itself are not recorded: its DDP, FSDP2 and optimizers are device-generic upstream, and
keep 0-dim CPU scalars on purpose (AdamW's step count). The alternatives the issue suggests were tried first and
fail inside PyTorch, not in the package: a model on the ``meta`` device stops at torch DDP's parameter check
(``.item()``), FSDP2's device handle, ``batch_isend_irecv`` (no backend for ``meta``) and the data-dependent
``nonzero`` of expert routing; ``torch.set_default_device("meta")`` also moves AdamW's step count, whose
``.item()`` then fails; torch's fake process group (one process, no-op collectives) leaves the futures of async
collectives without a value, which both DDPs read. So the ranks are real gloo ranks started by
:func:`scalebook.comm.launch` (NCCL's ordering rules checked too), one launch per world size for all its layouts,
and every rank's record is checked, so that every pipeline stage and expert shard is seen.
:func:`test_audit_catches_a_planted_allocation` shows that the check fails when package code allocates without a
device.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import scalebook
from scalebook.comm import launch
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.dims import ParallelDims
from scalebook.parallel.parallelize import parallelize

PACKAGE = str(Path(scalebook.__file__).resolve().parent)
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.as_tensor, torch.arange,
             torch.linspace, torch.eye, torch.rand, torch.randn, torch.randint, torch.randperm, torch.empty_strided,
             torch.scalar_tensor}  # fmt: skip
HOST_COPIES = {torch.Tensor.cpu, torch.Tensor.numpy}


class DeviceAudit(TorchFunctionMode):
    """Records (file:line, call) for each call from the package's source that places a tensor on the default
    device or copies one to the host (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.misplaced: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        caller = sys._getframe(1)  # torch's factories are C functions: the frame that called them
        if caller.f_code.co_filename.startswith(PACKAGE):
            where = f"{Path(caller.f_code.co_filename).relative_to(PACKAGE)}:{caller.f_lineno}"
            if func in FACTORIES and kwargs.get("device") is None:
                self.misplaced.append(f"{where} {func.__name__} without device=")
            elif func in HOST_COPIES:
                self.misplaced.append(f"{where} Tensor.{func.__name__}()")
        return func(*args, **kwargs)


CONFIG = GPTConfig(n_layer=4, n_head=4, n_embd=32, block_size=32)
MOE = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=32, n_experts=4)
# Strategy -> (world size, ParallelDims.build's degrees, config): every data-parallel wrapper, every dimension,
# and the compositions that the CLI's tests train (tests/test_cli_strategies.py).
LAYOUTS = {
    "single": (1, {}, CONFIG),
    "torch-ddp": (2, {"data_parallel": "torch-ddp"}, CONFIG),
    "fsdp": (2, {"data_parallel": "fsdp"}, CONFIG),
    "ddp": (2, {"data_parallel": "ddp"}, CONFIG),
    "zero1": (2, {"data_parallel": "zero1"}, CONFIG),
    "zero2": (2, {"data_parallel": "zero2"}, CONFIG),
    "zero3": (2, {"data_parallel": "zero3"}, CONFIG),
    "tp": (2, {"tp": 2}, CONFIG),
    "tp + sp": (2, {"tp": 2, "sequence_parallel": True}, CONFIG),
    "pp": (2, {"pp": 2}, CONFIG),
    "cp": (2, {"cp": 2, "data_parallel": "ddp"}, CONFIG),
    "ep": (2, {"ep": 2, "data_parallel": "ddp"}, MOE),
    "3d": (4, {"dp": 1, "tp": 2, "pp": 2}, CONFIG),
    "dp2 x pp2": (4, {"dp": 2, "pp": 2, "data_parallel": "ddp"}, CONFIG),
    "zero1 dp2 x tp2": (4, {"tp": 2, "data_parallel": "zero1"}, CONFIG),
    "tp2 x cp2": (4, {"tp": 2, "cp": 2, "data_parallel": "ddp"}, CONFIG),
    "dp4 x ep2": (4, {"ep": 2, "data_parallel": "ddp"}, MOE),
}
SEQ_LEN, GLOBAL_BATCH = 16, 8


def audit_step(name: str) -> list[str]:
    """Build layout ``name`` on this rank and run one step under :class:`DeviceAudit`; what it recorded."""
    world_size, degrees, config = LAYOUTS[name]
    torch.manual_seed(0)
    model = GPT(config)  # built outside the audit, as a user does: on the CPU, then moved to the device
    dims = ParallelDims.build(world_size, config, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, micro_batch=1,
                              **degrees)  # fmt: skip
    x = torch.randint(0, config.vocab_size, (GLOBAL_BATCH // dims.dp, SEQ_LEN))
    with DeviceAudit() as audit:
        parallel = parallelize(model, dims, lr=1e-3)
        parallel.forward_backward(x, x.roll(-1, dims=1))
        parallel.clip_grad_norm_(1.0)
        parallel.step()
        parallel.zero_grad()
    return audit.misplaced


def audit_layouts(names: list[str]) -> dict[str, list[str]]:
    """Worker: every layout of ``names`` on this rank, one after the other (one launch for them all)."""
    return {name: audit_step(name) for name in names}


def layouts_of(world_size: int) -> list[str]:
    return [name for name, (size, _, _) in LAYOUTS.items() if size == world_size]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, list[str]]]:
    """Each rank's record per two-rank layout: one launch of real gloo ranks for them all."""
    return launch(audit_layouts, 2, layouts_of(2), timeout=300)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, list[str]]]:
    return launch(audit_layouts, 4, layouts_of(4), timeout=300)


def test_one_process_allocates_on_the_model_device_and_copies_nothing_to_the_host():
    assert audit_step("single") == []


@pytest.mark.parametrize("strategy", layouts_of(2))
def test_strategy_allocates_on_the_model_device_and_copies_nothing_to_the_host(two_ranks, strategy):
    for rank, record in enumerate(two_ranks):
        assert record[strategy] == [], f"{strategy}, rank {rank}"


@pytest.mark.parametrize("strategy", layouts_of(4))
def test_composition_allocates_on_the_model_device_and_copies_nothing_to_the_host(four_ranks, strategy):
    for rank, record in enumerate(four_ranks):
        assert record[strategy] == [], f"{strategy}, rank {rank}"


def test_audit_catches_a_planted_allocation(monkeypatch):
    """The check can fail: a loss accumulator made with ``torch.zeros(())`` (no device) in the step is recorded,
    with the file and line of the planted call."""
    from scalebook.parallel import parallelize as module

    planted = "def _mean_over_replicas(self, loss):\n    return loss + torch.zeros((), dtype=loss.dtype)\n"
    namespace = {"torch": torch}
    exec(compile(planted, module.__file__, "exec"), namespace)  # compiled as if written in parallelize.py
    monkeypatch.setattr(module.ParallelModel, "_mean_over_replicas", namespace["_mean_over_replicas"])
    assert audit_step("single") == ["parallel/parallelize.py:2 zeros without device="]


def test_an_older_torch_gets_the_collectives_new_names():
    """The GPU machines run torch 2.11, which lacks 2.13's ``all_gather_single`` and ``reduce_scatter_single``:
    importing any module of the package that calls the new names, alone, gives them their older names' functions."""
    callers = sorted(
        ".".join(path.relative_to(Path(PACKAGE).parent).with_suffix("").parts)
        for path in Path(PACKAGE).rglob("*.py")
        if re.search(r"dist\.(all_gather|reduce_scatter)_single\(", path.read_text(encoding="utf8"))
    )
    assert "scalebook.parallel.sequence" in callers and "scalebook.labs.checks" in callers
    for caller in callers:
        older_torch = (
            "import torch.distributed as dist\n"
            "from torch.distributed import distributed_c10d as c10d\n"
            "for module in (dist, c10d):\n"
            "    del module.all_gather_single, module.reduce_scatter_single\n"
            f"import {caller}\n"
            "for module in (dist, c10d):\n"
            "    assert module.all_gather_single is module.all_gather_into_tensor\n"
            "    assert module.reduce_scatter_single is module.reduce_scatter_tensor\n"
        )
        done = subprocess.run([sys.executable, "-c", older_torch], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (caller, done.stderr[-2000:])
