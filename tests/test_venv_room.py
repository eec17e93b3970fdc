"""Where venvs fit, and what they leave (issue 39 items 3 and 4).

- The quota parser on NERSC's recorded `cmnquota` output (tests/data/nersc/README.md says where it
  comes from), and the measured GPU venv against Global Common's default quota.
- `submit` / `hpcrl venv build` refuse a venv that the project's quota has no room for, in one
  line, before anything is written or queued: the real CLI, with a test double `cmnquota` on PATH
  that prints the recorded table; with no such command (not at NERSC) nothing is checked or said.
- `hpcrl venv prune`: real runs (a COMPLETED one, a CANCELLED one that could be resumed) and the
  real venvs their submits built, a failed build's leftovers and things that are not hpcrl's.
- The login-node build's pip caches go where the site's job_env puts them, not $HOME: the real
  pip of the build says which cache directory it uses.
Venvs are real (`python -m venv` + pip, offline: the requirement is pip itself, as in test_venv.py).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, hpcrl, wait_for_run

DATA = ROOT / "tests" / "data" / "nersc"
OFFLINE = {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


# ------------------------------------------------------------------ the parser, the numbers

def test_recorded_cmnquota_output_parses_to_the_projects_row():
    from hpcrl import quota

    text = (DATA / "cmnquota_m3857.txt").read_text()
    u = quota.parse(text, "m3857", "cmnquota m3857")
    assert (u.used_bytes, u.quota_bytes, u.used_inodes, u.quota_inodes) == (0, 10e9, 1, 1_000_000)
    assert (u.left_bytes, u.left_inodes) == (10e9, 999_999)
    assert quota.parse(text, "m9999") is None, "another project's row is not this one"
    assert quota.parse("Disk quotas for user x (uid 1):\n/home 23 100", "m3857") is None, "not the table"
    full = quota.parse((DATA / "cmnquota_full.txt").read_text(), "m1234")
    assert (full.left_bytes, full.left_inodes) == pytest.approx((0.1e9, 1_000))


def test_the_measured_gpu_venv_does_not_fit_global_commons_default_quota():
    """scripts/bench_venv_size.py: gsm8k-grpo's GPU set, 4.31 GB of wheels, installs as 10.2 GB and
    ~105k inodes: more than an empty project's 10 GB (the recorded table), within its inodes."""
    from hpcrl import quota

    empty = quota.parse((DATA / "cmnquota_m3857.txt").read_text(), "m3857", "cmnquota m3857")
    need_bytes = quota.EMPTY_VENV_BYTES + 4.31e9 * quota.INSTALLED_PER_WHEEL
    need_inodes = quota.EMPTY_VENV_INODES + int(4.31 * quota.INODES_PER_WHEEL_GB)
    assert 10.0e9 < need_bytes < 10.6e9 and 100_000 < need_inodes < 110_000
    assert quota.shortfall(empty, need_bytes, need_inodes) == "10.0 GB left of 10 GB, the venv needs ~10.2 GB"
    assert quota.shortfall(empty, need_bytes / 2, need_inodes) is None


def test_perlmutters_default_venv_root_has_room_and_a_quota_command():
    """The default moved to CFS (Global Common's 10 GB cannot hold one GPU venv), and each of the
    two file systems has the command that reports its project quota."""
    from hpcrl import quota
    from hpcrl.spec import load_site

    site = {**load_site("perlmutter"), "account": "m1234_g"}
    assert site["venv_root"] == "/global/cfs/cdirs/{project}/hpcrl/venvs"
    assert quota.command_for(site, "/global/cfs/cdirs/m1234/hpcrl/venvs") == ["cfsquota", "m1234"]
    assert quota.command_for(site, "/global/common/software/m1234/hpcrl/venvs") == ["cmnquota", "m1234"]
    assert quota.command_for(site, "/pscratch/sd/u/user/venvs") is None


# ------------------------------------------------------------------ the refusal, on the real path

