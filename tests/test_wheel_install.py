"""The user's path: hpcrl as a wheel, installed (not editable) into a clean venv outside the
checkout, run from another directory with nothing of the checkout on sys.path or PATH.

The rest of the suite runs hpcrl from an editable install, whose finder serves any module of the
checkout whatever the wheel holds: a hand-written package list once dropped hpcrl.checkpoints,
hpcrl.job and hpcrl.status from the wheel, and every test still passed while the first `hpcrl
render` of a real install ended in ModuleNotFoundError (issue 39). Here: the wheel holds every
module and data file of the checkout; `hpcrl --version`; every built-in site renders; a local
smoke run goes through two segments to COMPLETED; and the job-side launchers import from that
run's lib/ snapshot alone (what a verl or MaxText job runs).

The wheel is built with the suite's own setuptools (no build isolation: no index needed to build);
its dependencies (PyYAML, Jinja2, rich) come from the package index as a user's would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from helpers import ROOT, read_metrics, started, wait_until

pytestmark = pytest.mark.slow  # ~25 s on a quiet machine: a venv, an install, a two-segment run

END_STATES = ("COMPLETED", "FAILED", "CANCELLED", "STOPPED")
# A local site whose walltime margins make a 0.003 h (10.8 s) segment work (as tests/conftest.py
# fast_local): USR1 4 s before the end, so a segment trains at most ~7 s.
FAST_LOCAL = "extends: local\nsignal_lead_s: 4\nexit_margin_s: 1.5\nkill_grace_s: 3\n"
# What each built-in site renders: a recipe that suits it (its trainer's adapter reads its own
# shipped files: MaxText's pinned lists, verl's reward modules), or None for the smoke trainer,
# and the flags it needs (made-up account and project). A site added to site_configs/ without
# an entry renders the smoke trainer with no flags.
TPU_SETS = ["--set", "site.project=my-proj", "--set", "site.zone=us-east5-a", "--set", "site.bucket=gs://bkt"]
RENDERS = {
    "local": (None, []),
    "slurm": (None, []),
    "testcluster": ("countdown-tiny", []),
    "perlmutter": ("verl-gsm8k-grpo", ["--account", "m1234_g"]),
    "tpu-v5p-8": ("maxtext-llama3.1-8b-grpo", ["--hours", "4", *TPU_SETS]),
    "tpu-v6e-8": ("maxtext-llama3.1-8b-gspo", ["--hours", "4", *TPU_SETS]),
}


def _run(argv, env, cwd, timeout=600, check=True):
    proc = subprocess.run([str(a) for a in argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))} -> {proc.returncode}\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc


def _clean_env() -> dict:
    """This environment as a user's shell would have it: none of the suite's PYTHON* variables
    (PYTHONPATH above all), no hpcrl settings, no venv active, and nothing of the checkout on PATH
    (the suite's .venv/bin may be there)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HPCRL_")) and k != "VIRTUAL_ENV"}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and not _inside(Path(p), ROOT)]
    env["PATH"] = os.pathsep.join(path)
    return env


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root)
        return True
    except (ValueError, OSError):
        return False


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    base = tmp_path_factory.mktemp("wheel")
    assert not _inside(base, ROOT), f"the test needs a temporary directory outside the checkout, not {base}"
    # Built from a copy: an in-tree build writes build/ and hpcrl.egg-info into the checkout, which
    # other processes share (and which may be read-only). Top-level files (pyproject.toml and what
    # it names, README.md) and the three folders the wheel is made of; symlinks stay links
    # (hpcrl/_templates -> ../templates: pyproject.toml says why).
    src = base / "src"
    src.mkdir()
    for item in ROOT.iterdir():
        if item.is_file() and not item.name.startswith("."):
            shutil.copy2(item, src / item.name)
    for name in ("hpcrl", "templates", "site_configs"):
        shutil.copytree(ROOT / name, src / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    dist = base / "dist"
    # --check-build-dependencies: a suite venv whose setuptools is older than pyproject's
    # build-system asks for fails here, by name, not somewhere inside the build
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--check-build-dependencies",
          "--quiet", "-w", dist, src], env=_clean_env(), cwd=base)
    (wheel,) = dist.glob("hpcrl-*.whl")
    venv = base / "venv"
    # the suite's python is itself a venv's: `-m venv` makes the new one on the base interpreter
    _run([sys.executable, "-m", "venv", venv], env=_clean_env(), cwd=base)
    # not activated (venv/bin not on PATH): the console script's absolute path must be enough,
    # as in a batch script or a crontab; an activated shell only adds to that
    env = _clean_env()
    py = venv / "bin" / "python"
    _run([py, "-m", "pip", "install", "--quiet", wheel], env=env, cwd=base)
    purelib = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env, base)
                   .stdout.strip())
    return types.SimpleNamespace(base=base, wheel=wheel, venv=venv, py=py, hpcrl=venv / "bin" / "hpcrl",
                                 purelib=purelib, env=env)


