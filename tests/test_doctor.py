"""`hpcrl doctor`: every check passes on a good site, and each broken profile gives its own
failure (or warning) with a fix, exit status non-zero on any failure. The Slurm checks are fed
recorded-shape answers of sinfo/sacctmgr by a TEST DOUBLE of the command helper; the TPU checks
run against the fake gcloud (a TEST DOUBLE); the shared checks (modules, Python, paths) are real.
The same checks against the real test cluster are in tests/test_slurm_doctor.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import hpcrl, use_fake_gcloud
from hpcrl import doctor
from hpcrl.backends.slurm import doctor_checks, parse_sinfo_nodes, parse_walltime
from hpcrl.proc import CommandResult
from hpcrl.spec import load_site

SINFO = "nid001|gpu,a100,hbm40g|gpu:4(S:0-1)\nnid002|gpu,a100,hbm40g|gpu:a100:4\n"
QOS = "regular|2-00:00:00\ndebug|00:30:00\npreempt|2-00:00:00\nnormal|\n"
ASSOC = "m1234_g|{user}|debug,regular\n"


def answers(sinfo=SINFO, qos=QOS, assoc=None, sacctmgr_rc=0):
    import getpass

    assoc = ASSOC.format(user=getpass.getuser()) if assoc is None else assoc

    def run(argv):
        if argv[0] == "sinfo":
            return CommandResult(argv, 0, sinfo, "")
        if "associations" in argv:
            return CommandResult(argv, sacctmgr_rc, assoc if not sacctmgr_rc else "",
                                 "sacctmgr: error: accounting storage is disabled" if sacctmgr_rc else "")
        return CommandResult(argv, 0, qos, "")
    return run


SITE = {"name": "pm", "account": "m1234_g", "constraint": "gpu", "gpus_per_node": 4, "qos": "debug",
        "qos_table": {"regular": {"max_hours": 48}, "debug": {"max_hours": 0.5}, "preempt": {"max_hours": 48}}}


def by_name(checks):
    return {c.name: c for c in checks}


def test_parsers():
    assert [parse_walltime(t) for t in ("2-00:00:00", "00:30:00", "04:00:00", "30", "", "UNLIMITED")] == \
        [48, 0.5, 4, 0.5, None, None]
    assert parse_sinfo_nodes(SINFO) == [("nid001", {"gpu", "a100", "hbm40g"}, 4), ("nid002", {"gpu", "a100", "hbm40g"}, 4)]


def test_a_good_slurm_site_passes_every_check():
    checks = by_name(doctor_checks(SITE, answers()))
    assert {n: c.status for n, c in checks.items()} == {"scheduler": "pass", "nodes": "pass", "account": "pass",
                                                        "qos": "pass"}


@pytest.mark.parametrize("change, name, status, words", [
    ({"account": "m9999_g"}, "account", "fail", "account 'm9999_g' has no association for user"),
    ({"account": None}, "account", "fail", "the site has no account"),
    ({"qos_table": {**SITE["qos_table"], "debug": {"max_hours": 1}}}, "qos", "warn", "debug: profile 1 h, Slurm 0.5 h"),
    ({"qos_table": {**SITE["qos_table"], "gold": {"max_hours": 1}}}, "qos", "warn", "gold: not in Slurm"),
    ({"qos": "gold"}, "qos", "fail", "the site's QOS 'gold' does not exist here"),
    ({"constraint": "gpu&hbm80g"}, "nodes", "fail", "no node has features ['gpu', 'hbm80g']"),
    ({"gpus_per_node": 8}, "nodes", "fail", "most GPUs on a node: 4"),
])
def test_each_broken_slurm_profile_gets_its_own_message(change, name, status, words):
    check = by_name(doctor_checks({**SITE, **change}, answers()))[name]
    assert check.status == status and words in check.detail and (check.fix or status == "pass"), check


def test_no_accounting_is_a_warning_not_a_failure():
    check = by_name(doctor_checks(SITE, answers(sacctmgr_rc=1)))["account"]
    assert check.status == "warn" and "accounting storage is disabled" in check.detail


def test_shared_checks_modules_python_and_paths(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    site = {"name": "s", "scheduler": "local", "modules": [], "python": sys.executable,
            "outputs": str(tmp_path / "out"), "venv_root": str(blocker / "venvs")}
    checks = by_name(doctor._paths(site) + doctor._modules_and_python(site, type("T", (), {"name": "t"})()))
    assert checks["outputs"].status == "pass" and "(will be created)" in checks["outputs"].detail
    assert checks["venv_root"].status == "fail" and "is not a directory" in checks["venv_root"].detail
    assert checks["python"].status == "pass"
    assert not list(tmp_path.glob("**/.hpcrl-doctor-*")), "the write test left nothing behind"
    monkeypatch.delenv("SCRATCH", raising=False)
    unset = by_name(doctor._paths({**site, "outputs": "$SCRATCH/runs"}))["outputs"]
    assert unset.status == "fail" and "$SCRATCH, which is not set here" in unset.detail
    old = type("T", (), {"name": "maxtext", "python_min": (9, 0)})()
    too_old = by_name(doctor._modules_and_python(site, old))["python"]
    assert too_old.status == "fail" and ">= 9.0" in too_old.detail
    missing = by_name(doctor._modules_and_python({**site, "modules": ["python"]}, old))["modules"]
    assert missing.status == "fail" and "module load python" in missing.detail


def test_a_read_only_outputs_directory_fails_even_for_root(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (needs root and mount permission)")
    try:
        check = by_name(doctor._paths({"name": "s", "outputs": str(ro / "runs")}))["outputs"]
        assert check.status == "fail" and "not writable (Read-only file system)" in check.detail
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)


def test_cli_local_site_passes_and_a_broken_one_exits_non_zero(home, tmp_path):
    good = hpcrl("doctor")
    assert good.returncode == 0 and "0 failed" in good.stdout and "FAIL" not in good.stdout
    (tmp_path / "f").write_text("")
    bad = hpcrl("doctor", "--set", f"site.outputs={tmp_path}/f/x", check=False)
    assert bad.returncode == 1 and "FAIL  outputs" in bad.stdout and "fix: point site.outputs" in bad.stdout


def test_the_venv_of_a_spec_file_warns_until_built_and_names_the_command(home, tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # the requirement is pip itself: nothing to fetch
    (Path(os.environ["HPCRL_SITES_DIR"]) / "dv.yaml").write_text(f"extends: local\nvenv_root: {tmp_path}/venvs\n")
    spec = tmp_path / "my spec.yaml"
    spec.write_text("trainer: smoke\nrequirements: [pip]\n")
    before = hpcrl("doctor", spec, "--site", "dv")
    line = next(ln for ln in before.stdout.splitlines() if ln.startswith("WARN  venv"))
    assert "not built" in line and line.endswith(f"fix: build it now: hpcrl venv build '{spec}' --site dv"), line
    hpcrl("venv", "build", spec, "--site", "dv", timeout=300)
    after = hpcrl("doctor", spec, "--site", "dv")
    assert "PASS  venv" in after.stdout and "ready (1 requirements of smoke)" in after.stdout, after.stdout
    # inside a job (a compute node) a missing venv is a failure: the job cannot build it
    checks = {c.name: c for c in doctor.run_checks({**load_site("dv"), "venv_root": str(tmp_path / "other")},
                                                   "smoke", {"trainer": "smoke", "args": {}, "requirements": ["pip"]},
                                                   environ={"SLURM_JOB_ID": "7"})}
    assert checks["venv"].status == "fail" and "a job cannot build it" in checks["venv"].detail


def test_tpu_site_through_the_fake_gcloud(home, tmp_path, monkeypatch):
    use_fake_gcloud(monkeypatch, tmp_path)
    (tmp_path / "gcs" / "bkt").mkdir(parents=True)
    sets = ["--site", "tpu-v5p-8", "--set", "site.project=my-proj", "--set", "site.zone=us-east5-a",
            "--set", "site.bucket=gs://bkt", "--set", f"site.outputs={tmp_path}/runs", "--trainer", "smoke"]

    def scenario(**kw):
        (tmp_path / "fake" / "scenario.json").write_text(json.dumps({"creates": [], **kw}))

    scenario()
    ok = hpcrl("doctor", *sets, check=False)
    assert "PASS  gcloud auth" in ok.stdout and "PASS  bucket" in ok.stdout and "PASS  accelerator" in ok.stdout
    scenario(accounts=[], accelerator_types={"us-east5-a": ["v6e-8"]})
    bad = hpcrl("doctor", *sets, "--set", "site.bucket=gs://nope", check=False)
    assert bad.returncode == 1
    for words in ("FAIL  gcloud auth", "gcloud auth login", "FAIL  bucket", "FAIL  accelerator",
                  "does not offer v5p-8 (it has: v6e-8)"):
        assert words in bad.stdout, bad.stdout


def test_doctor_reads_the_hpcrl_yaml_here_as_render_does(home, tmp_path):
    """#29: without a spec argument doctor checks ./hpcrl.yaml's venv (its trainer and
    requirements), as render and submit take ./hpcrl.yaml, and its fix names that file."""
    (Path(os.environ["HPCRL_SITES_DIR"]) / "dv.yaml").write_text(f"extends: local\nvenv_root: {tmp_path}/venvs\n")
    (tmp_path / "hpcrl.yaml").write_text("trainer: smoke\nrequirements: [pip]\n")
    out = hpcrl("doctor", "--site", "dv", cwd=tmp_path).stdout
    assert out.splitlines()[0] == "hpcrl doctor: site dv (local), spec hpcrl.yaml", out
    line = next(ln for ln in out.splitlines() if ln.startswith("WARN  venv"))
    assert "for smoke" in out and line.endswith("fix: build it now: hpcrl venv build hpcrl.yaml --site dv"), line
    (tmp_path / "empty").mkdir()
    alone = hpcrl("doctor", "--site", "dv", cwd=tmp_path / "empty").stdout  # no spec there: the trainer's defaults
    assert alone.splitlines()[0] == "hpcrl doctor: site dv (local), trainer builtin (its defaults; no ./hpcrl.yaml here)"


@pytest.mark.parametrize("given, executable, prefix, status, words", [
    ("/tmp/hpcrl-venv/bin/python", None, None, "fail", "/tmp/hpcrl-venv/bin/python is on /tmp"),
    (None, "/work/hpcrl/.venv/bin/python", "/tmp/venv", "fail", "/tmp/venv is on /tmp"),
    (None, "/dev/shm/v/bin/python", "/dev/shm/v", "fail", "is on /dev/shm"),
    ("/global/common/software/m1234/hpcrl/bin/python", None, None, "pass", ""),
    (None, "/global/homes/u/hpcrl/.venv/bin/python", "/global/homes/u/hpcrl/.venv", "pass", ""),
])
def test_the_hooks_interpreter_must_be_on_a_file_system_compute_nodes_mount(given, executable, prefix, status, words):
    site = {"name": "pm", "scheduler": "slurm", **({"hpcrl_python": given} if given else {})}
    (check,) = doctor.hooks_python(site, executable=executable, prefix=prefix)
    assert check.status == status and words in check.detail, check
    if status == "fail":
        assert "compute nodes do not share" in check.detail and "site.hpcrl_python" in check.fix
    assert doctor.hooks_python({"name": "l", "scheduler": "local", "hpcrl_python": "/tmp/x"}) == []
