"""What the package needs from a PyTorch older than the pinned one (the GPU machines have run 2.11).

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` and deprecated the old names with a warning; older releases have only the old ones.
The package calls the new names. Importing this module gives them to an older torch, in ``torch.distributed``
and in ``distributed_c10d`` (where wrappers of the calls, :mod:`scalebook.comm.intercept`, read them); on 2.13
it does nothing. ``scalebook.parallel`` (every strategy) and the labs that call the new names import it.

Source: PyTorch 2.13 release notes, torch.distributed ("all_gather_single", "reduce_scatter_single").
"""

from __future__ import annotations

import torch.distributed as dist

RENAMED = (("all_gather_single", "all_gather_into_tensor"), ("reduce_scatter_single", "reduce_scatter_tensor"))

for _new, _old in RENAMED:
    for _module in (dist, dist.distributed_c10d):
        if not hasattr(_module, _new):
            setattr(_module, _new, getattr(_module, _old))
