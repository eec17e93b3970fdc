"""Shared fixtures. Tests never touch the real home: HPCRL_HOME and HPCRL_SITES_DIR point into
tmp_path, and the CLI runs as a real subprocess where processes and signals matter. Helpers
(waiting, the CLI, metrics, checkpoints) are in helpers.py."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from helpers import PWNED

try:  # the Slurm fixture lives with the Slurm tests' helpers
    from slurm_fixture import pm_cluster, slurm_cluster  # noqa: F401
except ImportError:
    pass


@pytest.fixture(autouse=True)
def _slurm_locks(request):
    """Slurm tests run on several xdist workers at once: see slurm_fixture's locks."""
    node = request.node
    if not node.get_closest_marker("slurm") or node.get_closest_marker("stops_slurmctld"):
        if node.get_closest_marker("uses_ray") and not node.get_closest_marker("stops_slurmctld"):
            # a local Ray (the verl tier) must not run beside the two-node Ray tests either: in
            # one full run they overlapped and the Slurm test's worker failed with InvalidAuthToken
            from slurm_fixture import ray_to_myself

            with ray_to_myself():
                yield
            return
        yield
        return
    from slurm_fixture import cluster_shared, ray_to_myself

    with contextlib.ExitStack() as stack:
        stack.enter_context(cluster_shared())
        if node.get_closest_marker("uses_ray"):
            stack.enter_context(ray_to_myself())
        yield


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An isolated hpcrl home and user-sites dir for one test."""
    h = tmp_path / "home"
    sites = tmp_path / "sites"
    sites.mkdir(parents=True)
    monkeypatch.setenv("HPCRL_HOME", str(h))
    monkeypatch.setenv("HPCRL_SITES_DIR", str(sites))
    monkeypatch.delenv("HPCRL_ACCOUNT", raising=False)
    return h


@pytest.fixture
def fast_local(home):
    """A user site 'fastlocal' with short signal lead/margins so lifecycle tests take seconds."""
    sites = Path(os.environ["HPCRL_SITES_DIR"])
    (sites / "fastlocal.yaml").write_text(
        "extends: local\nsignal_lead_s: 4\nexit_margin_s: 1.5\nkill_grace_s: 3\n", encoding="utf-8")
    return "fastlocal"


@pytest.fixture(autouse=True)
def _no_pwned():
    for p in PWNED:
        p.unlink(missing_ok=True)
    yield
    leaked = [str(p) for p in PWNED if p.exists()]
    assert not leaked, f"a hostile value was executed: {leaked}"
