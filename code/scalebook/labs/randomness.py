"""Lab 4, unsynchronized randomness: tensor-parallel ranks initialised from different seeds, and
data-parallel ranks reading the same batch; per-rank checksums expose both.

Source: Shoeybi et al. 2019, "Megatron-LM", Sec. 3 (random number generation in tensor parallelism).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from scalebook.data import corpus_tokens, get_batch
from scalebook.labs.checks import rank_checksums
from scalebook.model import GPT, GPTConfig
from scalebook.parallel.tensor import apply_tensor_parallel, sharding_of

TP_SEED_VARIANTS = ("broken: seed + rank on every rank", "fixed: one seed for all tensor-parallel ranks")
DATA_VARIANTS = ("broken: every rank reads the whole batch", "fixed: each rank reads its shard")


def randomness_lab(*, batch_size: int = 4, seq_len: int = 32, size: str = "tiny", seed: int = 0) -> dict:
    """Worker: the two random streams that must (or must not) agree across ranks.

    ``"tp"``: each variant shards over all ranks (:func:`~scalebook.parallel.tensor.apply_tensor_parallel`)
    a GPT initialised with ``seed + rank`` (broken) or ``seed``; reports the checksums of the
    replicated parameters (LayerNorms, position embeddings, row-parallel biases: they must agree) and
    the loss error against the unsharded GPT built from ``seed``. ``"data"``: each variant's batch
    checksums (data-parallel shards must differ).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    config = GPTConfig.named(size)
    x, y = get_batch(corpus_tokens(), batch_size, seq_len, torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    _, ref_loss = GPT(config)(x, y)
    tp = {}
    for variant in TP_SEED_VARIANTS:
        torch.manual_seed(seed + rank if variant.startswith("broken") else seed)
        model = apply_tensor_parallel(GPT(config))
        replicated = [p for n, p in model.named_parameters() if sharding_of(n) is None]
        _, loss = model(x, y)
        tp[variant] = {"checksums": rank_checksums(replicated), "loss_error": abs(loss.item() - ref_loss.item())}
    data = {}
    for variant in DATA_VARIANTS:
        generator = torch.Generator().manual_seed(seed)
        if variant.startswith("broken"):  # the sampler was never told about the other ranks
            xb, _ = get_batch(corpus_tokens(), batch_size, seq_len, generator)
        else:
            xb, _ = get_batch(corpus_tokens(), batch_size, seq_len, generator, rank=rank, world_size=world)
        data[variant] = {"checksums": rank_checksums([xb])}
    return {"tp": tp, "data": data}
