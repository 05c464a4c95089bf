"""``make gpu-check``: what the package does on this machine's CUDA GPUs, measured; without one, nothing claimed.

    PYTHONPATH=code python bench/gpu_check.py [--micro-batch 16] [--steps 20] [--skip-strategies] [--skip-throughput]

1. **Strategies on NCCL.** Each layout of ``python -m scalebook.train`` (the user's own command, under torchrun
   when it has several ranks) runs at the GPU count available: the data-parallel wrappers on the largest power
   of two of GPUs up to 8, tensor, pipeline, context and expert parallelism on 2 GPUs, 3D on 4; a layout that
   needs more GPUs than there are is listed as not run. Each is compared with one process of the same model,
   data and seed, step by step: equal losses within ``LOSS_RTOL`` and equal gradient norms before clipping
   within ``GRAD_NORM_RTOL``. The norms are the check that can fail on a missing 1/d: the runs clip at 1.0 on
   every step, which normalises a gradient summed over d replicas instead of averaged before AdamW, so the
   losses alone would agree.
2. **Throughput.** GPT-2 124M (``GPTConfig.named("gpt2")``, SDPA attention, bf16 autocast, AdamW, sequences of
   1,024 tokens) on one GPU, through the package's own loop (:func:`scalebook.train.loop.training_steps` on a
   one-process :class:`~scalebook.parallel.parallelize.ParallelModel`) and through a plain PyTorch loop of the
   same model, as nanoGPT writes it, each with ``torch.compile`` off and on. The two run interleaved, in
   alternating blocks of ``BLOCK`` steps (the first block of each left out: allocation, compilation), so that
   drifts in the machine hit both alike; reported: tokens/s of each, their ratio (package / plain: above 1 the
   package is faster) and MFU against the device's dense bf16 peak in :mod:`scalebook.configs` (6 N + attention
   FLOPs per token, matched by ``torch.cuda.get_device_name``; None for a device not listed there). Like for
   like: the same AdamW (fused on CUDA, the for-loop elsewhere: ``foreach`` left to torch in the package), the same
   learning-rate schedule set per step, clipping at 1.0 and bf16 autocast, and one fixed batch already on the
   device for both. What still differs is the package's: its two host syncs per step (``loss.item()`` and the
   gradient norm's, for its non-finite check), its own global-norm clipping, and ``zero_grad`` at the step's
   start rather than its end. The package's data path (random windows drawn on the CPU) is not timed.
3. **Memory.** Each loop's peak ``torch.cuda.max_memory_allocated`` in its blocks (the peak above what was
   allocated when its block began, plus its own weights, gradients and optimizer state then) against
   :mod:`scalebook.accounting`: model states (fp32 parameters and gradients, AdamW's two moments: 16 bytes per
   parameter) plus the activations saved for backward (16-bit, fused attention, no dropout). The accounting
   leaves out the logits, the loss and autocast's bf16 copies of the weights, so the measured peak is expected
   above it.

Results go to ``bench/gpu/<date>-<gpu>.json`` and a markdown table beside it. Runs with an older PyTorch than
the pinned one (2.11 on the lent GPU machines): install the package there with ``pip install --no-deps -e .``
or put ``code/`` on PYTHONPATH, as ``make gpu-check`` does.

It uses no PyTorch API newer than 2.11.

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
# The same for the gradient norms before clipping (the CPU tests hold them to 1e-5). A missing 1/d multiplies
# them by d >= 2 from the first step; 1e-3 leaves room for reordered GPU sums and is still 500 times below that.
GRAD_NORM_RTOL = 1e-3
BLOCK = 5  # steps of one loop before the other takes its turn (the throughput measurement)
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


def _agree(reference: dict[int, float], values: dict[int, float], rtol: float) -> bool:
    return reference.keys() == values.keys() and all(
        abs(values[s] - reference[s]) <= rtol * abs(reference[s]) for s in reference
    )


def losses_agree(reference: dict[int, float], losses: dict[int, float], rtol: float = LOSS_RTOL) -> bool:
    """The same steps, each loss within ``rtol`` of the reference's."""
    return _agree(reference, losses, rtol)


def grad_norms_agree(reference: dict[int, float], norms: dict[int, float], rtol: float = GRAD_NORM_RTOL) -> bool:
    """The same steps, each gradient norm (before clipping) within ``rtol`` of the reference's."""
    return _agree(reference, norms, rtol)


