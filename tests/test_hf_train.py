"""The Hugging Face path: datasets' text loader and transformers.Trainer, launched by torchrun on 2 CPU ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

from scalebook.hf_train import load_blocks


def test_text_files_become_byte_blocks_in_order(tmp_path):
    text = "first line\nsecond line, with ümlaut\n" * 5
    path = tmp_path / "a.txt"
    path.write_text(text, encoding="utf-8")
    blocks = load_blocks([str(path)], seq_len=16)
    stream = list(text.encode("utf-8"))
    assert blocks["input_ids"] == [stream[i : i + 16] for i in range(0, len(stream) // 16 * 16, 16)]
    assert blocks["labels"] == blocks["input_ids"]  # GPT2LMHeadModel shifts labels itself


def test_trainer_trains_our_gpt_with_ddp_on_two_ranks(tmp_path):
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    result = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node=2", "-m", "scalebook.hf_train", "--output-dir", str(tmp_path),
         "--steps", "10", "--seq-len", "32"],
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads([line for line in result.stdout.splitlines() if line.startswith('{"world_size"')][-1])
    assert record["world_size"] == 2 and record["tokens_per_step"] == 2 * 4 * 32
    losses = record["losses"]
    assert len(losses) == 10
    # Untrained byte-level model: about ln(256) = 5.5 nats; ten AdamW steps at lr 3e-3 bring it well below.
    assert losses[0] > 5.0 and losses[-1] < 4.2
