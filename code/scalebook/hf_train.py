"""The Hugging Face path: the book's GPT trained by ``transformers.Trainer`` on text loaded by ``datasets``.

This is how many users train: text files loaded with ``datasets.load_dataset("text", data_files=...)``,
tokenized and cut into fixed-length blocks with ``Dataset.map``, and a ``Trainer`` that reads the
launcher's environment (``torchrun`` sets RANK/WORLD_SIZE) and wraps the model in
DistributedDataParallel itself. Compared with ``python -m scalebook.train --strategy torch-ddp``, the
Trainer hides the process group, the sampler that gives each rank its share of the data, the
``no_sync`` of gradient accumulation, the learning-rate schedule and the checkpoints; the model and the
all-reduce underneath are the same.

Run ``torchrun --nproc-per-node 2 -m scalebook.hf_train --output-dir out`` (or ``--help``). The model is
our GPT exported with :meth:`scalebook.model.GPT.to_hf` as a ``GPT2LMHeadModel``; tokens are bytes, so
no tokenizer download is needed.

Source: Hugging Face documentation, "Trainer", "TrainingArguments" and "datasets: Load text data".
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def load_blocks(data_files: list[str], seq_len: int):
    """A ``datasets.Dataset`` of ``input_ids``/``labels`` blocks of ``seq_len`` byte tokens from text files."""
    from datasets import load_dataset

    raw = load_dataset("text", data_files={"train": data_files}, split="train", keep_linebreaks=True)

    def to_blocks(batch):
        stream = [b for line in batch["text"] for b in line.encode("utf-8")]
        usable = len(stream) // seq_len * seq_len
        blocks = [stream[i : i + seq_len] for i in range(0, usable, seq_len)]
        # GPT2LMHeadModel shifts the labels itself: labels are the inputs.
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    return raw.map(to_blocks, batched=True, batch_size=2000, remove_columns=["text"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scalebook.hf_train", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--output-dir", required=True, help="where the Trainer writes its files")
    p.add_argument("--data", nargs="*", default=None, help="text files (default: the embedded corpus)")
    p.add_argument("--model", default="tiny", help="GPTConfig.named size")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per block")
    p.add_argument("--micro-batch", type=int, default=4, help="blocks per device per forward")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=5, help="linear warm-up steps")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the data order")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from transformers import Trainer, TrainingArguments

    from scalebook.data import default_corpus
    from scalebook.model import GPT, GPTConfig

    torch.manual_seed(args.seed)
    model = GPT(GPTConfig.named(args.model)).to_hf()
    with tempfile.TemporaryDirectory() as tmp:
        files = args.data
        if not files:
            files = [str(Path(tmp) / "corpus.txt")]
            Path(files[0]).write_text(default_corpus(), encoding="utf-8")
        train_set = load_blocks(files, args.seq_len)
        targs = TrainingArguments(
            output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, warmup_steps=args.warmup_steps,
            lr_scheduler_type="cosine", weight_decay=0.1, adam_beta2=0.95, max_grad_norm=1.0, optim="adamw_torch",
            use_cpu=not torch.cuda.is_available(), ddp_backend="gloo" if not torch.cuda.is_available() else None,
            logging_steps=1, save_strategy="no", report_to=[], seed=args.seed, disable_tqdm=True,
            dataloader_num_workers=0, ddp_find_unused_parameters=False,
        )  # fmt: skip
        trainer = Trainer(model=model, args=targs, train_dataset=train_set)
        trainer.train()
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        record = {"world_size": targs.world_size, "tokens_per_step": trainer.state.train_batch_size
                  * targs.world_size * args.grad_accum * args.seq_len, "losses": losses}  # fmt: skip
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