def _fake_quota(tmp_path: Path, name: str, output: str | None) -> Path:
    """A directory holding a test double `name` that prints `output` (None: prints nothing useful)."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / name
    body = f"cat {output}\n" if output else "echo 'quota service unavailable, try later'\n"
    script.write_text(f"#!/bin/sh\n# test double of NERSC's {name}: prints a recorded table\n{body}")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return bin_dir


@pytest.fixture
def room_site(fast_local, tmp_path, monkeypatch):
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    root = tmp_path / "proj" / "hpcrl" / "venvs"
    (Path(os.environ["HPCRL_SITES_DIR"]) / "roomlocal.yaml").write_text(yaml.safe_dump({
        "extends": fast_local, "account": "m1234_g", "venv_root": str(root),
        "venv_quota": [{"under": str(tmp_path / "proj"), "command": "cmnquota {project}"}]}))
    return root


def _path_with(bin_dir: Path | None) -> dict:
    """PATH with the test doubles first (if any), then this Python's bin (the build's python3)."""
    return {"PATH": os.pathsep.join(([str(bin_dir)] if bin_dir else []) + [str(Path(sys.executable).parent),
                                                                            os.environ["PATH"]])}


def _submit(name, env, check=True):
    return hpcrl("submit", "--site", "roomlocal", "--trainer", "smoke", "--hours", "0.01", "--name", name,
                 "--max-segments", "1", "--set", "args.steps=2", "--set", "args.step_time_s=0.05",
                 "--set", "requirements=[pip]", env=env, check=check, timeout=300)


def test_a_venv_with_no_room_is_refused_in_one_line_before_anything_is_written(room_site, home, tmp_path):
    env = _path_with(_fake_quota(tmp_path, "cmnquota", DATA / "cmnquota_full.txt"))
    r = _submit("full", env, check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    line = r.stderr.strip()
    assert line.startswith(f"hpcrl: error: no room for venv {room_site}/"), line
    assert "in project m1234's quota (cmnquota m1234): 1,000 inodes left of 1,000,000, the venv needs ~1,660" in line
    assert "hpcrl venv prune" in line and "--set site.venv_root=DIR" in line, line
    assert not room_site.exists(), "nothing written: no venv_root, lock or log"
    assert not (home / "runs" / "full").exists() and "full" not in hpcrl("status").stdout
    # `hpcrl venv build` takes the same path
    r = hpcrl("venv", "build", "--site", "roomlocal", "--trainer", "smoke", "--set", "requirements=[pip]",
              env=env, check=False)
    assert r.returncode == 2 and r.stderr.startswith("hpcrl: error: no room for venv "), r.stderr
    assert not room_site.exists()


def test_the_gpu_recipes_venv_is_refused_by_an_empty_projects_recorded_quota(home, tmp_path):
    """The recorded table verbatim (m3857: nothing used of 10 GB) against gsm8k-grpo's real GPU set on
    the perlmutter profile, venv_root on a Global Common stand-in: refused before any file exists."""
    common = tmp_path / "common"
    env = {**_path_with(_fake_quota(tmp_path, "cmnquota", DATA / "cmnquota_m3857.txt")),
           "SCRATCH": str(tmp_path / "scratch")}
    r = hpcrl("venv", "build", ROOT / "hpcrl" / "recipes" / "gsm8k-grpo.yaml", "--site", "perlmutter",
              "--account", "m3857_g", "--set", f"site.venv_root={common}/m3857/hpcrl/venvs",
              "--set", f"site.venv_quota=[{{under: {common}, command: 'cmnquota {{project}}'}}]",
              "--no-check-artifacts", env=env, check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "in project m3857's quota (cmnquota m3857): 10.0 GB left of 10 GB, the venv needs ~10." in r.stderr, r.stderr
    assert not common.exists() and not (tmp_path / "scratch").exists()


def test_with_room_or_without_the_command_the_venv_is_built(room_site, tmp_path):
    """A quota command that does not say what is left (here: the recorded table has no row for
    this project; then a command that prints something else) warns in one line and builds; no
    command on PATH is silence."""
    r = _submit("room", _path_with(_fake_quota(tmp_path, "cmnquota", DATA / "cmnquota_m3857.txt")), check=False)
    assert r.returncode == 0 and "warning: `cmnquota m1234`: no row for project m1234; the venv's room" \
        in r.stderr, r.stderr
    assert f"venv {room_site}/" in r.stderr and " ready" in r.stderr
    wait_for_run("room", timeout=120)
    r = hpcrl("venv", "build", "--site", "roomlocal", "--trainer", "smoke", "--set", "requirements=[pip>=1]",
              env=_path_with(_fake_quota(tmp_path, "cmnquota", None)), timeout=300)
    assert "warning: `cmnquota m1234`: output hpcrl does not recognise; the venv's room" in r.stderr, r.stderr
    (tmp_path / "fakebin" / "cmnquota").unlink()
    r = hpcrl("venv", "build", "--site", "roomlocal", "--trainer", "smoke", "--set", "requirements=[setuptools]",
              env=_path_with(None), timeout=300)
    assert "warning" not in r.stderr and "venv" in r.stdout and " built " in r.stdout, (r.stdout, r.stderr)


def test_a_project_with_room_is_built_without_a_word(fast_local, tmp_path, monkeypatch):
    """The recorded table itself, for its own project (m3857: 10 GB and 999,999 inodes left)."""
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    root = tmp_path / "cmn" / "venvs"
    (Path(os.environ["HPCRL_SITES_DIR"]) / "m3857.yaml").write_text(yaml.safe_dump({
        "extends": fast_local, "account": "m3857", "venv_root": str(root),
        "venv_quota": [{"under": str(tmp_path / "cmn"), "command": "cmnquota {project}"}]}))
    env = _path_with(_fake_quota(tmp_path, "cmnquota", DATA / "cmnquota_m3857.txt"))
    r = hpcrl("venv", "build", "--site", "m3857", "--trainer", "smoke", "--set", "requirements=[pip]", env=env,
              timeout=300)
    assert "warning" not in r.stderr and "error" not in r.stderr, r.stderr
    assert len([p for p in root.iterdir() if (p / ".hpcrl-ready").is_file()]) == 1


# ------------------------------------------------------------------ caches off $HOME at build time

def test_the_login_node_build_caches_where_the_sites_job_env_says(fast_local, tmp_path, monkeypatch):
    """The build's own pip (`pip cache dir`, run by a set-up line of the build script, in the build's
    environment) uses the site's PIP_CACHE_DIR, expanded here; PIP_NO_CACHE_DIR turns it off."""
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HPCRL_TEST_SCRATCH", str(tmp_path / "scratch"))
    seen = tmp_path / "pip-cache-dir.txt"
    site = {"extends": fast_local, "venv_root": str(tmp_path / "venvs"),
            "setup": [f"python3 -m pip cache dir > {seen} 2>&1 || true"],
            "job_env": {"PIP_CACHE_DIR": "$HPCRL_TEST_SCRATCH/hpcrl/cache/pip"}}
    (Path(os.environ["HPCRL_SITES_DIR"]) / "cachelocal.yaml").write_text(yaml.safe_dump(site))
    hpcrl("venv", "build", "--site", "cachelocal", "--trainer", "smoke", "--set", "requirements=[pip]", timeout=300)
    assert seen.read_text().strip() == str(tmp_path / "scratch" / "hpcrl" / "cache" / "pip")
    log = next((tmp_path / "venvs").glob("*.log")).read_text()
    assert f"# PIP_CACHE_DIR={tmp_path / 'scratch' / 'hpcrl' / 'cache' / 'pip'}\n" in log, log
    # a site that says no cache: pip's own switch, passed through
    site["job_env"] = {"PIP_NO_CACHE_DIR": "1"}
    (Path(os.environ["HPCRL_SITES_DIR"]) / "cachelocal.yaml").write_text(yaml.safe_dump(site))
    hpcrl("venv", "build", "--site", "cachelocal", "--trainer", "smoke", "--set", "requirements=[setuptools]",
          timeout=300)
    assert "cache is disabled" in seen.read_text(), seen.read_text()


