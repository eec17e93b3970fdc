"""`hpcrl doctor` on the Perlmutter-shaped test cluster (real sinfo, sacctmgr, Lmod): a good user
site passes every check; deliberately broken profiles each fail (or warn) with their own message,
and the exit status is non-zero on any failure."""

from __future__ import annotations

import os
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

    def site(**changes):
        data = {"extends": "perlmutter", "venv_root": str(tmp_path / "venvs"), **changes}
        (Path(os.environ["HPCRL_SITES_DIR"]) / "pmdoc.yaml").write_text(yaml.safe_dump(data))
        return ["--site", "pmdoc", "--account", os.environ.get("HPCRL_SLURM_ACCOUNT", "m1234_g")]

    return site


def lines(out: str) -> dict:
    return {ln.split()[1]: ln for ln in out.splitlines() if ln[:4] in ("PASS", "WARN", "FAIL")}


def test_a_good_perlmutter_site_passes_every_check(login_node):
    r = hpcrl("doctor", *login_node(), check=False)
    assert r.returncode == 0, r.stdout
    got = lines(r.stdout)
    assert set(got) >= {"scheduler", "nodes", "account", "qos", "outputs", "venv_root", "modules", "python"}, r.stdout
    assert all(v.startswith("PASS") for v in got.values()), r.stdout
    assert "2 node(s) with gpu and >= 4 GPUs" in got["nodes"] and "8 QOS limits agree" in got["qos"]


@pytest.mark.parametrize("change, args, name, status, words", [
    ({}, ["--account", "m9999_g"], "account", "FAIL", "account 'm9999_g' has no association"),
    ({"qos_table": {"debug": {"max_hours": 1}}}, [], "qos", "WARN", "debug: profile 1 h, Slurm 0.5 h"),
    ({"modules": ["pythonn"]}, [], "modules", "FAIL", "`module load pythonn` failed"),
    ({"outputs": "/dev/null/runs"}, [], "outputs", "FAIL", "/dev/null is not a directory"),
    ({"constraint": "cpu"}, [], "nodes", "FAIL", "no node has features ['cpu']"),
])
def test_each_broken_profile_gets_its_own_message(login_node, change, args, name, status, words):
    r = hpcrl("doctor", *login_node(**change), *args, check=False)
    got = lines(r.stdout)
    assert got[name].startswith(status) and words in got[name] and "fix:" in got[name], r.stdout
    others = {k: v[:4] for k, v in got.items() if k != name}
    assert set(others.values()) == {"PASS"}, f"only {name} is broken: {r.stdout}"
    assert r.returncode == (1 if status == "FAIL" else 0), r.stdout
