"""Every user string that reaches the shell, fed hostile values: rendered and executed for real
on the local backend; nothing injected runs, and the job sees the values verbatim."""

import json
import os
from pathlib import Path

import pytest

from helpers import HOSTILE, hpcrl, wait_for_run


def test_hostile_values_rendered_and_executed_run_nothing(home, tmp_path, monkeypatch):
    # A hostile directory name in the run's path (the outputs dir), an env value, a site module
    # name, and a scheduler flag value.
    outputs = tmp_path / "out dir $(touch x) `y` 'q'"
    sites = Path(os.environ["HPCRL_SITES_DIR"])
    (sites / "evil.yaml").write_text(
        "extends: local\nsignal_lead_s: 2\nexit_margin_s: 1\nkill_grace_s: 2\n"
        f"outputs: {json.dumps(str(outputs))}\n"
        # a trusted site line (not user data) that records what the job really received
        "setup: ['printf %s \"$HOSTILE\" > \"$HPCRL_RUN_DIR/hostile.out\"']\n")
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps({"trainer": "smoke", "args": {"steps": 3, "step_time_s": 0.05},
                                "env": {"HOSTILE": HOSTILE}}))
    text = hpcrl("render", str(spec), "--site", "evil", "--name", "h1").stdout
    assert HOSTILE not in text  # only its quoted form is in the script
    hpcrl("submit", str(spec), "--site", "evil", "--name", "h1", "--hours", "0.01")
    state = wait_for_run("h1")
    assert state["state"] == "COMPLETED", state
    run_dir = outputs / "h1"
    assert (run_dir / "hostile.out").read_text() == HOSTILE
    assert not (run_dir / "x").exists() and not (Path.cwd() / "x").exists()


@pytest.mark.parametrize("name", ["a'; touch /tmp/PWNED-hpcrl #", "$(id)", "`id`", "a\nb", "../up", "-rf", ""])
def test_hostile_run_names_are_rejected(home, name):
    r = hpcrl("submit", "--trainer", "smoke", f"--name={name}", check=False)
    assert r.returncode == 2 and "run name" in r.stderr and "Traceback" not in r.stderr
    assert not (home / "registry").exists() or not list((home / "registry").iterdir())


def test_hostile_scheduler_flag_and_module_values_are_quoted(home, tmp_path):
    sites = Path(os.environ["HPCRL_SITES_DIR"])
    (sites / "pm.yaml").write_text(f"extends: perlmutter\naccount: m1_g\nmodules: [{json.dumps(HOSTILE.replace(chr(10), ' '))}]\n")
    r = hpcrl("render", "--site", "pm", "--trainer", "smoke", "--name", "q",
              "--set", "scheduler_flags.mail-user=$(touch /tmp/PWNED-hpcrl)", env={"SCRATCH": str(tmp_path)})
    assert "#SBATCH --mail-user='$(touch /tmp/PWNED-hpcrl)'" in r.stdout
    assert "module load 'a'\"'\"'; touch" in r.stdout
    spec = tmp_path / "s.yaml"
    spec.write_text(json.dumps({"trainer": "smoke", "scheduler_flags": {"mail-user": "a\nb"}}))
    bad = hpcrl("render", str(spec), "--site", "pm", "--name", "q", check=False, env={"SCRATCH": str(tmp_path)})
    assert bad.returncode == 2 and "single-line" in bad.stderr


def test_hostile_requirements_and_venv_root_stay_in_comments_and_quotes(home, tmp_path):
    """The resolved requirements are listed in `#` comment lines and venv_root is quoted: a carriage
    return or vertical tab cannot end a comment (only a newline can, and the spec refuses one), and
    bash -n plus a real run of the venv block finds nothing injected."""
    import subprocess

    from hpcrl.shell import comment

    assert comment("a\rb\x0bc\nd") == "a\\rb\\x0bc\\nd"
    hostile_req = HOSTILE.replace("\n", "\r\x0b")
    root = tmp_path / "v $(touch /tmp/PWNED-hpcrl) `x`"
    (Path(os.environ["HPCRL_SITES_DIR"]) / "vv.yaml").write_text(
        f"extends: local\nvenv_root: {json.dumps(str(root))}\n")
    spec = tmp_path / "hv.yaml"
    spec.write_text(json.dumps({"trainer": "smoke", "requirements": [hostile_req]}))
    text = hpcrl("render", str(spec), "--site", "vv", "--name", "hv").stdout
    req_lines = [ln for ln in text.splitlines() if "touch /tmp/PWNED-hpcrl #" in ln and "PWNED-hpcrl2" in ln]
    assert req_lines and all(ln.startswith("#   a'; touch") for ln in req_lines), req_lines
    # the venv block as the job runs it, up to the activation: it fails (no venv) and runs nothing else
    block = text[text.index("venv="):text.index('source "$venv/bin/activate"')]
    job = subprocess.run(["bash", "-c", "hpcrl_py=true; HPCRL_RUN_DIR=" + str(tmp_path) + "\n" + block],
                         capture_output=True, text=True)
    assert job.returncode == 1 and "is missing, unfinished or stale" in job.stderr, job.stderr
