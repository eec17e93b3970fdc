"""site.trainer_python: the user's own interpreter runs the trainer, hpcrl builds no venv; submit
checks that it exists and has the trainer's package (one-line errors), a version other than the
pinned one is a warning."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from helpers import HOSTILE, hpcrl

FIXED = {"HPCRL_HOME": "/home/user/.local/share/hpcrl", "SCRATCH": "/pscratch/sd/u/user",
         "HPCRL_SITES_DIR": "/nonexistent/sites"}
VERL_ARGS = ["--trainer", "verl", "--set", "args.model=/m", "--set", "args.train_files=/d/train.parquet",
             "--set", "args.val_files=/d/test.parquet"]


def fake_python(tmp_path: Path, dists: dict[str, str]) -> Path:
    """An interpreter whose sys.path holds dist-infos of `dists` (name -> version) and nothing else
    hpcrl might find: a wrapper around this Python with a private site directory."""
    site = tmp_path / "site"
    for name, version in dists.items():
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    site.mkdir(exist_ok=True)
    py = tmp_path / "bin" / "python"
    py.parent.mkdir()
    py.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.base_prefix}/bin/python3 -s \"$@\"\n")
    py.chmod(0o755)
    return py


def test_render_uses_it_and_builds_no_venv(tmp_path):
    py = tmp_path / "my venv" / "bin" / "python"
    text = hpcrl("render", "--site", "perlmutter", "--account", "m1_g", "--name", "t", *VERL_ARGS,
                 "--set", f"site.trainer_python={py}", env=FIXED).stdout
    assert f"trainer_py='{py}'" in text
    assert "venv=" not in text and "pip install" not in text
    assert '"$trainer_py" ' in text  # the launcher and verl both run with it (--python "$trainer_py")


def test_hostile_path_stays_one_word(tmp_path):
    text = hpcrl("render", "--site", "local", "--trainer", "smoke", "--name", "h",
                 "--set", f"site.trainer_python=/x/{HOSTILE.replace(chr(10), '')}", env=FIXED).stdout
    line = next(ln for ln in text.splitlines() if ln.startswith("trainer_py="))
    import shlex

    assert shlex.split(line[len("trainer_py="):]) == [f"/x/{HOSTILE.replace(chr(10), '')}"]


def test_requirements_with_it_are_refused(tmp_path):
    r = hpcrl("render", "--site", "local", "--trainer", "smoke", "--name", "r", "--set", "requirements=[numpy]",
              "--set", f"site.trainer_python={sys.executable}", check=False, env=FIXED)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "requirements" in r.stderr and "trainer_python" in r.stderr


def _submit(home, *args):
    return hpcrl("submit", "--site", "local", "--hours", "0.05", "--name", "tp", *args, check=False)


def test_submit_missing_interpreter_is_one_line(home, tmp_path):
    r = _submit(home, "--trainer", "smoke", "--set", f"site.trainer_python={tmp_path}/nope/python")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "trainer_python" in r.stderr and "no such file" in r.stderr
    assert not (home / "runs").exists() or not any((home / "runs").iterdir())


def test_submit_interpreter_without_verl_is_one_line(home, tmp_path):
    py = fake_python(tmp_path, {})
    r = _submit(home, *VERL_ARGS, "--set", f"site.trainer_python={py}")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "has no 'verl' installed" in r.stderr and "verl==0.9.1" in r.stderr


def test_other_verl_version_is_a_warning(home, tmp_path):
    from hpcrl import spec
    from hpcrl import control

    py = fake_python(tmp_path, {"verl": "0.8.0"})
    resolved = spec.resolve(None, "local", ["trainer=verl", "args.model=/m", "args.train_files=/d/t.parquet",
                                           "args.val_files=/d/v.parquet", f"site.trainer_python={py}"])
    warnings = []
    control.check_trainer_python(resolved, warn=warnings.append)
    assert len(warnings) == 1 and "verl 0.8.0" in warnings[0] and "0.9.1" in warnings[0]
    ok = fake_python(tmp_path / "ok", {"verl": "0.9.1"})
    resolved["site"]["trainer_python"] = str(ok)
    control.check_trainer_python(resolved, warn=warnings.append)
    assert len(warnings) == 1


def test_smoke_run_completes_with_it(home, tmp_path):
    # the whole chain with the interpreter named by path: the job runs the trainer with it
    from helpers import wait_for_run

    link = tmp_path / "bin" / "python"
    link.parent.mkdir()
    os.symlink(sys.executable, link)
    r = _submit(home, "--trainer", "smoke", "--set", "args.steps=3", "--set", "args.step_time_s=0.01",
                "--set", f"site.trainer_python={link}")
    assert r.returncode == 0, r.stderr
    state = wait_for_run("tp", timeout=120)
    assert state["state"] == "COMPLETED"
    from hpcrl.runs import Run

    assert f"trainer_py={link}" in Run.by_id("tp").layout.script.read_text()


@pytest.mark.parametrize("value", ["", "[a, b]"])
def test_bad_values_are_one_line(value):
    r = hpcrl("render", "--site", "local", "--trainer", "smoke", "--set", f"site.trainer_python={value}",
              check=False, env=FIXED)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
