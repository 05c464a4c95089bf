"""The book's benchmarks: each entry is a ratio measured side by side in one run on this machine.

    python bench/run.py [--only NAME ...] [--repeats N] [--output FILE]
    python bench/run.py --readme

Writes ``bench/results/<date>-<machine>.json`` (the machine: CPU model, its vector ISA as PyTorch reports it
and the core count; the file holds the machine's description, the load average before and after, the
versions, and the entries), prints a table, and renders the newest file in bench/results/ into README.md
between the ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` markers (``--readme`` does only that;
``tests/test_bench_results.py`` fails when README.md and the newest file disagree). With ``--only`` the
entries run are merged into the day's file for this machine, replacing those of the same benchmark, so
entries can be measured one at a time. ``--output`` writes elsewhere and leaves README.md alone. Not part
of `make test`: timings belong here, not in assertions.

An entry is a function that returns a dict (or a list of dicts) with ``name``, ``ours``, ``reference``,
``unit``, ``ratio`` (ours / reference) and ``note``; a budget entry (the chapters' execution times) has
``seconds`` and ``budget_s`` instead. The book's own benchmarks are listed in BENCHMARKS below; a strategy's
benchmarks live in ``bench/<strategy>.py``, which lists its functions in ``ENTRIES`` and is collected here by
file: ``--only zero`` runs bench/zero.py's entries, ``--only zero.NAME`` one of them. A function that takes
an argument receives ``--repeats``.

The table flags every entry where the book's version does worse than its reference by more than GOAL_RATIO
(time, bytes: ours / reference; throughput, units ending in "/s": reference / ours), with its note.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import inspect
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
README = ROOT / "README.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
GOAL_RATIO = 1.2
NOTEBOOK_BUDGET_S = 120
# The fields every results file's "machine" holds (tests/test_bench_results.py checks the newest file).
MACHINE_FIELDS = ("cpu", "cpu_capability", "cores", "torch_threads", "load_before", "load_after", "python", "torch",
                  "transformers", "date", "slug")  # fmt: skip
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_slug(cpu: str, capability: str, cores: int) -> str:
    """``"Intel(R) Xeon(R) Processor", "AVX512", 2`` -> ``"intel-xeon-avx512-2c"``: the results file's name."""
    model = re.sub(r"\((R|TM)\)|\bCPU\b|\bProcessor\b|@.*$|\d+-Core", " ", cpu, flags=re.IGNORECASE)
    words = re.sub(r"[^a-z0-9]+", "-", f"{model} {capability}".lower()).strip("-")
    return f"{words}-{cores}c"


