"""``make gpu-check``: what the package does on this machine's CUDA GPUs, measured; without one, nothing claimed.

    PYTHONPATH=code python bench/gpu_check.py [--micro-batch 16] [--steps 20] [--skip-strategies] [--skip-throughput]

1. **Strategies on NCCL.** Each layout of ``python -m scalebook.train`` (the user's own command, under torchrun
   when it has several ranks) runs at the GPU count available: the data-parallel wrappers on the largest power
   of two of GPUs up to 8, tensor, pipeline, context and expert parallelism on 2 GPUs, 3D on 4; a layout that
   needs more GPUs than there are is listed as not run. Each is compared with one process of the same model,
   data and seed: equal losses within ``LOSS_RTOL``.
2. **Throughput.** GPT-2 124M (``GPTConfig.named("gpt2")``, SDPA attention, bf16 autocast, AdamW, sequences of
   1,024 tokens) on one GPU, through the package's own loop (:func:`scalebook.train.loop.train`) and through a
   plain PyTorch loop of the same model and settings (fused AdamW, the batches made on the GPU, no per-step
   host syncs but the last), each with ``torch.compile`` off and on: tokens/s, and MFU against the device's
   dense bf16 peak in :mod:`scalebook.configs` (6 N + attention FLOPs per token, matched by
   ``torch.cuda.get_device_name``; None for a device not listed there).
3. **Memory.** The peak ``torch.cuda.max_memory_allocated`` of those runs against :mod:`scalebook.accounting`:
   model states (fp32 parameters and gradients, AdamW's two moments: 16 bytes per parameter) plus the
   activations saved for backward (16-bit, fused attention, no dropout). The accounting leaves out the logits,
   the loss and autocast's bf16 copies of the weights, so the measured peak is expected above it.

Results go to ``bench/gpu/<date>-<gpu>.json`` and a markdown table beside it. Runs with an older PyTorch than
the pinned one (2.11 on the lent GPU machines): install the package there with ``pip install --no-deps -e .``
or put ``code/`` on PYTHONPATH, as ``make gpu-check`` does.

Source: PyTorch documentation, ``torch.cuda.max_memory_allocated``, ``torch.compile``; Karpathy, nanoGPT
``train.py`` (the plain loop: fused AdamW, bf16 autocast, ``torch.compile``); Chowdhery et al. 2022, "PaLM",
App. B (MFU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "gpu"
NO_CUDA = "no CUDA device: nothing run, nothing claimed"
# Relative difference allowed between a layout's losses and one process's, step by step. On CPUs the layouts
# agree to ~1e-6 (tests/test_cli_strategies.py); on GPUs cuBLAS may pick other kernels for sliced matrices and
# NCCL sums in another order, which moves fp32 losses by ~1e-6 per step, compounding over the steps.
LOSS_RTOL = 1e-4
COMMON = ["--steps", "6", "--micro-batch", "1", "--global-batch", "8", "--seq-len", "32", "--log-every", "1",
          "--no-progress"]  # fmt: skip
MOE = ["--moe-experts", "4"]
# name -> (the layout's arguments, its ranks: None for a data-parallel wrapper, run on as many GPUs as there are,
# up to 8 and a power of two so that the global batch splits; the reference's extra arguments)
STRATEGIES = {
    "single": ([], 1, []),
    **{name: (["--strategy", name], None, []) for name in ("torch-ddp", "fsdp", "ddp", "zero1", "zero2", "zero3")},
    "tp": (["--strategy", "tp", "--tp", "2"], 2, []),
    "tp + sp": (["--strategy", "tp", "--tp", "2", "--sequence-parallel"], 2, []),
    "pp": (["--strategy", "pp", "--pp", "2"], 2, []),
    "cp": (["--strategy", "ddp", "--cp", "2"], 2, []),
    "ep": (["--strategy", "ddp", "--ep", "2", *MOE], 2, MOE),
    "3d": (["--strategy", "3d", "--dp", "1", "--tp", "2", "--pp", "2"], 4, []),
}
# torch.cuda.get_device_name -> scalebook.configs hardware; PCIe and NVL parts have other peaks, so no match.
DEVICE_NAMES = (
    (r"H100(?!.*(PCIe|NVL))", "h100-sxm"),
    (r"H200(?!.*NVL)", "h200"),
    (r"A100.*80GB", "a100-sxm4-80gb"),
    (r"A100", "a100-sxm4-40gb"),
    (r"V100", "v100-sxm2-32gb"),
    (r"B200", "b200"),
    (r"MI300X", "mi300x"),
)


# ----- pure helpers (tested on CPU) -------------------------------------------------------------------------
def hardware_name(device_name: str) -> str | None:
    """The :mod:`scalebook.configs` hardware entry for a CUDA device name, or None if none matches."""
    return next((hw for pattern, hw in DEVICE_NAMES if re.search(pattern, device_name)), None)


def model_flops_utilization(tokens_per_second: float, device_name: str, seq_len: int) -> float | None:
    """MFU of GPT-2 124M training at ``tokens_per_second`` on one device: FLOPs per token (6 N plus attention,
    :func:`scalebook.accounting.flops.flops_per_token`) x tokens/s / dense bf16 peak; None for an unknown device."""
    from scalebook import configs
    from scalebook.accounting.time import mfu

    hardware = hardware_name(device_name)
    if hardware is None:
        return None
    peak = configs.get_hardware(hardware).peak("bf16")
    return mfu(configs.get_model("gpt2"), tokens_per_second, 1, peak, seq_len=seq_len)


def predicted_step_bytes(micro_batch: int, seq_len: int) -> dict[str, int]:
    """GPT-2 124M's model states (fp32 weights and gradients, AdamW: 16 bytes per parameter) and activations
    (16-bit under autocast, fused attention, no dropout), from :mod:`scalebook.accounting`."""
    from scalebook import configs
    from scalebook.accounting.memory import activation_bytes, model_state_bytes

    cfg = configs.get_model("gpt2")
    states = model_state_bytes(cfg, precision="fp32").total
    activations = activation_bytes(cfg, seq_len=seq_len, micro_batch=micro_batch, attention="fused", dropout=False)
    return {"states": states, "activations": activations, "total": states + activations}


def losses_agree(reference: dict[int, float], losses: dict[int, float], rtol: float = LOSS_RTOL) -> bool:
    """The same steps, each loss within ``rtol`` of the reference's."""
    return reference.keys() == losses.keys() and all(
        abs(losses[s] - reference[s]) <= rtol * abs(reference[s]) for s in reference
    )


