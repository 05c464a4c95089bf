"""Distributed building blocks: launching ranks and reading the launcher's environment.

``launch`` runs a package function on N local CPU ranks (gloo) from a notebook, a script or a test;
``detect_env``/``init_from_env`` read what torchrun or SLURM set so the same code runs on a cluster.
"""

from .launch import DistEnv, LaunchError, backend_and_device, detect_env, free_port, init_from_env, launch

__all__ = ["DistEnv", "LaunchError", "backend_and_device", "detect_env", "free_port", "init_from_env", "launch"]
