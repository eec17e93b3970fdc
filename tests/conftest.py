"""Shared fixtures. Tests never touch the real home: HPCRL_HOME and HPCRL_SITES_DIR point into
tmp_path, and the CLI runs as a real subprocess where processes and signals matter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A hostile value for every quoting path: quotes, command substitution, backticks, newline.
HOSTILE = "a'; touch /tmp/PWNED-hpcrl #\"$(touch /tmp/PWNED-hpcrl2)`touch /tmp/PWNED-hpcrl3`\nx;y"
PWNED = [Path("/tmp/PWNED-hpcrl"), Path("/tmp/PWNED-hpcrl2"), Path("/tmp/PWNED-hpcrl3")]

try:  # the Slurm fixture lives with the Slurm tests' helpers
    from slurm_fixture import slurm_cluster  # noqa: F401
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


def hpcrl(*args, check=True, env=None, timeout=120, cwd=None):
    """Run the real CLI as a subprocess; returns CompletedProcess with text output."""
    proc = subprocess.run([sys.executable, "-m", "hpcrl.cli", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"hpcrl {' '.join(map(str, args))} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_state(run_id: str) -> dict:
    from hpcrl.runs import Run

    return Run.by_id(run_id).state()


def wait_for(run_id: str, states=("COMPLETED", "FAILED", "CANCELLED", "STOPPED"), timeout=180, poll=0.5) -> dict:
    """Wait until the run reaches one of `states` and no job of it is still alive."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = json.loads(hpcrl("status", run_id, "--json").stdout)[0]
        if st["state"] in states:
            state = run_state(run_id)
            if not any(s["state"] in ("RUNNING", "QUEUED") for s in state["segments"]):
                return state
        time.sleep(poll)
    raise AssertionError(f"run {run_id} did not reach {states} within {timeout}s: {run_state(run_id)}")


def metrics_steps(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(autouse=True)
def _no_pwned():
    for p in PWNED:
        p.unlink(missing_ok=True)
    yield
    leaked = [str(p) for p in PWNED if p.exists()]
    assert not leaked, f"a hostile value was executed: {leaked}"
