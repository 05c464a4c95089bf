"""Communication building blocks: launching ranks, reading the launcher's environment, counting traffic.

(Named ``comm``, not ``dist``, so that it never reads like build output or shadows ``torch.distributed as dist``.)

``launch`` runs a package function on N local CPU ranks (gloo) from a notebook, a script or a test;
``detect_env``/``init_from_env`` read what torchrun or SLURM set so the same code runs on a cluster;
``count_traffic`` records every communication call a rank makes and the bytes it sends;
``nccl_rules`` checks, on gloo, that NCCL could pair, match and progress what the ranks issued
(``launch(..., check_nccl=True)`` or ``SCALEBOOK_CHECK_NCCL=1``).
"""

from .launch import DistEnv, LaunchError, backend_and_device, detect_env, free_port, init_from_env, launch
from .nccl_rules import NcclRuleError
from .traffic import CommCall, Traffic, count_traffic

__all__ = [
    "CommCall",
    "DistEnv",
    "LaunchError",
    "NcclRuleError",
    "Traffic",
    "backend_and_device",
    "count_traffic",
    "detect_env",
    "free_port",
    "init_from_env",
    "launch",
]
