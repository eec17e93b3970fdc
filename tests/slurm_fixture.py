"""Fixtures for tests that need the real throwaway Slurm cluster (scripts/slurm-cluster).

`slurm_cluster` (session) asks `scripts/slurm-cluster env` which cluster is the test cluster, puts
those exports (SLURM_CONF, HPCRL_SLURM_*) into os.environ and skips, saying why, when it is not
answering. `pm_cluster` also skips unless that cluster is Perlmutter-shaped. `slurm_backend` (per test) is a SlurmBackend that cancels every job it
submitted when the test ends, because other tests may share the cluster.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hpcrl.backends.slurm import SlurmBackend

CLUSTER_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "slurm-cluster"
SKIP_REASON = "Slurm test cluster not running: start it with scripts/slurm-cluster start"


@dataclass
class SlurmCluster:
    """What `scripts/slurm-cluster env` prints: the tests talk to exactly that cluster."""

    conf: Path
    env: dict = field(default_factory=dict)

    @property
    def shape(self) -> str:
        return self.env.get("HPCRL_SLURM_SHAPE", "plain")

    @property
    def account(self) -> str | None:
        return self.env.get("HPCRL_SLURM_ACCOUNT")

    @property
    def nodes(self) -> list[str]:
        return [n for n in self.env.get("HPCRL_SLURM_NODES", "").split(",") if n]

    @property
    def tier_partition(self) -> str | None:
        """The partition of the node kept for the tiers' long Slurm verl run (scripts/slurm-cluster)."""
        return self.env.get("HPCRL_SLURM_TIER_PARTITION") or None

    def netns(self, node: str) -> str:
        """The network namespace (a path) that node's slurmd and its jobs run in."""
        pairs = dict(p.split("=", 1) for p in self.env.get("HPCRL_SLURM_NETNS", "").split(",") if "=" in p)
        return pairs[node]


# Under xdist (scripts/test: -n 3 --dist loadfile) Slurm test files run on several workers at once
# (they mostly wait on the scheduler). Two locks keep them out of each other's way (files under
# /tmp: one machine, every worker): every Slurm test holds the cluster shared while it runs, the
# test that stops slurmctld (marker stops_slurmctld) takes it for itself; tests that start a Ray
# cluster (marker uses_ray) run one at a time per network namespace: Ray's fixed ports (dashboard
# agent, the two-node test's head) and the Ray tests' own checks for daemons left behind see one
# namespace. `uses_ray` alone is this machine's own network (the verl tier);
# `uses_ray("slurm-nodes")` the namespaces of the default partition's two nodes (the light phase's
# Slurm Ray tests, and the tests marked both_nodes, which queue a job on both);
# `uses_ray("slurm-tier")` the tier partition's node (the tiers' Slurm verl run, alone there).
# tests/conftest.py applies them.
CLUSTER_LOCK = Path("/tmp/hpcrl-slurm-tests.lock")
# How long a job that needs both default-partition nodes may wait for them behind the one-node jobs
# of the Slurm tests beside it (the long Slurm verl run has a node of its own: scripts/slurm-cluster)
BOTH_NODES_WAIT_S = 600
RAY_LOCKS = {"host": Path("/tmp/hpcrl-ray-host.lock"), "slurm-nodes": Path("/tmp/hpcrl-ray-slurm-nodes.lock"),
             "slurm-tier": Path("/tmp/hpcrl-ray-slurm-tier.lock")}


@contextlib.contextmanager
def _cluster_lock(mode, path=CLUSTER_LOCK):
    with open(path, "a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cluster_shared():
    """Held by Slurm tests running beside others (on another worker) while they run."""
    return _cluster_lock(fcntl.LOCK_SH)


def ray_to_myself(network: str = "host"):
    """Held by a test that starts a Ray cluster in `network` (a key of RAY_LOCKS)."""
    return _cluster_lock(fcntl.LOCK_EX, RAY_LOCKS[network])


def cluster_to_myself():
    """For a test that disturbs the whole cluster (stops slurmctld): waits until no other
    worker's Slurm test runs, and keeps them out meanwhile."""
    return _cluster_lock(fcntl.LOCK_EX)


def cluster_env() -> dict:
    """The exports of `scripts/slurm-cluster env` (HPCRL_SLURM_DIR, when set, chooses the cluster).
    A SLURM_CONF already in the environment is deliberately not used: it may name another cluster."""
    out = subprocess.run(["bash", str(CLUSTER_SCRIPT), "env"], capture_output=True, text=True, check=True).stdout
    env = {}
    for line in out.splitlines():
        if line.startswith("export ") and "=" in line:
            key, value = line[len("export "):].split("=", 1)
            env[key] = shlex.split(value)[0] if value else ""
    return env


def _answers(env: dict) -> bool:
    try:
        return subprocess.run(["scontrol", "ping"], env=env, capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def slurm_cluster():
    if os.environ.get("HPCRL_SLURM_SKIP_REASON"):  # scripts/test could not start it, and says why
        pytest.skip(f"{SKIP_REASON} ({os.environ['HPCRL_SLURM_SKIP_REASON']})")
    try:
        env = cluster_env()
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"{SKIP_REASON} ({CLUSTER_SCRIPT} env failed: {e})")
    conf = env.get("SLURM_CONF", "")
    if not conf or not Path(conf).is_file() or not _answers({**os.environ, **env}):
        pytest.skip(f"{SKIP_REASON} (no cluster answers at SLURM_CONF={conf})")
    # Every client the tests start (and every job's own sbatch) must read this config.
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield SlurmCluster(Path(conf), env)
    for key, value in old.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def pm_cluster(slurm_cluster):
    """The Perlmutter-shaped cluster (accounting, QOS, two GPU nodes in namespaces, Lmod)."""
    if slurm_cluster.shape != "perlmutter" or len(slurm_cluster.nodes) < 2:
        pytest.skip(f"the Slurm test cluster is not Perlmutter-shaped (shape {slurm_cluster.shape}, "
                    f"nodes {slurm_cluster.nodes}): start it with scripts/slurm-cluster start")
    return slurm_cluster


class TrackingSlurmBackend(SlurmBackend):
    """Remembers what it submitted so the fixture can cancel it."""

    def __init__(self, site: dict):
        super().__init__(site)
        self.submitted: list[str] = []

    def sbatch(self, script, after=None):
        job_id = super().sbatch(script, after)
        self.submitted.append(job_id)
        return job_id


@pytest.fixture
def slurm_backend(slurm_cluster):
    backend = TrackingSlurmBackend({"scheduler": "slurm"})
    yield backend
    if backend.submitted:
        backend.cancel(backend.submitted)