# ------------------------------------------------------------------ prune

def test_prune_lists_then_removes_only_what_no_run_could_use(fast_local, home, tmp_path, monkeypatch):
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    root = tmp_path / "venvs"
    (Path(os.environ["HPCRL_SITES_DIR"]) / "prunelocal.yaml").write_text(
        yaml.safe_dump({"extends": fast_local, "venv_root": str(root)}))

    def submit(name, req, check=True, more=()):
        return hpcrl("submit", "--site", "prunelocal", "--trainer", "smoke", "--hours", "0.01", "--name", name,
                     "--set", "args.steps=2", "--set", "args.step_time_s=0.05", "--set", f"requirements=[{req}]",
                     *more, check=check, timeout=300)

    def venvs() -> set[str]:
        return {p.name for p in root.iterdir() if p.is_dir()}

    submit("done", "pip", more=("--max-segments", "1"))
    assert wait_for_run("done", timeout=120)["state"] == "COMPLETED"
    done_venv = venvs()
    submit("later", "setuptools", more=("--set", "args.steps=400", "--set", "args.step_time_s=0.5"))
    hpcrl("cancel", "later")
    later_venv = venvs() - done_venv
    assert len(done_venv) == len(later_venv) == 1
    assert submit("broken", "hpcrl-no-such-package==1.0", check=False).returncode == 2
    failed = {p.name.split(".")[0] for p in root.iterdir() if p.suffix == ".log"} - done_venv - later_venv
    assert len(failed) == 1
    # what is not hpcrl's: never touched
    (root / "notes").mkdir()
    (root / "0123456789ab").mkdir()            # a hash-named directory without marker or log
    (root / "README.txt").write_text("mine")
    before = sorted(p.name for p in root.iterdir())

    out = hpcrl("venv", "prune", "--site", "prunelocal").stdout
    lines = out.splitlines()
    assert lines[0] == f"venv_root {root}: 3 venvs of hpcrl, 1 in use", out
    (done,) = [ln for ln in lines if next(iter(done_venv)) in ln]
    assert done.strip().startswith(f"unused    {root / next(iter(done_venv))}  (ready; ") and " inodes)" in done
    (broken,) = [ln for ln in lines if next(iter(failed)) in ln]
    assert broken.strip().startswith("unused") and "(failed build; " in broken
    (kept,) = [ln for ln in lines if next(iter(later_venv)) in ln]
    assert kept.strip().startswith("in use") and "runs later (CANCELLED)" in kept, kept
    assert lines[-1].startswith("would free ") and "nothing removed: hpcrl venv prune --yes" in lines[-1]
    assert sorted(p.name for p in root.iterdir()) == before, "a listing removes nothing"

    out = hpcrl("venv", "prune", "--site", "prunelocal", "--yes").stdout
    assert out.splitlines()[-1].startswith("removed 2; freed "), out
    left = sorted(p.name for p in root.iterdir())
    assert left == sorted(["notes", "0123456789ab", "README.txt", *later_venv,
                           *(f"{v}{s}" for v in later_venv for s in (".log", ".lock"))]), left
    # the cancelled run resumes in its venv, still there and ready
    assert (root / next(iter(later_venv)) / ".hpcrl-ready").is_file()
    assert "nothing to remove" in hpcrl("venv", "prune", "--site", "prunelocal", "--yes").stdout
    # a build in progress (its lock held, as venv.ensure holds it) is never a candidate
    import fcntl

    (root / "abcdefabcdef.log").write_text("# hpcrl venv build of ...\n")
    with open(root / "abcdefabcdef.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        out = hpcrl("venv", "prune", "--site", "prunelocal", "--yes").stdout
        assert "abcdefabcdef" not in out and (root / "abcdefabcdef.log").exists(), out
    out = hpcrl("venv", "prune", "--site", "prunelocal", "--yes").stdout
    assert "removing  " in out and "abcdefabcdef  (failed build; " in out, out
    assert not (root / "abcdefabcdef.log").exists() and not (root / "abcdefabcdef.lock").exists()


def test_doctor_reads_the_same_quota_and_says_whether_the_venv_fits(tmp_path, monkeypatch):
    """doctor weighs the spec's venv (not built) against the quota command's answer, as submit does."""
    from hpcrl.doctor import _venv_quota
    from hpcrl.spec import site_as_given

    site = {**site_as_given("local"), "account": "m1234_g", "venv_root": str(tmp_path / "proj" / "venvs"),
            "venv_quota": [{"under": str(tmp_path / "proj"), "command": "cmnquota {project}"}]}
    spec = {"trainer": "smoke", "args": {}, "requirements": ["pip"]}
    monkeypatch.setenv("PATH", _path_with(_fake_quota(tmp_path, "cmnquota", DATA / "cmnquota_full.txt"))["PATH"])
    [c] = _venv_quota(site, spec)
    assert c.status == "fail" and c.detail.startswith("project m1234 (cmnquota m1234): 0.1 GB and 1,000 inodes left"), c
    assert "does not fit" in c.detail and "hpcrl venv prune" in c.fix
    _fake_quota(tmp_path, "cmnquota", DATA / "cmnquota_m3857.txt")  # the recorded table: an empty project
    [c] = _venv_quota({**site, "account": "m3857"}, spec)
    assert c.status == "pass" and "10.0 GB and 999,999 inodes left" in c.detail, c