def max_relative_gap(reference: dict[int, float], values: dict[int, float]) -> float:
    """The largest relative difference over the steps both have (nan if none)."""
    return max((abs(values[s] - reference[s]) / abs(reference[s]) for s in reference if s in values),
               default=float("nan"))  # fmt: skip


def compare_with_reference(reference, run) -> dict:
    """A layout's row: ``agree`` when both its losses and its gradient norms equal the reference's, step by
    step; ``reference`` and ``run`` have ``losses`` and ``grad_norms`` (step -> value), as a ``LocalRun``."""
    agree = losses_agree(reference.losses, run.losses) and grad_norms_agree(reference.grad_norms, run.grad_norms)
    note = (f"max rel. diff: loss {max_relative_gap(reference.losses, run.losses):.1e}, "
            f"grad norm {max_relative_gap(reference.grad_norms, run.grad_norms):.1e}")  # fmt: skip
    return {"agree": agree, "note": note, "losses": run.losses, "reference": reference.losses,
            "grad_norms": run.grad_norms, "reference_grad_norms": reference.grad_norms}  # fmt: skip


def markdown(results: dict) -> str:
    """The results as short markdown tables (strategies, then throughput and memory, then the loops' ratio)."""
    lines = [f"# GPU check, {results['date']}: {results['device']} x {results['gpus']}", "",
             f"PyTorch {results['torch']}, CUDA {results['cuda']}.", "",
             f"| strategy | ranks | losses (rtol {LOSS_RTOL:g}) and grad norms (rtol {GRAD_NORM_RTOL:g}) equal "
             "one process | note |",
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
    if results.get("ratios"):
        lines += ["", f"| compile | package loop / plain loop, tokens/s (interleaved blocks of {BLOCK} steps) |",
                  "| --- | --- |"]  # fmt: skip
        lines += [f"| {row['compile']} | {row['ratio']:.3f} |" for row in results["ratios"]]
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
        rows[name] = {"ranks": ranks, **compare_with_reference(references[key], run)}
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


def _optimizer(raw, device: str):
    """The one AdamW of both loops: fused on CUDA (nanoGPT's), the for-loop elsewhere (torch's pick on a CPU)."""
    import torch

    from scalebook.train.loop import weight_decay_groups

    flags = {"fused": True} if torch.device(device).type == "cuda" else {"foreach": False}
    return torch.optim.AdamW(weight_decay_groups(raw, 0.1), lr=3e-4, betas=(0.9, 0.95), **flags)


def _train_config(micro_batch: int, seq_len: int):
    from scalebook.train.loop import TrainConfig

    return TrainConfig(steps=10**9, batch_size=micro_batch, seq_len=seq_len, lr=3e-4, min_lr=3e-5, warmup_steps=1,
                       precision="bf16", progress=False)  # fmt: skip


def _batch(vocab_size: int, micro_batch: int, seq_len: int, device: str):
    """The one fixed batch both loops train on, already on the device: (x, x shifted by one)."""
    import torch

    x = torch.randint(0, vocab_size, (micro_batch, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    return x, x.roll(-1, dims=1)


def package_steps(micro_batch: int, seq_len: int, compile_model: bool, *, size: str = "gpt2", device: str = "cuda"):
    """``(raw model, optimizer, steps)``: ``steps`` is the package's own loop
    (:func:`scalebook.train.loop.training_steps` on a one-process ``ParallelModel``); each ``next`` takes one
    optimizer step and gives its loss. ``size`` and ``device`` let the tests run it small on the CPU."""
    from scalebook.parallel.parallelize import ParallelModel
    from scalebook.train.loop import training_steps

    raw, model = _gpt2(compile_model, size, device)
    optimizer = _optimizer(raw, device)
    batch = _batch(raw.config.vocab_size, micro_batch, seq_len, device)
    model.train()
    records = training_steps(ParallelModel(model, optimizer), lambda: batch, _train_config(micro_batch, seq_len))
    return raw, optimizer, (record.loss for record in records)


def plain_steps(micro_batch: int, seq_len: int, compile_model: bool, *, size: str = "gpt2", device: str = "cuda"):
    """``(raw model, optimizer, steps)`` of a plain PyTorch loop of the same model and settings, as nanoGPT writes
    it: no host sync; each ``next`` takes one step and gives its loss as a tensor on the device."""
    import torch

    from scalebook.train.loop import lr_at

    raw, model = _gpt2(compile_model, size, device)
    optimizer = _optimizer(raw, device)
    x, y = _batch(raw.config.vocab_size, micro_batch, seq_len, device)
    cfg = _train_config(micro_batch, seq_len)
    model.train()

    def steps():
        for step in range(cfg.steps):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            yield loss.detach()

    return raw, optimizer, steps()


def _state_bytes(raw, optimizer) -> int:
    """Bytes of the loop's own weights, gradients and optimizer state held now."""
    tensors = [*raw.parameters(), *(p.grad for p in raw.parameters() if p.grad is not None),
               *(t for state in optimizer.state.values() for t in state.values() if hasattr(t, "nbytes"))]  # fmt: skip
    return sum(t.nbytes for t in tensors)


def interleaved_throughput(micro_batch: int, seq_len: int, blocks: int, compile_model: bool, *, block: int = BLOCK,
                           size: str = "gpt2", device: str = "cuda") -> dict[str, dict]:  # fmt: skip
    """The package loop and the plain loop in alternating blocks of ``block`` steps, ``blocks`` each, the first of
    each left out: ``{"package loop" | "plain loop": {"tokens_per_second", "peak_memory_bytes"}}`` (the peak is
    None off CUDA)."""
    import torch

    cuda = torch.device(device).type == "cuda"
    loops = {"package loop": package_steps(micro_batch, seq_len, compile_model, size=size, device=device),
             "plain loop": plain_steps(micro_batch, seq_len, compile_model, size=size, device=device)}  # fmt: skip
    seconds, peaks = {name: 0.0 for name in loops}, {name: 0 for name in loops}
    names = list(loops)
    for i in range(blocks):
        for name in names[i % 2 :] + names[: i % 2]:  # alternate which loop goes first
            raw, optimizer, steps = loops[name]
            _synchronize(device)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                allocated, own = torch.cuda.memory_allocated(), _state_bytes(raw, optimizer)
            start = time.perf_counter()
            for _ in range(block):
                next(steps)
            _synchronize(device)
            if i > 0:
                seconds[name] += time.perf_counter() - start
            if cuda:
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated() - allocated + own)
    tokens = micro_batch * seq_len * block * max(1, blocks - 1)
    return {name: {"tokens_per_second": tokens / seconds[name] if seconds[name] else float("nan"),
                   "peak_memory_bytes": peaks[name] if cuda else None} for name in loops}  # fmt: skip


def measure_throughput(micro_batch: int, seq_len: int, steps: int) -> tuple[list[dict], list[dict]]:
    """The rows of both loops, compile off and on, and the package / plain ratio of each pair."""
    import torch

    rows, ratios, device = [], [], torch.cuda.get_device_name()
    blocks = max(2, round(steps / BLOCK))
    for compile_model in (False, True):
        torch.cuda.empty_cache()
        measured = interleaved_throughput(micro_batch, seq_len, blocks, compile_model)
        for loop, m in measured.items():
            rows.append({"loop": loop, "compile": compile_model, "tokens_per_second": m["tokens_per_second"],
                         "mfu": model_flops_utilization(m["tokens_per_second"], device, seq_len),
                         "peak_memory_bytes": m["peak_memory_bytes"],
                         "predicted_bytes": predicted_step_bytes(micro_batch, seq_len)})  # fmt: skip
        ratio = measured["package loop"]["tokens_per_second"] / measured["plain loop"]["tokens_per_second"]
        ratios.append({"compile": compile_model, "ratio": ratio, "blocks": blocks, "block": BLOCK})
    return rows, ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch", type=int, default=16, help="GPT-2 sequences per step (default: 16)")
    parser.add_argument("--steps", type=int, default=30, help=f"steps of each loop per throughput run, in blocks of "
                        f"{BLOCK}, the first block untimed (default: 30)")  # fmt: skip
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
               "micro_batch": args.micro_batch, "seq_len": seq_len, "strategies": {}, "throughput": [],
               "ratios": []}  # fmt: skip
    if not args.skip_strategies:
        results["strategies"] = check_strategies(gpus)
    if not args.skip_throughput:
        results["throughput"], results["ratios"] = measure_throughput(args.micro_batch, seq_len, args.steps)
    paths = write_results(results, args.out)
    print(markdown(results) + "\nwritten: " + ", ".join(str(p) for p in paths))
    return 0 if all(row["agree"] is not False for row in results["strategies"].values()) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "code"))
    sys.exit(main())
