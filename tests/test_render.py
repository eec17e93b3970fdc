"""Rendering: golden scripts (HPCRL_UPDATE_GOLDENS=1 rewrites them), bash -n, the QOS table."""

import difflib
import os
import subprocess
from pathlib import Path

import pytest

from helpers import hpcrl

GOLDEN = Path(__file__).parent / "golden"
# Fixed paths so that the goldens do not depend on the machine or the test's tmp dir.
FIXED = {"HPCRL_HOME": "/home/user/.local/share/hpcrl", "SCRATCH": "/pscratch/sd/u/user",
         "HPCRL_SITES_DIR": "/nonexistent/sites"}
PY = "--set=site.hpcrl_python=/opt/hpcrl/bin/python"


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("HPCRL_UPDATE_GOLDENS") == "1" or not path.exists():
        path.write_text(text)
        if os.environ.get("HPCRL_UPDATE_GOLDENS") != "1":
            pytest.fail(f"golden {name} did not exist; wrote it — review and commit it")
    want = path.read_text()
    if text != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), "golden", "rendered"))
        pytest.fail(f"{name} differs from its golden; if intended, rerun with HPCRL_UPDATE_GOLDENS=1\n{diff}")


def bash_n(text: str) -> None:
    proc = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def render(*args) -> str:
    return hpcrl("render", *args, PY, env=FIXED).stdout


def test_perlmutter_regular_4h_golden():
    text = render("--site", "perlmutter", "--account", "m1234_g", "--hours", "4", "--total-hours", "10",
                  "--trainer", "smoke", "--name", "smoke-pm")
    bash_n(text)
    for line in ("#SBATCH --account=m1234_g", "#SBATCH --qos=regular", "#SBATCH --constraint=gpu",
                 "#SBATCH --time=240", "#SBATCH --signal=B:USR1@300", "#SBATCH --open-mode=append",
                 "#SBATCH --job-name=smoke-pm", "#SBATCH --gpus-per-node=4", "#SBATCH --dependency=singleton",
                 "module load python"):
        assert line in text
    sbatch = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert sbatch == sorted(sbatch)
    check_golden("perlmutter-smoke-4h.sh", text)


def test_local_golden():
    text = render("--site", "local", "--trainer", "smoke", "--hours", "0.05", "--name", "smoke-local")
    bash_n(text)
    assert "#HPCRL-LOCAL walltime_s=180" in text
    check_golden("local-smoke.sh", text)


def test_hours_min_maps_to_time_min_and_venv_is_hashed():
    text = render("--site", "perlmutter", "--account", "m1234_g", "--hours", "4", "--hours-min", "2",
                  "--trainer", "smoke", "--name", "v", "--set", "requirements=[numpy==2.1.0]")
    assert "#SBATCH --time-min=120" in text
    assert "venv=/global/cfs/cdirs/m1234/hpcrl/venvs/" in text  # CFS: a GPU venv outgrows Global Common's 10 GB
    # built at submit on the login side: the job writes nothing there (Global Common, where a
    # project with more quota may put venv_root, is read-only on compute nodes)
    assert "flock" not in text and "mkdir" not in text and "pip install" not in text
    assert "build it on a login node: \"'hpcrl venv build --run v'" in text
    # render shows the resolved requirements (trainer's, then the spec's)
    assert "# Its requirements:\n#   numpy==2.1.0\nvenv=" in text
    other = render("--site", "perlmutter", "--account", "m1234_g", "--trainer", "smoke", "--name", "v",
                   "--set", "requirements=[numpy==2.2.0]")
    venv = [ln for ln in text.splitlines() if ln.startswith("venv=")][0]
    assert venv not in other, "a different requirement set gets a different venv"


def test_scheduler_flags_pass_through_quoted():
    text = render("--site", "perlmutter", "--account", "m1234_g", "--trainer", "smoke", "--name", "f",
                  "--set", "scheduler_flags.mail-type=END", "--set", "scheduler_flags.mail-user=a b@x.org")
    assert "#SBATCH --mail-type=END" in text
    assert "#SBATCH --mail-user='a b@x.org'" in text


@pytest.mark.parametrize("args, message", [
    (["--site", "perlmutter", "--account", "m1_g", "--qos", "debug", "--hours", "4"],
     "qos 'debug' allows at most 0.5 h, asked 4 h; use --qos "),
    (["--site", "perlmutter", "--account", "m1_g", "--qos", "reguler"], "did you mean 'regular'"),
    (["--site", "perlmuter"], "did you mean 'perlmutter'"),
    (["--site", "perlmutter"], "needs a value for 'account'"),
])
def test_site_errors_are_one_line(args, message):
    r = hpcrl("render", "--trainer", "smoke", *args, check=False, env=FIXED)
    assert r.returncode == 2 and r.stdout == ""
    assert message in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_account_from_env_var():
    text = hpcrl("render", "--site", "perlmutter", "--trainer", "smoke", "--name", "a", PY,
                 env={**FIXED, "HPCRL_ACCOUNT": "m999_g"}).stdout
    assert "#SBATCH --account=m999_g" in text


def test_trainer_exit_code_survives_usr1_racing_its_exit(tmp_path):
    # The "trainer" signals the batch shell and exits at once, so the shell's `wait` is
    # interrupted as the child exits (bash 5.2 then loses the child's status): the script must
    # still report the trainer's own 85. The rendered lines are run as they are, with the trainer
    # command swapped for that stand-in.
    text = render("--site", "local", "--trainer", "smoke", "--name", "race")
    start, end = text.index('rc_file="$HPCRL_RUN_DIR'), text.index('echo "hpcrl: trainer exited')
    command = next(ln.strip() for ln in text[start:end].splitlines() if "hpcrl.trainers.smoke" in ln)
    # The traps come before the trainer starts: a USR1 sent the moment it starts (as here) would
    # otherwise find the shell with USR1's default action and kill it (a CI run saw it).
    assert text.index("fi' USR1\n", start) < text.index("\n  (\n    trap : USR1 TERM INT", start)
    block = text[start:end].replace(command, "sh -c 'kill -USR1 \"$1\"; exit 85' _ $$")
    script = ("for i in 1 2 3 4 5 6 7 8; do\n  unset hpcrl_done\n" + block + "  echo rc=$rc\ndone\n")  # each a fresh start
    env = {"HPCRL_RUN_DIR": str(tmp_path), "HPCRL_JOB_ID": "7", "PATH": os.environ["PATH"]}
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, env=env).stdout
    assert out.count("rc=85") == 8, out
    assert not list(tmp_path.glob(".trainer-rc-*")), "the status file is removed"