def markdown(results: dict) -> str:
    """The results as two short markdown tables (strategies, then throughput and memory)."""
    lines = [f"# GPU check, {results['date']}: {results['device']} x {results['gpus']}", "",
             f"PyTorch {results['torch']}, CUDA {results['cuda']}.", "",
             f"| strategy | ranks | losses equal one process (rtol {LOSS_RTOL:g}) | note |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for name, row in results["strategies"].items():
        verdict = {True: "yes", False: "**no**", None: "not run"}[row["agree"]]
        lines.append(f"| {name} | {row['ranks']} | {verdict} | {row['note']} |")
    lines += ["", "| GPT-2 124M, bf16, SDPA | compile | tokens/s | MFU | peak memory (GB) | accounting (GB) |",
              "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for row in results["throughput"]:
        mfu = "n/a" if row["mfu"] is None else f"{row['mfu']:.1%}"
        memory = f"{row['peak_memory_bytes'] / 1e9:.2f} | {row['predicted_bytes']['total'] / 1e9:.2f}"
        lines.append(f"| {row['loop']} | {row['compile']} | {row['tokens_per_second']:,.0f} | {mfu} | {memory} |")
    return "\n".join(lines) + "\n"


def write_results(results: dict, folder: Path = OUT) -> tuple[Path, Path]:
    """``<folder>/<date>-<device>.json`` and ``.md``; returns their paths."""
    slug = re.sub(r"[^a-z0-9]+", "-", results["device"].lower()).strip("-")
    stem = folder / f"{results['date']}-{slug}"
    folder.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf8")
    stem.with_suffix(".md").write_text(markdown(results), encoding="utf8")
    return stem.with_suffix(".json"), stem.with_suffix(".md")


# ----- measurements (CUDA only) ------------------------------------------------------------------------------
def check_strategies(gpus: int) -> dict[str, dict]:
    """Each layout of STRATEGIES at the GPUs available, against one process of the same model and data."""
    from scalebook.train.cli import run_local

    references, rows = {}, {}
    for name, (argv, ranks, reference_argv) in STRATEGIES.items():
        ranks = ranks or max(n for n in (1, 2, 4, 8) if n <= gpus)
        if ranks > gpus:
            rows[name] = {"ranks": ranks, "agree": None, "note": f"needs {ranks} GPUs, this machine has {gpus}"}
            continue
        key = tuple(reference_argv)
        if key not in references:
            references[key] = run_local([*COMMON, *reference_argv], timeout=600)
        run = run_local([*COMMON, *argv], nproc=ranks, timeout=600)
        if run.returncode != 0:
            rows[name] = {"ranks": ranks, "agree": False, "note": "failed: " + run.stderr.strip()[-300:]}
            continue
        reference = references[key].losses
        gap = max((abs(run.losses[s] - reference[s]) / abs(reference[s]) for s in reference if s in run.losses),
                  default=float("nan"))  # fmt: skip
        rows[name] = {"ranks": ranks, "agree": losses_agree(reference, run.losses), "note": f"max rel. diff {gap:.1e}",
                      "losses": run.losses, "reference": reference}  # fmt: skip
    return rows


def _gpt2(compile_model: bool, size: str, device: str):
    import torch

    from scalebook.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.named(size, attn_impl="sdpa")).to(device)
    return model, (torch.compile(model) if compile_model else model)


def _synchronize(device: str) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def package_loop(micro_batch: int, seq_len: int, steps: int, compile_model: bool, *, size: str = "gpt2",
                 device: str = "cuda") -> float:  # fmt: skip
    """Tokens/s of the package's own loop (:func:`scalebook.train.loop.train`), the first half of the steps
    left out (allocation, compilation). ``size`` and ``device`` let the tests run it small on the CPU."""
    import torch

    from scalebook.train.loop import TrainConfig, train

    raw, model = _gpt2(compile_model, size, device)
    tokens = torch.randint(0, raw.config.vocab_size, (1_000_000,))
    cfg = TrainConfig(steps=steps, batch_size=micro_batch, seq_len=seq_len, precision="bf16", progress=False,
                      warmup_steps=1)  # fmt: skip
    times = train(model, tokens, cfg).step_times[steps // 2 :]
    return micro_batch * seq_len * len(times) / sum(times)


def plain_loop(micro_batch: int, seq_len: int, steps: int, compile_model: bool, *, size: str = "gpt2",
               device: str = "cuda") -> float:  # fmt: skip
    """Tokens/s of a plain PyTorch loop of the same model and settings, as nanoGPT writes it."""
    import torch

    from scalebook.train.loop import weight_decay_groups

    raw, model = _gpt2(compile_model, size, device)
    optimizer = torch.optim.AdamW(weight_decay_groups(raw, 0.1), lr=3e-4, betas=(0.9, 0.95), fused=True)
    x = torch.randint(0, raw.config.vocab_size, (micro_batch, seq_len), device=device)
    for step in range(steps):
        if step == steps // 2:  # the second half is timed
            _synchronize(device)
            start = time.perf_counter()
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            _, loss = model(x, x.roll(-1, dims=1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _synchronize(device)
    return micro_batch * seq_len * (steps - steps // 2) / (time.perf_counter() - start)


def measure_throughput(micro_batch: int, seq_len: int, steps: int) -> list[dict]:
    import torch

    rows, device = [], torch.cuda.get_device_name()
    for loop in (package_loop, plain_loop):
        for compile_model in (False, True):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            tokens_per_second = loop(micro_batch, seq_len, steps, compile_model)
            rows.append({"loop": loop.__name__.replace("_", " "), "compile": compile_model,
                         "tokens_per_second": tokens_per_second,
                         "mfu": model_flops_utilization(tokens_per_second, device, seq_len),
                         "peak_memory_bytes": torch.cuda.max_memory_allocated(),
                         "predicted_bytes": predicted_step_bytes(micro_batch, seq_len)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch", type=int, default=16, help="GPT-2 sequences per step (default: 16)")
    parser.add_argument("--steps", type=int, default=20, help="steps per throughput run, half timed (default: 20)")
    parser.add_argument("--skip-strategies", action="store_true", help="only the throughput and memory")
    parser.add_argument("--skip-throughput", action="store_true", help="only the strategies")
    parser.add_argument("--out", type=Path, default=OUT, help="results folder (default: bench/gpu)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "code"), os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gpus, seq_len = torch.cuda.device_count(), 1024
    results = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"), "gpus": gpus,
               "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
               "micro_batch": args.micro_batch, "seq_len": seq_len, "strategies": {}, "throughput": []}  # fmt: skip
    if not args.skip_strategies:
        results["strategies"] = check_strategies(gpus)
    if not args.skip_throughput:
        results["throughput"] = measure_throughput(args.micro_batch, seq_len, args.steps)
    paths = write_results(results, args.out)
    print(markdown(results) + "\nwritten: " + ", ".join(str(p) for p in paths))
    return 0 if all(row["agree"] is not False for row in results["strategies"].values()) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "code"))
    sys.exit(main())
