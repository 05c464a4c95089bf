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

The same module runs under ``accelerate launch --config_file FILE -m scalebook.hf_train ...``:
:func:`write_accelerate_config` writes the file that ``accelerate config`` would write, and :func:`launch`
starts the module under either launcher and collects what each rank saw (:func:`launcher_env`, reported by
every rank before training) and rank 0's losses.

Source: Hugging Face documentation, "Trainer", "TrainingArguments" and "datasets: Load text data";
Accelerate documentation, "Launching your Accelerate scripts" and "accelerate config" (1.15).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

#: What a launcher hands each rank, besides the ``ACCELERATE_*`` variables (the error file's path and the
#: thread count, which the caller sets, are left out).
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                      "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")  # fmt: skip


#: The environment variable that names the folder where :func:`launch`'s ranks write their reports.
REPORT_DIR = "SCALEBOOK_HF_REPORT_DIR"


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


def launcher_env(environ=None) -> dict[str, str]:
    """The variables a launcher set for this process: ``LAUNCHER_VARIABLES`` and every ``ACCELERATE_*``."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in sorted(environ) if k in LAUNCHER_VARIABLES or k.startswith("ACCELERATE_")}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Before anything reads (or sets) them: what the launcher handed this rank (a file per rank under launch()).
    _report({"launcher_env": launcher_env()}, f"launcher_env-rank{os.environ.get('RANK', '0')}.json")
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
        _report(record, "record.json")
    return 0


def _report(obj: dict, name: str) -> None:
    """Print ``obj`` as one JSON line; under :func:`launch` also write it to ``name`` in its ``REPORT_DIR``.

    Ranks share the launcher's stdout, so :func:`launch` reads files, written whole and then renamed, rather
    than lines that two ranks may print at the same moment.
    """
    print(json.dumps(obj), flush=True)
    folder = os.environ.get(REPORT_DIR)
    if folder:
        path = Path(folder) / name
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(obj), encoding="utf-8")
        partial.replace(path)


def write_accelerate_config(
    path, num_processes: int, *, num_machines: int = 1, mixed_precision: str = "no", main_process_port: int = 0
) -> Path:
    """Write the YAML file that ``accelerate config`` writes for one process per device; return its path.

    ``distributed_type`` is ``MULTI_GPU`` for several processes (Accelerate's multi-process launcher, which
    runs ``torchrun``'s code; the training script picks the device: here the Trainer takes the CPU and gloo
    where there is no CUDA) and ``NO`` for one. ``main_process_port=0`` asks for a free port, so that runs
    side by side do not collide. Written by Accelerate's own ``ClusterConfig.to_yaml_file``, as the
    interactive command does after its questions.
    """
    if num_processes < 1 or num_machines < 1 or num_processes % num_machines:
        raise ValueError(f"num_processes ({num_processes}) must be a positive multiple of num_machines "
                         f"({num_machines}): Accelerate starts num_processes / num_machines per machine")  # fmt: skip
    if mixed_precision not in ("no", "fp16", "bf16"):
        raise ValueError(f"mixed_precision must be 'no', 'fp16' or 'bf16', got {mixed_precision!r}")
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import ComputeEnvironment, DistributedType

    config = ClusterConfig(
        compute_environment=ComputeEnvironment.LOCAL_MACHINE,
        distributed_type=DistributedType.MULTI_GPU if num_processes > 1 else DistributedType.NO,
        mixed_precision=mixed_precision, use_cpu=False, debug=False, num_processes=num_processes,
        num_machines=num_machines, main_process_port=main_process_port,
    )  # fmt: skip
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    config.to_yaml_file(path)
    return path


@dataclass
class LaunchedRun:
    """The outcome of :func:`launch`: the command, its exit code, each rank's launcher variables (by rank),
    rank 0's record (``world_size``, ``tokens_per_step``, ``losses``) and stderr."""

    command: list[str]
    returncode: int
    rank_envs: list[dict[str, str]]
    record: dict | None
    stderr: str

    @property
    def shown(self) -> str:
        """The command as a user types it (``torchrun ...`` or ``accelerate launch ...``)."""
        prefix = {"torch.distributed.run": "torchrun", "accelerate.commands.accelerate_cli": "accelerate"}
        return " ".join([prefix[self.command[2]], *self.command[3:]])


def launch(
    launcher: str, train_args: list[str], *, nproc: int = 2, config_file=None, timeout: float = 300.0
) -> LaunchedRun:
    """Run ``-m scalebook.hf_train`` under ``"torchrun"`` (``nproc`` ranks) or ``"accelerate"`` (``accelerate
    launch --config_file config_file``, which takes the number of processes from the file).

    The ranks get one thread each and no network (``HF_HUB_OFFLINE``); each writes what it reports into a
    temporary folder (``REPORT_DIR``). After ``timeout`` seconds the launcher and its ranks are killed and
    TimeoutError raised with the end of their stderr (:func:`scalebook.comm.processes.run`: every process the
    launcher started is killed, torchrun's ranks in their own sessions included).
    """
    from scalebook.comm import processes

    python = sys.executable
    if launcher == "torchrun":
        if nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {nproc}")
        head = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    elif launcher == "accelerate":
        if config_file is None:
            raise ValueError("launch('accelerate', ...) needs config_file=: write one with write_accelerate_config")
        head = [python, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(config_file)]
    else:
        raise ValueError(f"launcher must be 'torchrun' or 'accelerate', got {launcher!r}")
    command = [*head, "-m", "scalebook.hf_train", *train_args]
    with tempfile.TemporaryDirectory(prefix="hf-launch-") as reports:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               REPORT_DIR: reports}  # fmt: skip
        finished = processes.run(command, env=env, timeout=timeout, name=launcher)
        folder = Path(reports)
        rank_envs = [json.loads(p.read_text(encoding="utf-8"))["launcher_env"]
                     for p in folder.glob("launcher_env-rank*.json")]  # fmt: skip
        rank_envs.sort(key=lambda e: int(e.get("RANK", 0)))
        record_file = folder / "record.json"
        record = json.loads(record_file.read_text(encoding="utf-8")) if record_file.is_file() else None
    return LaunchedRun(command, finished.returncode, rank_envs, record, finished.stderr)


if __name__ == "__main__":
    sys.exit(main())