def checkout_version() -> str:
    """hpcrl.__version__ as this checkout's source writes it (read, not imported: the suite's
    editable install may be another checkout's)."""
    import ast

    tree = ast.parse((ROOT / "hpcrl" / "__init__.py").read_text(encoding="utf-8"))
    return next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "__version__" for t in node.targets))


def _user(installed, tmp_path) -> tuple[dict, Path]:
    """The installed venv's environment with an hpcrl home and user sites of this test's own,
    and a working directory outside the checkout."""
    env = dict(installed.env)
    env["HPCRL_HOME"], env["HPCRL_SITES_DIR"] = str(tmp_path / "home"), str(tmp_path / "sites")
    env["SCRATCH"] = str(tmp_path / "scratch")  # perlmutter's outputs and venv_root sit under $SCRATCH
    (tmp_path / "sites").mkdir()
    work = tmp_path / "work"
    work.mkdir()
    return env, work


def _checkout_files() -> dict[str, str]:
    """Where each file the code ships must be in an install: every module and data file under
    hpcrl/ (docs, *.md, aside), templates/ as hpcrl/_templates, site_configs/ as
    hpcrl/_site_configs."""
    want = {}
    for top, dest in (("hpcrl", "hpcrl"), ("templates", "hpcrl/_templates"), ("site_configs", "hpcrl/_site_configs")):
        root = ROOT / top
        for dirpath, dirnames, filenames in os.walk(root):  # links not followed: the two data links are mapped above
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.startswith(".")]
            for name in filenames:
                path = Path(dirpath) / name
                if name.startswith(".") or path.suffix in (".pyc", ".md"):
                    continue
                rel = path.relative_to(root).as_posix()
                want[f"{top}/{rel}"] = f"{dest}/{rel}"
    return want


def test_the_installed_wheel_holds_every_module_and_data_file_of_the_checkout(installed, tmp_path):
    (record,) = installed.purelib.glob("hpcrl-*.dist-info/RECORD")
    shipped = {line.split(",", 1)[0] for line in record.read_text(encoding="utf-8").splitlines()}
    want = _checkout_files()
    assert "hpcrl/job/verl.py" in want and "templates/segment.sh.j2" in want  # the walk found the tree
    missing = sorted(src for src, dest in want.items() if dest not in shipped)
    modules = [m for m in missing if m.endswith(".py")]
    assert not modules, f"modules of the checkout missing from the wheel (a package not discovered?): {modules}"
    assert not missing, f"data files of the checkout missing from the wheel (pyproject package-data): {missing}"
    # a real install: no editable finder or .pth that reaches back into the checkout
    for pth in installed.purelib.glob("*.pth"):
        assert str(ROOT) not in pth.read_text(encoding="utf-8", errors="replace"), pth
    assert not list(installed.purelib.glob("__editable__*hpcrl*"))
    env, work = _user(installed, tmp_path)
    where = _run([installed.py, "-c", "import hpcrl, hpcrl.paths as p; print(hpcrl.__file__); "
                  "print(p.templates_dir()); print(p.site_configs_dir())"], env, work).stdout.split()
    assert all(_inside(Path(w), installed.purelib) for w in where), where


