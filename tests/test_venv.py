"""Venvs built at submit on the login side (hpcrl/venv.py), on the local backend: the run's job only
checks the ready marker and activates the venv. Real `python -m venv` and pip, with no network: the
requirement is pip itself (every venv has it), and PIP_NO_INDEX keeps a missing one from the index.
The same on the Perlmutter-shaped Slurm cluster, with venv_root read-only on its nodes:
tests/test_slurm_venv.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from helpers import hpcrl, run_dir, run_state, started, wait_for_run

OFFLINE = {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


@pytest.fixture
def venv_site(fast_local, tmp_path, monkeypatch):
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    root = tmp_path / "venvs"
    (Path(os.environ["HPCRL_SITES_DIR"]) / "venvlocal.yaml").write_text(
        yaml.safe_dump({"extends": fast_local, "venv_root": str(root)}))
    return root


def _submit(name, *extra, check=True):
    return hpcrl("submit", "--site", "venvlocal", "--trainer", "smoke", "--hours", "0.01", "--name", name,
                 "--set", "args.steps=6", "--set", "args.step_time_s=0.05", *extra, check=check, timeout=300)


def test_submit_builds_the_venv_once_and_the_job_only_activates_it(venv_site):
    r = _submit("v1", "--set", "requirements=[pip]")
    built = [p for p in venv_site.iterdir() if p.is_dir()]
    assert len(built) == 1, list(venv_site.iterdir())
    venv = built[0]
    assert f"building venv {venv}" in r.stderr and f"venv {venv} ready" in r.stderr, r.stderr
    marker = venv / ".hpcrl-ready"
    assert marker.read_text() == "pip\n"
    log = venv_site / f"{venv.name}.log"
    assert "-m pip install" in log.read_text() and "Requirement already satisfied: pip" in log.read_text()
    stamp = marker.stat().st_mtime_ns
    state = wait_for_run("v1", timeout=120)
    assert state["state"] == "COMPLETED", state
    job_log = "".join(p.read_text() for p in sorted((run_dir("v1") / "logs").iterdir()))
    assert f"hpcrl: venv {venv} (ready since" in job_log and "building venv" not in job_log, job_log
    assert marker.stat().st_mtime_ns == stamp
    # A second run of the same requirement set reuses it: no build, the same marker.
    r2 = _submit("v2", "--set", "requirements=[pip]")
    assert "building venv" not in r2.stderr, r2.stderr
    assert marker.stat().st_mtime_ns == stamp and sorted(p.name for p in venv_site.iterdir()) == \
        sorted([venv.name, f"{venv.name}.log", f"{venv.name}.lock"])
    hpcrl("cancel", "v2")


def test_a_pip_failure_at_submit_names_the_log_and_leaves_no_run(venv_site, home):
    r = _submit("bad", "--set", "requirements=[hpcrl-no-such-package==1.0]", check=False)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and err[-1].startswith("hpcrl: error: building venv "), r.stderr
    assert "failed (exit 1); see " in err[-1], r.stderr
    log = Path(err[-1].rsplit("see ", 1)[1])
    assert "hpcrl-no-such-package" in log.read_text()
    assert [p.name for p in venv_site.iterdir()] and not any(p.is_dir() for p in venv_site.iterdir()), \
        "no half-built venv is left"
    assert not (home / "runs" / "bad").exists()
    assert "bad" not in hpcrl("status").stdout


def test_a_venv_gone_after_submit_fails_the_job_in_one_line_naming_the_command(venv_site):
    import shutil

    _submit("gone", "--set", "requirements=[pip]", "--max-segments", "1")
    venv = next(p for p in venv_site.iterdir() if p.is_dir())
    shutil.rmtree(venv)
    state = wait_for_run("gone", timeout=120)
    seg = started(state)[0]
    assert seg["state"] == "FAILED", state
    assert seg["error"] == (f"venv {venv} is missing, unfinished or stale; build it on a login node: "
                            f"hpcrl venv build --run gone"), seg
    # and that command builds it, here, on the login side
    out = hpcrl("venv", "build", "--run", "gone", timeout=300).stdout
    assert f"venv {venv} built (1 requirements)" in out and (venv / ".hpcrl-ready").is_file()
    assert "already ready" in hpcrl("venv", "build", "--run", "gone").stdout
    assert run_state("gone")["state"] in ("STOPPED", "FAILED")
    # resume builds a venv that went missing, before it queues anything
    shutil.rmtree(venv)
    r = hpcrl("resume", "gone", "--max-segments", "3", timeout=300)
    assert f"building venv {venv}" in r.stderr and (venv / ".hpcrl-ready").is_file(), r.stderr
    state = wait_for_run("gone", timeout=120)
    assert state["state"] == "COMPLETED", state


def test_a_venv_root_that_cannot_be_written_is_one_line_and_no_run(fast_local, home):
    (Path(os.environ["HPCRL_SITES_DIR"]) / "venvbad.yaml").write_text(
        yaml.safe_dump({"extends": fast_local, "venv_root": "/dev/null/venvs"}))
    r = hpcrl("submit", "--site", "venvbad", "--trainer", "smoke", "--name", "nv", "--set", "requirements=[pip]",
              check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("hpcrl: error: cannot create the venv's directory /dev/null/venvs: ") and \
        "login node" in r.stderr, r.stderr
    assert not (home / "runs" / "nv").exists()
