"""Data that scales, measured: prepare throughput and peak memory, and each rank's memory while training on shards.

    python bench/prepare.py [--gigabytes 1.0] [--workers 2] [--workdir /tmp/scalebook-bench-prepare]

1. Generates a text of ``--gigabytes`` GB in the work folder: paragraphs of the embedded corpus in a seeded
   random order (deleted at the end, with everything else written there).
2. ``python -m scalebook.data prepare`` on it, in a fresh process each: byte-level, and a Hugging Face tokenizer
   (a byte-level BPE of 8,192 tokens trained here on the embedded corpus, saved with ``save_pretrained``) on the
   first ``--hf-megabytes``, and the book's pure-Python BPE (Chapter 2's, the same 8,192 tokens) on the first
   ``--bpe-megabytes``: on 2 loaded cores the tokenizers run at a fraction of a MB/s, hours for a gigabyte.
   Throughput = input MB / wall seconds; peak RSS from ``resource.getrusage`` (the prepare process itself, and
   the largest of its worker processes).
3. Trains ``--steps`` steps of the tiny GPT on 2 ranks (``scalebook.comm.launch``, gloo) on byte-level shards of
   10 MB and of the whole text, and, for contrast, on the 10 MB and 100 MB text files themselves (``--data FILE``
   reads the whole corpus into every rank as int64); each rank's peak RSS is its ``VmHWM``.

Writes bench/prepare.json (machine, load averages before and after, results). Not part of ``bench/run.py``'s
ratio table: nothing here has a reference to divide by. Timings on a machine shared with other jobs move with
its load; the load averages are recorded beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MB = 1_000_000
_RUSAGE = (
    "import json, resource, sys; from scalebook.data.__main__ import main; code = main(sys.argv[1:]); "
    "print(json.dumps({'self': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
    "'children': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss})); sys.exit(code)"
)


def generate_text(path: Path, size: int, seed: int = 0) -> int:
    """Write about ``size`` bytes of English to ``path``: the embedded corpus's paragraphs in a seeded random
    order (each paragraph is real text; their order is new). Returns the bytes written."""
    from scalebook.data import default_corpus

    paragraphs = [p.encode("utf-8") + b"\n\n" for p in default_corpus().split("\n\n") if p.strip()]
    rng, written = random.Random(seed), 0
    with open(path, "wb") as f:
        while written < size:
            block = b"".join(rng.choices(paragraphs, k=2_000))
            f.write(block)
            written += len(block)
    return written


def head(source: Path, path: Path, size: int) -> Path:
    """The first ``size`` bytes of ``source`` (cut after a newline) as a file of its own."""
    with open(source, "rb") as f:
        data = f.read(size)
    path.write_bytes(data[: data.rfind(b"\n") + 1])
    return path


def train_tokenizers(folder: Path, vocab_size: int) -> tuple[Path, Path]:
    """The Hugging Face tokenizer folder and the book's BPE file, both trained on the embedded corpus."""
    from transformers import PreTrainedTokenizerFast

    from scalebook.data import default_corpus
    from scalebook.tokenizer import BPETokenizer, hf_reference

    text = default_corpus()
    hf_dir, bpe_file = folder / "hf-tokenizer", folder / "bpe.json"
    PreTrainedTokenizerFast(tokenizer_object=hf_reference(text, vocab_size), eos_token="<|endoftext|>").save_pretrained(
        hf_dir
    )
    BPETokenizer.train(text, vocab_size).save(bpe_file)
    return hf_dir, bpe_file


