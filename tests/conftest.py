"""Shared fixtures. Tests never touch the real home: HPCRL_HOME and HPCRL_SITES_DIR point into
tmp_path, and the CLI runs as a real subprocess where processes and signals matter. Helpers
(waiting, the CLI, metrics, checkpoints) are in helpers.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import PWNED

try:  # the Slurm fixture lives with the Slurm tests' helpers
    from slurm_fixture import pm_cluster, slurm_cluster  # noqa: F401
except ImportError:
    pass


def pytest_collection_modifyitems(config, items):
    # Under xdist (scripts/test runs -n 2 --dist loadgroup) the Slurm tests share one worker: they
    # share one cluster, and mostly wait on it, while the other worker runs everything else.
    for item in items:
        if item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.xdist_group("slurm"))


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
