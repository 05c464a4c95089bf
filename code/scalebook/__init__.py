"""scalebook: the code of the book *Training LLMs at Scale*.

Every chapter of the book imports this package; nothing the book teaches is defined only in a notebook.
Submodules are imported lazily so that ``import scalebook`` stays cheap and the pure-Python modules
(``accounting``, ``configs``) never pull in torch.

Modules::

    data        the embedded default corpus, token streams and (input, target) batches
    tokenizer   byte-level BPE from scratch, identical to Hugging Face tokenizers' trainer
    positions   learned, sinusoidal and rotary position encodings
    embeddings  sentence embeddings with the packaged MiniLM encoder
    attention   scaled dot-product and multi-head attention from scratch, and their costs
    model       a GPT decoder from scratch, with Hugging Face GPT-2 weight import and export
    moe         the mixture-of-experts layer: top-k routing, capacity, dispatch and combine, load balancing
    train       the one training loop (``train.loop``), ``python -m scalebook.train`` (``train.cli``: every layout,
                under torchrun or srun, with metrics) and atomic per-rank checkpoints (``train.checkpoint``)
    cluster     a real two-node SLURM cluster on one machine, for tests and readers
    hf_train    the same model trained by Hugging Face's Trainer on a ``datasets`` text loader
    parity      loss-parity checks between parallel layouts
    experiments the chapters' timing studies, sweeps and comparisons (nothing a training run imports)
    labs        deliberately broken variants and the tools that diagnose them (Chapter 16)
    measure     measured counterparts of the accounting formulas (bytes held, step time)
    accounting  closed-form parameter, memory, FLOP and time arithmetic (pure Python)
    configs     published model and hardware configurations
    comm        launching functions on N ranks, environment detection, collectives, traffic, cost model
    parallel    data, ZeRO, tensor, sequence, pipeline, context and expert parallelism; the layout (dims) and
                parallelize(model, dims), which composes them
    planner     search for a parallel layout of a model on a cluster
    generate    greedy, temperature, top-k and top-p sampling
    plots       the book's matplotlib figures
    widgets     ipywidgets calculators and explorers (with static fallbacks in the book)
    notebook    helpers for the chapters (showing package source, reproducibility)
"""

import importlib

__version__ = "0.1.0"

_SUBMODULES = (
    "accounting",
    "attention",
    "cluster",
    "configs",
    "data",
    "comm",
    "embeddings",
    "experiments",
    "generate",
    "hf_train",
    "labs",
    "measure",
    "model",
    "moe",
    "notebook",
    "parallel",
    "parity",
    "planner",
    "plots",
    "positions",
    "tokenizer",
    "train",
    "widgets",
)


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'scalebook' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_SUBMODULES))
