"""The book's benchmarks: each entry is a ratio measured side by side in one run on this machine.

    python bench/run.py [--only NAME ...] [--repeats N]

Writes bench/results.json (machine description + entries) and prints a table. Not part of `make test`:
timings belong here, not in assertions. An entry is a function that returns a dict (or a list of dicts) with
``name``, ``ours``, ``reference``, ``unit``, ``ratio`` (ours / reference) and ``note``. The book's own
benchmarks are listed in BENCHMARKS below; a strategy's benchmarks live in ``bench/<strategy>.py``, which lists
its functions in ``ENTRIES`` and is collected here by file: ``--only zero`` runs bench/zero.py's entries,
``--only zero.NAME`` one of them. A function that takes an argument receives ``--repeats``.

The table flags every entry where the book's version does worse than its reference by more than GOAL_RATIO
(time, bytes: ours / reference; throughput, units ending in "/s": reference / ours), with its note.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
GOAL_RATIO = 1.2
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")


def machine() -> dict:
    import torch

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _train_step_seconds(model, loss_fn, steps: int) -> list[float]:
    """Wall time of ``steps`` full training steps (forward, backward, AdamW) of ``loss_fn(model)``."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    times = []
    for _ in range(steps + 1):  # the first step allocates optimizer state: discarded
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times[1:]


