"""``python -m scalebook.data prepare INPUT --tokenizer ... --out DIR``: see :mod:`scalebook.data.prepare`."""

from __future__ import annotations

import argparse
import os
import sys

from scalebook.data import prepare as prep


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scalebook.data", description="The book's data pipeline.")
    commands = p.add_subparsers(dest="command", required=True)
    c = commands.add_parser(
        "prepare",
        help="tokenize a corpus once into memory-mapped token shards for `python -m scalebook.train --data DIR`",
        description="Tokenize INPUT in worker processes into token shards (uint8/uint16/uint32 by vocabulary) and "
        "an index.json in the new folder --out, written atomically. Exit codes: 0 done, 2 invalid input.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    c.add_argument("input", help="a text file, a folder of .txt/.md/.rst files, or a Dataset.save_to_disk folder")
    c.add_argument(
        "--tokenizer",
        required=True,
        help="bytes (one token per byte), a BPE file written by scalebook.tokenizer.BPETokenizer.save, or "
        "a Hugging Face tokenizer folder (save_pretrained; loaded offline)",
    )
    c.add_argument("--out", required=True, help="the folder to create (must not exist)")
    c.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes")
    c.add_argument("--val-fraction", type=float, default=0.01, help="the last fraction of tokens held out as 'val'")
    c.add_argument("--text-column", default="text", help="a dataset's column of text")
    c.add_argument(
        "--dtype",
        choices=("auto", "uint8", "uint16", "uint32"),
        default="auto",
        help="token dtype on disk; auto: the smallest that holds the vocabulary",
    )
    c.add_argument("--shard-tokens", type=int, default=prep.SHARD_TOKENS, help="tokens per shard file")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        index = prep.prepare(args.input, args.tokenizer, args.out, workers=args.workers,
                             val_fraction=args.val_fraction, text_column=args.text_column, dtype=args.dtype,
                             shard_tokens=args.shard_tokens, progress=not args.no_progress)  # fmt: skip
    except ValueError as error:
        parser.exit(2, f"{parser.prog} prepare: error: {error}\n")
    splits = ", ".join(f"{name} {split['tokens']:,} tokens" for name, split in index["splits"].items())
    print(f"{args.out}: {splits} ({index['dtype']}, tokenizer {index['tokenizer']['name']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
