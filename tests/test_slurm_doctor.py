"""`hpcrl doctor` on the Perlmutter-shaped test cluster (real sinfo, sacctmgr, Lmod): a good user
site passes every check; deliberately broken profiles each fail (or warn) with their own message,
and the exit status is non-zero on any failure."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import hpcrl

pytestmark = [pytest.mark.slurm]


@pytest.fixture
def login_node(home, pm_cluster, tmp_path, monkeypatch):
    """This shell as a Perlmutter login node: Lmod's `module` in non-interactive bash (what a
    login node's environment gives), $SCRATCH set; the user site extends perlmutter."""
    etc = Path(os.environ["SLURM_CONF"]).parent
    monkeypatch.setenv("BASH_ENV", str(etc / "lmod-bashenv.sh"))
    monkeypatch.setenv("MODULEPATH", os.environ["HPCRL_SLURM_MODULEPATH"])
    monkeypatch.setenv("LMOD_ALLOW_ROOT_USE", "yes")
    (tmp_path / "scratch").mkdir()
    monkeypatch.setenv("SCRATCH", str(tmp_path / "scratch"))

    monkeypatch.setenv("PIP_NO_INDEX", "1")  # the venv builds below install nothing (see _TORCH_SETUP)

    def site(**changes):
        # the test cluster's GPUs are gres stand-ins and its torch this CPU build: no driver to fit.
        # The hooks python is named, as a Perlmutter user names a venv's on a shared file system:
        # else doctor judges the suite's own interpreter, which lives wherever the checkout does
        # and rightly fails under /tmp (issue 39; hooks_python per its input: tests/test_doctor.py)
        data = {"extends": "perlmutter", "venv_root": str(tmp_path / "venvs"), "setup": [_TORCH_SETUP],
                "gpu_stack": {"driver_cuda": None, "cuda_variant": None, "nccl": None},
                "hpcrl_python": HOOKS_PYTHON, **changes}
        (Path(os.environ["HPCRL_SITES_DIR"]) / "pmdoc.yaml").write_text(yaml.safe_dump(data))
        return ["--site", "pmdoc", "--account", os.environ.get("HPCRL_SLURM_ACCOUNT", "m1234_g")]

    return site


# Test double for the trainer's multi-GB torch stack, which cannot be downloaded here: the test
# interpreter's site-packages on PYTHONPATH (as EasyBuild-style modules provide packages), so the
# real venv build finds every requirement satisfied.
_TORCH_SETUP = (f'export PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}'
                f'{Path(importlib.util.find_spec("torch").origin).parents[1]}"')


# The interpreter the suite's venv was made from (its symlink resolved): outside the checkout, on a
# file system this machine's Slurm nodes share. doctor only judges where it is.
HOOKS_PYTHON = os.path.realpath(sys.executable)


def lines(out: str) -> dict:
    return {ln.split()[1]: ln for ln in out.splitlines() if ln[:4] in ("PASS", "WARN", "FAIL")}


def test_a_good_perlmutter_site_passes_every_check(login_node):
    args = login_node()
    before = lines(hpcrl("doctor", *args).stdout)["venv"]
    assert before.startswith("WARN") and "not built" in before and \
        "fix: build it now: hpcrl venv build --trainer builtin --site pmdoc --account m1234_g" in before, before
    hpcrl("venv", "build", "--trainer", "builtin", *args, timeout=300)
    r = hpcrl("doctor", *args, check=False)
    assert r.returncode == 0, r.stdout
    got = lines(r.stdout)
    assert set(got) >= {"scheduler", "nodes", "account", "qos", "outputs", "venv_root", "modules", "python",
                        "venv", "hooks"}, r.stdout
    assert HOOKS_PYTHON in got["hooks"], got["hooks"]
    assert all(v.startswith("PASS") for v in got.values()), r.stdout
    assert "ready (8 requirements of builtin)" in got["venv"], got["venv"]
    # every GPU node of the cluster, the tier partition's one too (the profile names no partition)
    gpu_nodes = set(subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, check=True).stdout.split())
    assert len(gpu_nodes) == 3, gpu_nodes
    assert f"{len(gpu_nodes)} node(s) with gpu and >= 4 GPUs" in got["nodes"] and "8 QOS limits agree" in got["qos"]


@pytest.mark.parametrize("change, args, name, status, words", [
    ({}, ["--account", "m9999_g"], "account", "FAIL", "account 'm9999_g' has no association"),
    # an account that exists, but not for this user
    ({}, ["--account", "m5678_g"], "account", "FAIL", "account 'm5678_g' has no association for user root"),
    ({"qos_table": {"debug": {"max_hours": 1}}}, [], "qos", "WARN", "debug: profile 1 h, Slurm 0.5 h"),
    ({"modules": ["pythonn"]}, [], "modules", "FAIL", "`module load pythonn` failed"),
    ({"outputs": "/dev/null/runs"}, [], "outputs", "FAIL", "/dev/null is not a directory"),
    ({"constraint": "cpu"}, [], "nodes", "FAIL", "no node has features ['cpu']"),
])
def test_each_broken_profile_gets_its_own_message(login_node, change, args, name, status, words):
    r = hpcrl("doctor", *login_node(**change), *args, check=False)
    got = lines(r.stdout)
    assert got[name].startswith(status) and words in got[name] and "fix:" in got[name], r.stdout
    others = {k: v[:4] for k, v in got.items() if k not in (name, "venv")}  # venv: not built here (a warning)
    assert set(others.values()) == {"PASS"}, f"only {name} is broken: {r.stdout}"
    assert r.returncode == (1 if status == "FAIL" else 0), r.stdout


def test_in_a_job_venv_root_read_only_is_expected_and_the_venv_must_be_ready(login_node, pm_cluster, tmp_path):
    """doctor run inside a job on a compute node, where the software file system is read-only
    (scripts/slurm-cluster): venv_root passes as expected; the venv passes once built on the
    login side, and fails before (a job cannot build it) naming the command."""
    import shutil
    import uuid

    software = Path(os.environ["HPCRL_SLURM_SOFTWARE"]) / f"d{uuid.uuid4().hex[:8]}"
    args = login_node(venv_root=str(software / "venvs"))
    software.mkdir()

    def in_job():
        return subprocess.run(["srun", "-A", pm_cluster.account, "-q", "debug", "-t", "2", "-w", pm_cluster.nodes[0],
                               "-J", "doctor-in-job", sys.executable, "-m", "hpcrl.cli", "doctor", *args],
                              capture_output=True, text=True, timeout=240)

    try:
        r = in_job()
        got = lines(r.stdout)
        assert got["venv_root"].startswith("PASS") and "read-only here, in a job" in got["venv_root"], r.stdout
        assert got["venv"].startswith("FAIL") and "a job cannot build it" in got["venv"] and \
            "hpcrl venv build --trainer builtin --site pmdoc" in got["venv"], r.stdout
        assert r.returncode == 1
        hpcrl("venv", "build", "--trainer", "builtin", *args, timeout=300)  # here, the login side
        r = in_job()
        got = lines(r.stdout)
        assert r.returncode == 0 and got["venv"].startswith("PASS"), r.stdout + r.stderr
        assert got["venv_root"].startswith("PASS") and "read-only here" in got["venv_root"], r.stdout
    finally:
        shutil.rmtree(software, ignore_errors=True)