def bench_training_throughput(repeats: int) -> dict:
    """Tokens/s of our GPT vs Hugging Face's GPT2LMHeadModel with identical weights and batch."""
    import torch
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    from scalebook.model import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig.named("tiny")
    hf = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.block_size,
            n_embd=cfg.n_embd,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            bos_token_id=255,
            eos_token_id=255,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )
    ours = {impl: GPT.from_hf(hf, attn_impl=impl) for impl in ("explicit", "sdpa")}
    batch_size, seq = 16, cfg.block_size
    idx = torch.randint(0, cfg.vocab_size, (batch_size, seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = idx[:, :-1], idx[:, 1:]
    hf.train()
    # The same batch and the same loss for all three.
    steps = {
        "explicit": lambda m: m(x, y)[1],
        "sdpa": lambda m: m(x, y)[1],
        "hf": lambda m: F.cross_entropy(m(x).logits.reshape(-1, cfg.vocab_size), y.reshape(-1)),
    }
    models = {**ours, "hf": hf}
    samples = {k: [] for k in steps}
    for _ in range(repeats):  # interleave so drifts in machine load hit all three alike
        for key, loss_fn in steps.items():
            samples[key] += _train_step_seconds(models[key], loss_fn, 5)
    tokens = batch_size * seq
    tps = {k: tokens / statistics.median(v) for k, v in samples.items()}
    return [
        {
            "name": f"train step tokens/s, ours ({impl}) vs HF GPT-2, tiny size",
            "ours": round(tps[impl]),
            "reference": round(tps["hf"]),
            "unit": "tokens/s",
            "ratio": tps[impl] / tps["hf"],
            "note": "forward + backward + AdamW on one 16x128 batch, median step; ratio > 1 means ours is faster",
        }
        for impl in ("explicit", "sdpa")
    ]


def bench_tokenizer_encode(repeats: int) -> list[dict]:
    """MB/s encoding the embedded corpus: our byte-level BPE vs HF tokenizers with the same merges."""
    from tokenizers import Tokenizer

    from scalebook import data
    from scalebook.tokenizer import BPETokenizer, hf_merges, hf_reference

    text = data.default_corpus()
    ours = BPETokenizer.train(text, 4096)
    hf = hf_reference(text, 4096)
    if ours.merge_strings() != hf_merges(hf):
        raise RuntimeError("our merges differ from HF's: run tests/test_tokenizer.py")
    hf_json = hf.to_str()
    mb = len(text.encode("utf-8")) / 1e6
    entries = []
    for label, texts in [("whole corpus", [text]), ("line by line", text.splitlines(keepends=True))]:
        seconds = {"ours": [], "hf": []}
        for _ in range(repeats):  # interleaved; fresh tokenizers, so every run starts with an empty cache
            ours_fresh, hf_fresh = BPETokenizer(ours.merges), Tokenizer.from_str(hf_json)
            encoders = {"ours": ours_fresh.encode, "hf": lambda t, tok=hf_fresh: tok.encode(t).ids}
            for key, encode in encoders.items():
                start = time.perf_counter()
                for t in texts:
                    encode(t)
                seconds[key].append(time.perf_counter() - start)
        speed = {key: mb / statistics.median(values) for key, values in seconds.items()}
        entries.append(
            {
                "name": f"BPE encode ({label}), ours vs HF tokenizers, V = 4096",
                "ours": round(speed["ours"], 2),
                "reference": round(speed["hf"], 2),
                "unit": "MB/s",
                "ratio": speed["ours"] / speed["hf"],
                "note": "cold cache, identical merges and ids; ratio > 1 means ours is faster",
            }
        )
    return entries


def bench_notebooks(repeats: int) -> list[dict]:
    """Seconds to execute each chapter top to bottom vs the 120 s budget."""
    from scalebook.notebook import execute_notebook

    entries = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        seconds = min(execute_notebook(path, write=False) for _ in range(max(1, repeats // 3)))
        entries.append(
            {
                "name": f"notebook {path.name}",
                "ours": round(seconds, 1),
                "reference": 120,
                "unit": "s",
                "ratio": seconds / 120,
                "note": "execution time / budget (must stay below 1)",
            }
        )
    return entries


BENCHMARKS = {
    "training": bench_training_throughput,
    "tokenizer": bench_tokenizer_encode,
    "notebooks": bench_notebooks,
}


def collected_entries() -> dict:
    """``{"module.function": fn}`` for every function in the ``ENTRIES`` list of a ``bench/*.py`` module.

    The modules are imported by name with bench/ on ``sys.path``, so that ranks started with ``spawn`` can
    unpickle worker functions defined in them.
    """
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    entries = {}
    for path in sorted(BENCH.glob("*.py")):
        if path.stem == "run":
            continue
        module = importlib.import_module(path.stem)
        entries |= {f"{path.stem}.{fn.__name__}": fn for fn in getattr(module, "ENTRIES", [])}
    return entries


def slowdown(entry: dict) -> float:
    """How many times worse ours is than the reference (> 1: worse), whichever way the unit points."""
    return 1 / entry["ratio"] if entry["unit"].endswith("/s") else entry["ratio"]


def print_table(results: dict) -> None:
    """The ratio table; an entry more than GOAL_RATIO times worse than its reference is flagged with its note."""
    m = results["machine"]
    print(f"\n{m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads)")
    width = max(len(e["name"]) for e in results["entries"])
    print(f"{'benchmark':<{width}}  {'ours':>10}  {'reference':>10}  {'unit':<8}  ratio")
    flagged = [e for e in results["entries"] if slowdown(e) > GOAL_RATIO]
    for e in results["entries"]:
        mark = f"  > {GOAL_RATIO}x worse" if e in flagged else ""
        print(f"{e['name']:<{width}}  {e['ours']:>10}  {e['reference']:>10}  {e['unit']:<8}  {e['ratio']:.2f}{mark}")
    for e in flagged:
        print(f"\n{e['name']}: {slowdown(e):.2f}x worse than the reference (goal <= {GOAL_RATIO}x)\n  {e['note']}")


def main(argv=None) -> int:
    runners = dict(BENCHMARKS)
    for name, fn in collected_entries().items():
        runners[name] = fn if inspect.signature(fn).parameters else (lambda repeats, fn=fn: fn())
    modules = sorted({name.split(".")[0] for name in runners if "." in name})
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted([*runners, *modules]), help="run only these benchmarks")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions per measurement")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results.json")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    selected = [name for name in runners if not args.only or name in args.only or name.split(".")[0] in args.only]

    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    results = {"machine": machine(), "entries": []}
    for name in selected:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        out = runners[name](args.repeats)
        results["entries"] += out if isinstance(out, list) else [out]

    tmp = args.output.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(args.output)
    print_table(results)
    print(f"\nwritten to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
