"""Lab 6, out of memory, predicted: Chapter 7's accounting refuses a micro-batch that will not fit
(:func:`check_fits`), and a CPU emulation of a device with a memory cap (:class:`EmulatedDevice`) fails
exactly there.

Source: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(activation memory); PyTorch documentation, "Hooks for saved tensors".
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch

from scalebook import measure
from scalebook.accounting.memory import activation_bytes, model_state_bytes
from scalebook.configs import ModelConfig, gpt_like
from scalebook.data import corpus_tokens, get_batch
from scalebook.model import GPT, GPTConfig
from scalebook.train import TrainConfig, make_optimizer


def _model_config(config: GPTConfig) -> ModelConfig:
    return gpt_like(f"GPT n_layer={config.n_layer} n_embd={config.n_embd}", vocab_size=config.vocab_size,
                    d_model=config.n_embd, n_layers=config.n_layer, n_heads=config.n_head,
                    max_seq_len=config.block_size, bias=config.bias)  # fmt: skip


def predicted_peak_bytes(config: GPTConfig, *, micro_batch: int, seq_len: int) -> dict[str, int]:
    """Bytes one fp32 AdamW training step holds at the end of the forward pass, by Chapter 7's accounting.

    ``model_states``: parameters, gradients, Adam's two moments (16 bytes per parameter);
    ``activations``: Korthikanti et al.'s per-layer count at 4 bytes per value without dropout (the
    explicit attention saves its score matrix); ``logits``: the (b, s, V) logits and the fp32
    log-softmax the loss saves, ``2 b s V`` values, which the per-layer formula leaves out.
    """
    if config.dropout:
        raise ValueError("predicted_peak_bytes counts a model without dropout; build the GPT with dropout=0")
    cfg = _model_config(config)
    states = model_state_bytes(cfg, precision="fp32", optimizer="adam").total
    acts = activation_bytes(cfg, seq_len=seq_len, micro_batch=micro_batch, dtype_bytes=4, dropout=False)
    logits = 2 * micro_batch * seq_len * config.vocab_size * 4
    return {"model_states": states, "activations": acts, "logits": logits, "total": states + acts + logits}


def check_fits(config: GPTConfig, *, micro_batch: int, seq_len: int, capacity: int) -> dict[str, int]:
    """Refuse a layout up front: ValueError with the numbers if :func:`predicted_peak_bytes` exceeds
    ``capacity`` bytes; otherwise return the prediction."""
    predicted = predicted_peak_bytes(config, micro_batch=micro_batch, seq_len=seq_len)
    if predicted["total"] > capacity:
        per_sequence = predicted_peak_bytes(config, micro_batch=1, seq_len=seq_len)
        largest = (capacity - per_sequence["model_states"]) // (per_sequence["total"] - per_sequence["model_states"])
        raise ValueError(
            f"micro-batch {micro_batch} x {seq_len} tokens will not fit: predicted "
            f"{predicted['total']:,} bytes (model states {predicted['model_states']:,}, activations "
            f"{predicted['activations']:,}, logits {predicted['logits']:,}) > capacity {capacity:,}; "
            f"use micro_batch <= {largest} with gradient accumulation, or activation recomputation"
        )
    return predicted


class _Saved:
    """A tensor saved for backward, counted on its device while autograd holds it."""

    def __init__(self, tensor: torch.Tensor, device: EmulatedDevice):
        self.tensor, self.device = tensor, device
        device._add(tensor)

    def __del__(self):
        self.device._remove(self.tensor)


class EmulatedDevice:
    """A CPU stand-in for a device with ``capacity`` bytes: raises ``torch.OutOfMemoryError`` when the
    model states plus the tensors saved for backward (each storage once, parameters excluded) exceed it.

    Not counted: temporary buffers that die within one operation (a real device needs headroom for them).
    """

    def __init__(self, capacity: int):
        if not capacity > 0:
            raise ValueError(f"capacity must be a positive number of bytes, got {capacity!r}")
        self.capacity = capacity
        self.state_bytes = 0
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [bytes, references]
        self.saved_bytes = self.peak = 0

    def _add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        entry = self._storages.setdefault(storage.data_ptr(), [storage.nbytes(), 0])
        if entry[1] == 0:
            self.saved_bytes += entry[0]
        entry[1] += 1
        used = self.state_bytes + self.saved_bytes
        self.peak = max(self.peak, used)
        if used > self.capacity:
            raise torch.OutOfMemoryError(
                f"emulated device out of memory: {used:,} bytes in use (model states {self.state_bytes:,}, "
                f"saved activations {self.saved_bytes:,}) > capacity {self.capacity:,}"
            )

    def _remove(self, tensor: torch.Tensor) -> None:
        entry = self._storages[tensor.untyped_storage().data_ptr()]
        entry[1] -= 1
        if entry[1] == 0:
            self.saved_bytes -= entry[0]
            del self._storages[tensor.untyped_storage().data_ptr()]

    @contextlib.contextmanager
    def running(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Account one forward and backward of ``model``: its states now, and every tensor saved meanwhile."""
        self.state_bytes = measure.model_state_bytes(model, optimizer).total
        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t: torch.Tensor):
            return t if t.untyped_storage().data_ptr() in parameters else _Saved(t, self)

        def unpack(packed):
            return packed.tensor if isinstance(packed, _Saved) else packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


def train_under_cap(
    config: GPTConfig, *, micro_batch: int, seq_len: int, capacity: int, steps: int = 2, seed: int = 0
) -> int:
    """Train ``steps`` fp32 AdamW steps on an :class:`EmulatedDevice` of ``capacity`` bytes; return its
    peak bytes, or raise ``torch.OutOfMemoryError`` where a real device would. Gradients stay allocated
    between steps (``zero_grad(set_to_none=False)``), so from step 1 on all model states are resident."""
    torch.manual_seed(seed)
    model = GPT(config)
    optimizer = make_optimizer(model, TrainConfig(steps=steps, grad_clip=None, progress=False))
    device = EmulatedDevice(capacity)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = get_batch(corpus_tokens(), micro_batch, seq_len, generator)
        optimizer.zero_grad(set_to_none=False)
        with device.running(model, optimizer):
            _, loss = model(x, y)
            loss.backward()
        optimizer.step()
    return device.peak


def oom_sweep(config: GPTConfig, micro_batches, *, seq_len: int, capacity: int) -> list[dict]:
    """For each micro-batch size: the predicted bytes and verdict of :func:`check_fits`, and what
    :func:`train_under_cap` observed (peak bytes, or the bytes in use when it ran out)."""
    rows = []
    for b in micro_batches:
        predicted = predicted_peak_bytes(config, micro_batch=b, seq_len=seq_len)["total"]
        try:
            check_fits(config, micro_batch=b, seq_len=seq_len, capacity=capacity)
            refused = False
        except ValueError:
            refused = True
        try:
            observed, failed = train_under_cap(config, micro_batch=b, seq_len=seq_len, capacity=capacity), False
        except torch.OutOfMemoryError as error:
            observed, failed = int(re.search(r"([\d,]+) bytes in use", str(error)).group(1).replace(",", "")), True
        rows.append({"micro_batch": b, "predicted": predicted, "refused": refused, "observed": observed,
                     "out_of_memory": failed})  # fmt: skip
    return rows