def test_version_and_every_built_in_site_renders_from_the_installed_wheel(installed, tmp_path):
    env, work = _user(installed, tmp_path)
    meta = _run([installed.py, "-c", "from importlib import metadata; print(metadata.version('hpcrl'))"], env, work)
    version = meta.stdout.strip()
    assert installed.wheel.name.startswith(f"hpcrl-{version}-")
    assert version == checkout_version(), "pyproject builds the version from hpcrl.__version__"
    assert _run([installed.hpcrl, "--version"], env, work).stdout == f"hpcrl {version}\n"
    sites = sorted(p.stem for p in (ROOT / "site_configs").glob("*.yaml"))
    assert {"local", "perlmutter", "tpu-v5p-8"} <= set(sites)
    for site in sites:
        recipe, flags = RENDERS.get(site, (None, []))
        if recipe is None:
            what = ["--trainer", "smoke"]
        else:  # the recipe's spec, as the installed `hpcrl init` writes it
            what = [work / f"{recipe}.yaml"]
            if not what[0].exists():
                _run([installed.hpcrl, "init", "--recipe", recipe, "--out", what[0]], env, work)
        r = _run([installed.hpcrl, "render", *what, *flags, "--site", site, "--name", f"w-{site}"], env, work, check=False)
        assert r.returncode == 0, f"hpcrl render --site {site}: {r.stderr[-2000:]}"
        assert r.stdout.startswith("#!/bin/bash\n"), (site, r.stdout[:200])
        assert f"w-{site}" in r.stdout


def test_a_local_smoke_run_goes_two_segments_and_its_lib_snapshot_imports_the_job_launchers(installed, tmp_path):
    env, work = _user(installed, tmp_path)
    (tmp_path / "sites" / "fastlocal.yaml").write_text(FAST_LOCAL, encoding="utf-8")
    # 40 steps of 0.2 s: more than a segment's ~7 s of training, so at least two segments
    out = _run([installed.hpcrl, "submit", "--site", "fastlocal", "--trainer", "smoke", "--hours", "0.003",
                "--name", "wheel", "--set", "args.steps=40", "--set", "args.step_time_s=0.2",
                "--set", "args.save_every=1000"], env, work).stdout
    rdir = Path(next(ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.strip().startswith("run dir:")))
    assert _inside(rdir, tmp_path / "home"), rdir

    def settled():
        state = json.loads((rdir / "state.json").read_text(encoding="utf-8"))
        if state["state"] not in END_STATES or any(s["state"] in ("RUNNING", "QUEUED") for s in state["segments"]):
            return None
        jobs = [json.loads(p.read_text(encoding="utf-8")) for p in (rdir / ".queue").glob("*.json")]
        return None if any(j.get("state") in ("PENDING", "RUNNING") for j in jobs) else state

    def seen():
        state = json.loads((rdir / "state.json").read_text(encoding="utf-8"))
        return f"{state['state']}: {[(s.get('job_id'), s['state']) for s in state['segments']]}"

    state = wait_until(settled, 300, "the run to end with no job left", poll=0.5, describe=seen)
    logs = "\n".join(p.read_text(errors="replace")[-1500:] for p in sorted((rdir / "logs").glob("job-*.log")))
    assert state["state"] == "COMPLETED", f"{state['reason']}\n{logs}"
    ran = started(state)
    assert len(ran) >= 2, ran
    assert all(s["state"] == "CONTINUE" and s["rc"] == 85 for s in ran[:-1]) and ran[-1]["state"] == "COMPLETE", ran
    assert [m["step"] for m in read_metrics(rdir)] == list(range(1, 41)), "every step once, across the segments"
    assert state["hpcrl_version"] == _run([installed.hpcrl, "--version"], env, work).stdout.split()[1]
    status = _run([installed.hpcrl, "status", "wheel"], env, work).stdout
    assert "COMPLETED" in status

    # The job-side launchers as a job runs them: from the run's lib/ snapshot alone. -I: no
    # PYTHONPATH, no user site, no script directory; -S: not even the venv's site-packages,
    # where the installed hpcrl would otherwise answer for anything the snapshot lacks.
    lib = rdir / "lib"
    modules = sorted({f"hpcrl.job.{p.stem}" for p in (lib / "hpcrl" / "job").glob("*.py") if p.stem != "__init__"}
                     | {"hpcrl.protocol"})
    assert {"hpcrl.job.supervisor", "hpcrl.job.verl", "hpcrl.job.maxtext"} <= set(modules), modules
    probe = ("import importlib, sys\nsys.path.insert(0, sys.argv[1])\n"
             "for name in sys.argv[2:]:\n    print(importlib.import_module(name).__file__)\n")
    files = _run([installed.py, "-I", "-S", "-c", probe, lib, *modules], env, work).stdout.split()
    assert len(files) == len(modules) and all(_inside(Path(f), lib) for f in files), files
