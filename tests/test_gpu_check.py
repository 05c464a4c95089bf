"""``make gpu-check`` (bench/gpu_check.py): without CUDA it claims nothing and exits 0; its arithmetic (the device's
peak, MFU, the accounting's bytes), its loss and gradient-norm comparison (which catches a missing 1/d that the
losses hide) and its result files are right, and its two throughput loops train alike, checked here on the CPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def test_without_cuda_it_runs_nothing_claims_nothing_and_exits_0(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (0, "no CUDA device: nothing run, nothing claimed\n", "")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("device_name", "hardware"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", None),  # 756 dense bf16 TFLOP/s, not the SXM part's 989.5
        ("NVIDIA H100 NVL", None),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-sxm4-40gb"),
        ("Tesla V100-SXM2-32GB", "v100-sxm2-32gb"),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_device_names_match_their_configs_entry(device_name, hardware):
    assert gpu_check.hardware_name(device_name) == hardware


def test_mfu_of_gpt2_124m_on_an_h100():
    # GPT-2 124M at 1,024 tokens, Narayanan et al.'s count: 3 (2 L 12 h^2 + 4 L s h) + 3 (2 h V) FLOPs per token,
    # L = 12, h = 768, s = 1024, V = 50257: 3 (169,869,312 + 37,748,736) + 231,584,256 = 854,438,400. At 500,000
    # tokens/s against the H100 SXM's dense bf16 peak of 989.5 TFLOP/s: 0.43175...
    mfu = gpu_check.model_flops_utilization(500_000, "NVIDIA H100 80GB HBM3", 1024)
    assert mfu == pytest.approx(854_438_400 * 500_000 / 989.5e12, rel=1e-12)
    assert gpu_check.model_flops_utilization(500_000, "NVIDIA GeForce RTX 4090", 1024) is None


def test_predicted_states_are_16_bytes_per_gpt2_parameter():
    # Hugging Face's GPT2LMHeadModel has 124,439,808 parameters (the head tied to the embedding); fp32 weights
    # and gradients, and AdamW's two fp32 moments: 16 bytes each.
    predicted = gpu_check.predicted_step_bytes(16, 1024)
    assert predicted["states"] == 16 * 124_439_808
    assert predicted["total"] == predicted["states"] + predicted["activations"] > predicted["states"]


def test_losses_agree_within_the_stated_tolerance_and_on_the_same_steps():
    reference = {1: 5.0, 2: 4.0}
    assert gpu_check.losses_agree(reference, {1: 5.0 * (1 + 0.9 * gpu_check.LOSS_RTOL), 2: 4.0})
    assert not gpu_check.losses_agree(reference, {1: 5.0 * (1 + 2 * gpu_check.LOSS_RTOL), 2: 4.0})
    assert not gpu_check.losses_agree(reference, {1: 5.0})


def test_grad_norms_agree_within_the_stated_tolerance_and_on_the_same_steps():
    reference = {1: 4.0, 2: 3.0}
    assert gpu_check.grad_norms_agree(reference, {1: 4.0 * (1 + 0.9 * gpu_check.GRAD_NORM_RTOL), 2: 3.0})
    assert not gpu_check.grad_norms_agree(reference, {1: 4.0 * (1 + 2 * gpu_check.GRAD_NORM_RTOL), 2: 3.0})
    assert not gpu_check.grad_norms_agree(reference, {1: 4.0})


def test_a_planted_factor_of_2_on_the_gradients_fails_the_check_though_the_losses_agree():
    # Two ranks summing their gradients instead of averaging them: the gradient norm before clipping doubles on
    # every step, while clipping at 1.0 (the norms are 2 to 9) hands AdamW the same direction, so the losses stay
    # those of one process. The fabricated runs below are that case.
    losses = {1: 5.55, 2: 5.31, 3: 5.02, 4: 4.80, 5: 4.61, 6: 4.43}
    norms = {1: 8.7, 2: 6.1, 3: 4.4, 4: 3.2, 5: 2.6, 6: 2.1}
    reference = SimpleNamespace(losses=losses, grad_norms=norms)
    summed = SimpleNamespace(losses=dict(losses), grad_norms={s: 2 * n for s, n in norms.items()})
    row = gpu_check.compare_with_reference(reference, summed)
    assert gpu_check.losses_agree(reference.losses, summed.losses)
    assert row["agree"] is False
    assert row["note"] == "max rel. diff: loss 0.0e+00, grad norm 1.0e+00"
    averaged = SimpleNamespace(losses=dict(losses), grad_norms={s: n * (1 + 1e-6) for s, n in norms.items()})
    assert gpu_check.compare_with_reference(reference, averaged)["agree"] is True
    # A run that stopped early does not agree, whichever list is short.
    short = SimpleNamespace(losses={1: 5.55}, grad_norms={1: 8.7})
    assert gpu_check.compare_with_reference(reference, short)["agree"] is False


def test_results_are_written_as_json_and_a_markdown_table(tmp_path):
    predicted = {"states": 1, "activations": 2, "total": 9.87e9}
    row = {"loop": "plain loop", "compile": True, "tokens_per_second": 123456.7, "mfu": 0.4321,
           "peak_memory_bytes": 12_340_000_000, "predicted_bytes": predicted}  # fmt: skip
    results = {"date": "2026-11-25", "device": "NVIDIA H100 80GB HBM3", "gpus": 1, "torch": "2.11.0", "cuda": "13.0",
               "strategies": {"single": {"ranks": 1, "agree": True,
                                         "note": "max rel. diff: loss 0.0e+00, grad norm 0.0e+00"},
                              "tp": {"ranks": 2, "agree": None, "note": "needs 2 GPUs, this machine has 1"}},
               "throughput": [row], "ratios": [{"compile": True, "ratio": 0.9876, "blocks": 6, "block": 5}],
               }  # fmt: skip
    json_path, md_path = gpu_check.write_results(results, tmp_path)
    assert json_path == tmp_path / "2026-11-25-nvidia-h100-80gb-hbm3.json"
    assert json.loads(json_path.read_text()) == results
    table = md_path.read_text()
    assert "losses (rtol 0.0001) and grad norms (rtol 0.001) equal one process" in table
    assert "| single | 1 | yes | max rel. diff: loss 0.0e+00, grad norm 0.0e+00 |" in table
    assert "| tp | 2 | not run | needs 2 GPUs, this machine has 1 |" in table
    assert "| plain loop | True | 123,457 | 43.2% | 12.34 | 9.87 |" in table
    assert "| True | 0.988 |" in table


def test_the_two_throughput_loops_train_alike():
    """Like for like: the package loop and the plain loop, on the same model, batch, AdamW, schedule and clipping,
    take the same steps (the book's tiny GPT on the CPU, bf16 autocast as on the GPU)."""
    losses = {}
    for name, loop in (("package", gpu_check.package_steps), ("plain", gpu_check.plain_steps)):
        raw, optimizer, steps = loop(2, 32, False, size="tiny", device="cpu")
        # The for-loop AdamW on the CPU: False as the plain loop asks, or torch's default (None), which picks it
        # for CPU tensors (the package leaves foreach to torch, which takes the multi-tensor kernel on a GPU).
        assert optimizer.defaults["foreach"] in (False, None) and not optimizer.defaults["fused"]
        losses[name] = [float(next(steps)) for _ in range(4)]
    assert losses["package"] == pytest.approx(losses["plain"], rel=1e-5)
    assert losses["package"][-1] < losses["package"][0]  # it learns, so the steps really differ


def test_the_interleaved_throughput_runs_a_small_gpt_on_the_cpu():
    """The measurement timed on a GPU runs here too: 2 blocks of 2 steps of each loop, a positive tokens/s."""
    measured = gpu_check.interleaved_throughput(2, 32, 2, False, block=2, size="tiny", device="cpu")
    assert set(measured) == {"package loop", "plain loop"}
    for row in measured.values():
        assert row["tokens_per_second"] > 0 and row["peak_memory_bytes"] is None