def machine() -> dict:
    """This machine and software: CPU model, PyTorch's CPU capability (the vector ISA its kernels use), cores,
    threads, versions, the date, and the 1-, 5- and 15-minute load average now (``load_before``)."""
    import torch

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    return {
        "cpu": cpu,
        "cpu_capability": capability,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "load_after": None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d"),
        "time": time.strftime("%H:%M:%S"),
        "slug": machine_slug(cpu, capability, os.cpu_count() or 0),
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
    """Seconds to execute each chapter top to bottom (kernel start included), beside the 120 s budget."""
    from scalebook.notebook import execute_notebook

    entries = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        seconds = min(execute_notebook(path, write=False) for _ in range(max(1, repeats // 3)))
        entries.append(
            {
                "name": f"notebook {path.name}",
                "seconds": round(seconds, 1),
                "budget_s": NOTEBOOK_BUDGET_S,
                "unit": "s",
                "note": f"execution time, best of {max(1, repeats // 3)}; must stay below the budget",
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


def is_budget(entry: dict) -> bool:
    """A time against a budget (``seconds``, ``budget_s``), not a ratio against a reference."""
    return "budget_s" in entry


def slowdown(entry: dict) -> float:
    """How many times worse ours is than the reference (> 1: worse), whichever way the unit points."""
    return 1 / entry["ratio"] if entry["unit"].endswith("/s") else entry["ratio"]


def verdict(entry: dict) -> str:
    """``"1.35x worse"``, ``"2.00x better"`` or ``"equal"``: the ratio read the right way for its unit."""
    worse = slowdown(entry)
    if round(worse, 2) == 1:
        return "equal"
    return f"{worse:.2f}x worse" if worse > 1 else f"{1 / worse:.2f}x better"


def print_table(results: dict) -> None:
    """The ratio table; an entry more than GOAL_RATIO times worse than its reference is flagged with its note;
    then the budget entries."""
    m = results["machine"]
    print(f"\n{m['cpu']} ({m['cpu_capability']}), {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} "
          f"threads), load average {m['load_before']} before, {m['load_after']} after")  # fmt: skip
    ratios = [e for e in results["entries"] if not is_budget(e)]
    budgets = [e for e in results["entries"] if is_budget(e)]
    flagged = [e for e in ratios if slowdown(e) > GOAL_RATIO]
    if ratios:
        width = max(len(e["name"]) for e in ratios)
        print(f"{'benchmark':<{width}}  {'ours':>10}  {'reference':>10}  {'unit':<8}  ratio")
        for e in ratios:
            mark = f"  > {GOAL_RATIO}x worse" if e in flagged else ""
            print(f"{e['name']:<{width}}  {e['ours']:>10}  {e['reference']:>10}  {e['unit']:<8}  "
                  f"{e['ratio']:.2f}{mark}")
    if budgets:
        width = max(len(e["name"]) for e in budgets)
        print(f"\n{'chapter':<{width}}  {'seconds':>8}  {'budget':>8}")
        for e in budgets:
            mark = "  over budget" if e["seconds"] > e["budget_s"] else ""
            print(f"{e['name']:<{width}}  {e['seconds']:>8}  {e['budget_s']:>8}{mark}")
    for e in flagged:
        print(f"\n{e['name']}: {slowdown(e):.2f}x worse than the reference (goal <= {GOAL_RATIO}x)\n  {e['note']}")


# ----- the README's block -------------------------------------------------------------------------------------
def newest_results(folder: Path = RESULTS) -> Path:
    """The newest results file: the latest date in its name (``<date>-<machine>.json``), then the name."""
    files = sorted(folder.glob("*.json"), key=lambda p: (p.name[:10], p.name))
    if not files:
        raise FileNotFoundError(f"no results file in {folder}: run `make bench`")
    return files[-1]


def _cell(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1000:
        value = int(value)  # a byte count that went through a float
    text = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)
    return text.replace("|", "\\|")


def render_markdown(results: dict, name: str) -> str:
    """The README's benchmark section body: where and how it was measured, the ratio table, the budget table."""
    m = results["machine"]
    load = f"{m['load_before'][0]:g} before the run and {m['load_after'][0]:g} after it" if m["load_after"] else (
        f"{m['load_before'][0]:g} before the run")  # fmt: skip
    runs = results.get("runs", [])
    how = " and ".join(f"`{' '.join(['python bench/run.py', *run['argv']])}`" for run in runs)
    lines = [
        f"Measured {m['date']} by {how or '`make bench`'} (`bench/results/{name}` holds every entry's setup and "
        f"the load before and after it): {m['cpu']} ({m['cpu_capability']}), {m['cores']} cores, Python "
        f"{m['python']}, torch {m['torch']}, transformers {m['transformers']}; torch threads "
        f"{m['torch_threads']} in the main process, 1 per rank in the distributed entries (gloo). 1-minute load "
        f"average {load}: the machine is shared with other jobs, so ratios move from run to run; measure again "
        "before citing a small difference. Each entry times ours and the reference interleaved in the same run; "
        "ratio = ours / reference (for tokens/s and MB/s, above 1 means ours is faster; for ms and bytes, below "
        "1 means ours is faster or smaller).",
        "",
    ]
    ratios = [e for e in results["entries"] if not is_budget(e)]
    budgets = [e for e in results["entries"] if is_budget(e)]
    if ratios:
        lines += ["| benchmark | ours | reference | unit | ratio | ours is | setup |",
                  "| --- | ---: | ---: | --- | ---: | --- | --- |"]
        for e in ratios:
            mark = f" (goal <= {GOAL_RATIO}x)" if slowdown(e) > GOAL_RATIO else ""
            lines.append(f"| {_cell(e['name'])} | {_cell(e['ours'])} | {_cell(e['reference'])} | {e['unit']} | "
                         f"{e['ratio']:.2f} | {verdict(e)}{mark} | {_cell(e['note'])} |")  # fmt: skip
    if budgets:
        lines += ["", "| chapter | seconds | budget (s) |", "| --- | ---: | ---: |"]
        lines += [f"| {e['name'].removeprefix('notebook ')} | {e['seconds']} | {e['budget_s']} |" for e in budgets]
    else:
        lines += ["", "The chapters' execution times against the 120 s budget are not in this file "
                      "(`python bench/run.py --only notebooks` measures them)."]  # fmt: skip
    return "\n".join(lines)


def readme_block(path: Path | None = None) -> str:
    """What README.md must hold between BEGIN and END: the rendering of ``path`` (default: the newest file)."""
    path = path or newest_results()
    return render_markdown(json.loads(path.read_text(encoding="utf8")), path.name)


def readme_section(text: str) -> str:
    """The text between README.md's BEGIN and END markers (without the newlines next to them)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"README.md must hold one {BEGIN} ... {END} block")
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip("\n")


def update_readme(readme: Path = README, path: Path | None = None) -> None:
    text = readme.read_text(encoding="utf8")
    old = readme_section(text)
    start = text.index(BEGIN) + len(BEGIN)
    end = text.index(END)
    new = f"{text[:start]}\n{readme_block(path)}\n{text[end:]}"
    if readme_section(new) != old:
        readme.write_text(new, encoding="utf8")


# ----- running ------------------------------------------------------------------------------------------------
def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _merged(output: Path, results: dict, replaced: set[str]) -> dict:
    """``results`` added to the file at ``output`` (same date and machine): its entries of the benchmarks in
    ``replaced`` dropped, the rest kept; the machine's ``load_before`` is the first run's."""
    if not output.exists():
        return results
    old = json.loads(output.read_text(encoding="utf8"))
    kept = [e for e in old["entries"] if e.get("benchmark") not in replaced]
    machine_ = {**results["machine"], "load_before": old["machine"]["load_before"]}
    return {"machine": machine_, "runs": old.get("runs", []) + results["runs"], "entries": kept + results["entries"]}


def main(argv=None) -> int:
    runners = dict(BENCHMARKS)
    for name, fn in collected_entries().items():
        runners[name] = fn if inspect.signature(fn).parameters else (lambda repeats, fn=fn: fn())
    modules = sorted({name.split(".")[0] for name in runners if "." in name})
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted([*runners, *modules]), help="run only these benchmarks")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions per measurement")
    parser.add_argument("--output", type=Path, help="results file (default: bench/results/<date>-<machine>.json, "
                        "and README.md's block follows it)")  # fmt: skip
    parser.add_argument("--readme", action="store_true", help="run nothing: render the newest file in "
                        "bench/results/ into README.md")  # fmt: skip
    args = parser.parse_args(argv)
    if args.readme:
        update_readme()
        print(f"README.md: rendered {newest_results().relative_to(ROOT)}")
        return 0
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    selected = [name for name in runners if not args.only or name in args.only or name.split(".")[0] in args.only]

    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    results = {"machine": machine(), "runs": [], "entries": []}
    started = time.time()
    for name in selected:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        before, start = _load(), time.perf_counter()
        out = runners[name](args.repeats)
        extra = {"benchmark": name, "load_before": before, "load_after": _load(),
                 "seconds_taken": round(time.perf_counter() - start, 1)}  # fmt: skip
        results["entries"] += [{**entry, **extra} for entry in (out if isinstance(out, list) else [out])]
    results["machine"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    results["runs"].append({"argv": sys.argv[1:] if argv is None else list(argv), "repeats": args.repeats,
                            "started": time.strftime("%H:%M:%S", time.localtime(started)),
                            "seconds": round(time.time() - started, 1), "benchmarks": selected,
                            "load_before": results["machine"]["load_before"],
                            "load_after": results["machine"]["load_after"]})  # fmt: skip

    output = args.output or RESULTS / f"{results['machine']['date']}-{results['machine']['slug']}.json"
    if args.output is None and args.only:
        results = _merged(output, results, set(selected))
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(output)
    print_table(results)
    print(f"\nwritten to {output}")
    if args.output is None:
        update_readme()
        print(f"README.md: rendered {newest_results().relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
