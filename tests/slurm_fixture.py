"""Fixtures for tests that need the real throwaway Slurm cluster (scripts/slurm-cluster).

`slurm_cluster` (session) finds the cluster's config, points SLURM_CONF at it and skips when the
cluster is not answering. `slurm_backend` (per test) is a SlurmBackend that cancels every job it
submitted when the test ends, because other tests may share the cluster.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpcrl.backends.slurm import SlurmBackend

SKIP_REASON = "Slurm test cluster not running: start it with scripts/slurm-cluster start"


@dataclass
class SlurmCluster:
    conf: Path


def _default_conf() -> Path:
    # Where scripts/slurm-cluster writes it (`scripts/slurm-cluster env` prints the same path).
    return Path(os.environ.get("HPCRL_SLURM_DIR", "/tmp/hpcrl-slurm")) / "etc" / "slurm.conf"


def _answers(env: dict) -> bool:
    try:
        return subprocess.run(["scontrol", "ping"], env=env, capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def slurm_cluster():
    conf = os.environ.get("SLURM_CONF") or str(_default_conf())
    if not Path(conf).is_file() or not _answers({**os.environ, "SLURM_CONF": conf}):
        pytest.skip(SKIP_REASON)
    # Every client the tests start (and every job's own sbatch) must read this config.
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    yield SlurmCluster(Path(conf))
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old


class TrackingSlurmBackend(SlurmBackend):
    """Remembers what it submitted so the fixture can cancel it."""

    def __init__(self, site: dict):
        super().__init__(site)
        self.submitted: list[str] = []

    def submit(self, script, run_dir, job_name, after=None):
        job_id = super().submit(script, run_dir, job_name, after)
        self.submitted.append(job_id)
        return job_id


@pytest.fixture
def slurm_backend(slurm_cluster):
    backend = TrackingSlurmBackend({"scheduler": "slurm"})
    yield backend
    if backend.submitted:
        backend.cancel(backend.submitted)