def measure_prepare(source: Path, tokenizer: str, out: Path, workers: int) -> dict:
    """One prepare in a fresh process: wall time, MB/s, peak RSS of the process and of its largest worker."""
    argv = ["prepare", str(source), "--tokenizer", tokenizer, "--out", str(out), "--workers", str(workers),
            "--no-progress"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _RUSAGE, *argv], capture_output=True, text=True, env=env, check=True)
    seconds = time.perf_counter() - start
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    index = json.loads((out / "index.json").read_text())
    size = source.stat().st_size
    return {"tokenizer": index["tokenizer"]["name"], "input_mb": size / MB, "workers": workers, "seconds": seconds,
            "mb_per_s": size / MB / seconds, "tokens": sum(s["tokens"] for s in index["splits"].values()),
            "dtype": index["dtype"], "peak_rss_mb": rss["self"] / 1000, "worker_peak_rss_mb": rss["children"] / 1000,
            "load_average": os.getloadavg()[0]}  # fmt: skip


def train_rank(argv: list[str]) -> dict:
    """Worker (one rank): train as ``argv`` says, then this rank's peak RSS (``VmHWM``) in MB."""
    from scalebook.train import cli

    cli.run(cli.build_parser().parse_args(argv))
    status = Path("/proc/self/status").read_text()
    kilobytes = int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1])
    return {"peak_rss_mb": kilobytes * 1024 / MB}


def measure_training(data: Path, steps: int) -> dict:
    """Each of 2 ranks' peak RSS while training the tiny GPT ``steps`` steps on ``data``."""
    from scalebook.comm import LaunchError, launch

    argv = ["--strategy", "ddp", "--data", str(data), "--steps", str(steps), "--no-progress", "--log-every", "1000"]
    start = time.perf_counter()
    try:
        ranks = launch(train_rank, 2, argv, timeout=240)
    except LaunchError:  # on a shared machine another job can take the rendezvous port first: once more
        start = time.perf_counter()
        ranks = launch(train_rank, 2, argv, timeout=240)
    corpus = sum(f.stat().st_size for f in data.glob("train_*.bin")) if data.is_dir() else data.stat().st_size
    return {"data": "shards" if data.is_dir() else "text file", "corpus_mb": corpus / MB,
            "rank_peak_rss_mb": [r["peak_rss_mb"] for r in ranks], "seconds": time.perf_counter() - start,
            "load_average": os.getloadavg()[0]}  # fmt: skip


def machine() -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    from run import machine as describe

    return describe()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gigabytes", type=float, default=1.0, help="size of the generated text")
    p.add_argument("--hf-megabytes", type=float, default=20.0, help="the HF tokenizer prepares this much only")
    p.add_argument("--bpe-megabytes", type=float, default=2.0, help="the book's BPE prepares this much only")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/scalebook-bench-prepare"))
    p.add_argument("--output", type=Path, default=ROOT / "bench" / "prepare.json")
    p.add_argument("--note", default="", help="what else ran on the machine meanwhile (written beside the numbers)")
    args = p.parse_args(argv)
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    results = {"machine": machine(), "note": args.note, "load_average_before": os.getloadavg(), "prepare": [],
               "training": []}  # fmt: skip
    try:
        text = work / "corpus.txt"
        results["text_mb"] = generate_text(text, int(args.gigabytes * 1e9)) / MB
        small, medium = head(text, work / "10mb.txt", 10 * MB), head(text, work / "100mb.txt", 100 * MB)
        hf_dir, bpe_file = train_tokenizers(work, args.vocab_size)
        runs = [(text, "bytes", "bytes"), (small, "bytes", "bytes-10mb"),  # the 10 MB: shards to train on below
                (head(text, work / "hf.txt", int(args.hf_megabytes * MB)), str(hf_dir), "hf"),
                (head(text, work / "bpe.txt", int(args.bpe_megabytes * MB)), str(bpe_file), "bpe")]  # fmt: skip
        for source, tokenizer, name in runs:
            results["prepare"].append(measure_prepare(source, tokenizer, work / name, args.workers))
            print(json.dumps(results["prepare"][-1]), flush=True)
        for data in (work / "bytes-10mb", work / "bytes", small, medium):
            results["training"].append(measure_training(data, args.steps))
            print(json.dumps(results["training"][-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["load_average_after"] = os.getloadavg()
    results["self_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1000
    args.output.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
