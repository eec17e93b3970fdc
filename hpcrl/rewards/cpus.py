"""How many CPUs this rank may use (stdlib only: the sandbox and verl's reward workers import it)."""

from __future__ import annotations

import os


def workers_per_rank(env=None, affinity=None, node_cpus=None) -> int:
    """The CPUs of this process's affinity mask (what a Slurm step or taskset allows, not the whole
    node's os.cpu_count()), shared by the node's ranks (torchrun's LOCAL_WORLD_SIZE) when the mask
    is the whole node; a mask narrower than the node is taken as this rank's own share already
    (srun --cpu-bind gives each rank its CPUs). At least 1."""
    env = os.environ if env is None else env
    mask = len(os.sched_getaffinity(0)) if affinity is None else affinity
    node = (os.cpu_count() or mask) if node_cpus is None else node_cpus
    ranks = max(1, int(env.get("LOCAL_WORLD_SIZE") or 1))
    return max(1, mask // ranks if mask >= node else mask)
