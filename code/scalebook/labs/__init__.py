"""When distributed training goes wrong: deliberately broken training code, and the tools that catch it.

Chapter 16's nine labs, one module each. Each pairs a small, DELIBERATELY BROKEN variant of code from
Chapters 7-13 with the symptom it produces, a tool that diagnoses it, and the fix. Broken code is
selected by a variant whose name starts with ``"broken"``; it lives here, not in the modules it imitates,
and must never be copied. Worker functions (``*_lab``) run on the ranks of :func:`scalebook.comm.launch`.
Every public name is re-exported here, so ``labs.diagnose_hang`` and ``labs.hang.diagnose_hang`` are one.

1. :mod:`~scalebook.labs.hang`: ranks issue collectives in different orders. gloo waits for the
   process-group timeout; ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` names the mismatch at once; a flight
   recorder (:func:`record_collectives`) finds it after the fact.
2. :mod:`~scalebook.labs.accumulation`: gradient accumulation scaled wrong (micro-batch losses not
   divided by their number, or averaged per micro-batch although their token counts differ).
3. :mod:`~scalebook.labs.no_sync`: ``no_sync`` misused, caught by per-rank checksums
   (:mod:`~scalebook.labs.checks`) or by counting the traffic.
4. :mod:`~scalebook.labs.randomness`: tensor-parallel ranks initialised from different seeds;
   data-parallel ranks reading the same batch.
5. :mod:`~scalebook.labs.parity`: DP, TP and PP from one seed against one process, losses and gradient
   norms compared step by step; a missing 1/d hides in the losses and shows in the norms.
6. :mod:`~scalebook.labs.oom`: Chapter 7's accounting refuses a micro-batch that will not fit, and a CPU
   emulation of a device with a memory cap fails exactly there.
7. :mod:`~scalebook.labs.slow_rank`: one data-parallel rank is slow and every rank waits for it; the
   per-rank split of each step into compute and waiting (:func:`find_straggler`) and the flight
   recorder's entry times (:func:`straggler_from_trace`) name it.
8. :mod:`~scalebook.labs.stability`: a learning rate raised too far makes the loss spike; a running-median
   detector (:func:`find_spikes`) finds it, and the usual remedies (a lower learning rate, rewinding,
   z-loss, QK-norm) are tried on the same seeded run.
9. :mod:`~scalebook.labs.sdc`: one rank flips a bit of one gradient element (silent data corruption);
   cross-rank parameter checksums see a flip after the all-reduce, recomputing the step names the rank
   for a flip before or after it.

Source: PyTorch documentation, "torch.distributed: Debugging torch.distributed applications"
(``TORCH_DISTRIBUTED_DEBUG``, collective fingerprints) and "DistributedDataParallel.no_sync";
torchtitan documentation, "How to converge" (loss parity); Shoeybi et al. 2019 (Megatron-LM, Sec. 3,
random number generation in tensor parallelism); Korthikanti et al. 2022 (activation memory); NVIDIA
Resiliency Extension, "Straggler Detection"; Chowdhery et al. 2022 (PaLM: z-loss, rewinding around loss
spikes); Dehghani et al. 2023 (QK-norm); Dixit et al. 2021 (silent data corruptions at scale).
"""

from scalebook.labs.accumulation import ACCUMULATION_VARIANTS, accumulation_lab, padded_batch
from scalebook.labs.checks import check_variants, checksum, rank_checksums, spread
from scalebook.labs.hang import (
    HANG_VARIANTS,
    HangReport,
    TracedCall,
    diagnose_hang,
    first_mismatch,
    read_trace,
    record_collectives,
    sync_and_check_stop,
)
from scalebook.labs.no_sync import NO_SYNC_VARIANTS, no_sync_lab
from scalebook.labs.oom import EmulatedDevice, check_fits, oom_sweep, predicted_peak_bytes, train_under_cap
from scalebook.labs.parity import PARITY_LAYOUTS, parity_lab
from scalebook.labs.randomness import DATA_VARIANTS, TP_SEED_VARIANTS, randomness_lab
from scalebook.labs.sdc import SDC_CONFIG, SDC_VARIANTS, blame, flip_bit, sdc_lab
from scalebook.labs.slow_rank import (
    SLOW_RANK_VARIANTS,
    SlowRankReport,
    diagnose_slow_rank,
    entry_lateness,
    find_straggler,
    slow_rank_lab,
    straggler_from_trace,
)
from scalebook.labs.stability import (
    STABILITY_CONFIG,
    STABILITY_VARIANTS,
    ProbedAttention,
    add_probed_attention,
    find_spikes,
    stability_lab,
    train_through_spike,
    z_loss,
)

__all__ = [
    "ACCUMULATION_VARIANTS",
    "DATA_VARIANTS",
    "HANG_VARIANTS",
    "NO_SYNC_VARIANTS",
    "PARITY_LAYOUTS",
    "SDC_CONFIG",
    "SDC_VARIANTS",
    "STABILITY_CONFIG",
    "STABILITY_VARIANTS",
    "SLOW_RANK_VARIANTS",
    "TP_SEED_VARIANTS",
    "EmulatedDevice",
    "HangReport",
    "ProbedAttention",
    "SlowRankReport",
    "TracedCall",
    "accumulation_lab",
    "add_probed_attention",
    "blame",
    "check_fits",
    "check_variants",
    "checksum",
    "diagnose_hang",
    "diagnose_slow_rank",
    "entry_lateness",
    "find_straggler",
    "find_spikes",
    "first_mismatch",
    "flip_bit",
    "no_sync_lab",
    "oom_sweep",
    "padded_batch",
    "parity_lab",
    "predicted_peak_bytes",
    "randomness_lab",
    "rank_checksums",
    "read_trace",
    "record_collectives",
    "sdc_lab",
    "slow_rank_lab",
    "spread",
    "stability_lab",
    "straggler_from_trace",
    "sync_and_check_stop",
    "train_through_spike",
    "train_under_cap",
    "z_loss",
]
