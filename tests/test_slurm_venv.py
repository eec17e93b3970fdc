"""The software file system as Perlmutter has it, on the Perlmutter-shaped test cluster: the nodes
mount it read-only (scripts/slurm-cluster binds $HPCRL_SLURM_SOFTWARE read-only in each slurmd's
mount namespace, as NERSC's compute nodes mount /global/common), this login side writes it.

- A job cannot create anything there: the venv build the segment script used to do in the job
  (its first command was `mkdir -p` of venv_root) fails on every node.
- The perlmutter profile's built-in trainer (a tiny model) runs through >= 2 segments to COMPLETED
  with venv_root there: the venv is built once, at `hpcrl submit`, and every segment activates it.

Test double: what cannot happen here is downloading the trainer's multi-GB torch stack. The site's
set-up line puts the test interpreter's site-packages on PYTHONPATH (as EasyBuild-style modules
provide packages), so the real `python -m venv` + `pip install -r` at submit finds every
requirement satisfied (PIP_NO_INDEX: nothing is fetched) and the job's venv python imports torch.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from helpers import hpcrl, read_metrics, started, wait_for_run, wait_until
from hpcrl.runs import Run

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(480)]
pytest.importorskip("transformers", reason="the built-in trainer")

# The built-in trainer on a tiny model (as tests/test_slurm_ranks.py), one rank.
TINY = {
    "model": "tiny", "tiny_hidden_size": 32, "tiny_layers": 1, "tiny_heads": 2, "tiny_max_int": 100,
    "prompt_template": "tiny", "countdown_min_count": 2, "countdown_max_count": 2, "countdown_max_number": 9,
    "countdown_max_target": 81, "countdown_train_size": 64, "countdown_test_size": 8,
    "sft_steps": 2, "sft_lr": 3e-3, "lr": 1e-3, "beta": 0.05, "batch_size": 4, "group_size": 4, "ppo_epochs": 2,
    "mini_batches": 2, "max_response_length": 6, "eval_size": 8, "eval_batch_size": 8, "keep_last": 3,
    "threads": 1, "seed": 3,
}


def site_packages() -> str:
    """Where this interpreter's torch lives (found without importing torch)."""
    return str(Path(importlib.util.find_spec("torch").origin).parents[1])


@pytest.fixture
def software(pm_cluster):
    """A fresh project area on the cluster's software file system (removed afterwards, from here)."""
    root = Path(os.environ["HPCRL_SLURM_SOFTWARE"]) / f"t{uuid.uuid4().hex[:8]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def login(home, pm_cluster, software, tmp_path, monkeypatch):
    """This shell as a login node (Lmod's `module` in non-interactive bash, $SCRATCH) and a user site
    that extends perlmutter with venv_root on the software file system."""
    etc = Path(os.environ["SLURM_CONF"]).parent
    monkeypatch.setenv("BASH_ENV", str(etc / "lmod-bashenv.sh"))
    monkeypatch.setenv("MODULEPATH", os.environ["HPCRL_SLURM_MODULEPATH"])
    monkeypatch.setenv("LMOD_ALLOW_ROOT_USE", "yes")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    (tmp_path / "scratch").mkdir()
    monkeypatch.setenv("SCRATCH", str(tmp_path / "scratch"))
    site = {
        "extends": "perlmutter",
        "venv_root": str(software / "{project}" / "hpcrl" / "venvs"),
        "signal_lead_s": 30, "exit_margin_s": 8, "kill_grace_s": 5,
        "setup": [f'export PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{site_packages()}"'],
        # the test cluster's GPUs are gres stand-ins and its torch is this CPU build: no driver to
        # fit, no CUDA build to install, no GPU for the segment's check to find
        "gpu_stack": {"driver_cuda": None, "cuda_variant": None, "nccl": None},
    }
    (Path(os.environ["HPCRL_SITES_DIR"]) / "pmvenv.yaml").write_text(yaml.safe_dump(site))
    names: list[str] = []
    yield names
    for name in names:
        subprocess.run(["scancel", "--name", name], capture_output=True)


def test_the_nodes_mount_the_software_file_system_read_only_and_the_login_side_writes_it(pm_cluster, software):
    venv_root = software / "m1234" / "hpcrl" / "venvs"
    for node in pm_cluster.nodes:
        # what the segment script's in-job venv build did first
        job = subprocess.run(["srun", "-A", pm_cluster.account, "-q", "debug", "-t", "1", "-w", node, "-J", "ro-probe",
                              "bash", "-c", f'hostname; mkdir -p "{venv_root}"'], capture_output=True, text=True,
                             timeout=120)
        assert job.returncode != 0 and job.stdout.strip() == node, (job.stdout, job.stderr)
        assert "Read-only file system" in job.stderr, job.stderr
    venv_root.mkdir(parents=True)  # here, the login side: writable
    assert venv_root.is_dir()


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


def test_perlmutter_builtin_run_completes_with_the_venv_built_once_at_submit(login, pm_cluster, software, tmp_path):
    login.append("pmvenv")
    spec = tmp_path / "pmvenv.yaml"
    spec.write_text(yaml.safe_dump({"name": "pmvenv", "trainer": "builtin",
                                    "args": {**TINY, "total_steps": 598, "save_every": 1000}}))
    r = hpcrl("submit", spec, "--site", "pmvenv", "--account", pm_cluster.account, "--qos", "debug",
              "--hours", "0.05", "--set", "resources.ranks_per_node=1", "--name", "pmvenv", timeout=400)
    venvs = software / "m1234" / "hpcrl" / "venvs"
    built = [p for p in venvs.iterdir() if p.is_dir()]
    assert len(built) == 1, list(venvs.iterdir())
    venv = built[0]
    assert f"building venv {venv}" in r.stderr and f"venv {venv} ready" in r.stderr, r.stderr
    log = venvs / f"{venv.name}.log"
    assert log.read_text().count("# hpcrl venv build of ") == 1 and "Requirement already satisfied: torch" in \
        log.read_text(), log.read_text()[-2000:]
    assert sorted(p.name for p in venvs.iterdir()) == sorted([venv.name, log.name, f"{venv.name}.lock"])
    before = _snapshot(venvs)
    run = Run.by_id("pmvenv")
    script = run.layout.script.read_text()
    assert f"venv={venv}\n" in script and "pip install" not in script and "#   torch==2.13.0\n" in script

    # USR1 to the batch shell at step >= 100, as --signal=B:USR1 delivers it (Slurm's own comes on a
    # 30 s tick, maybe before the trainer saved anything: two such segments read as a crash loop)
    def steps():
        return [m["step"] for m in read_metrics(run.dir) if m.get("phase") in ("sft", "train")]

    wait_until(lambda: len(steps()) >= 100, 240, "step 100 in segment 1", poll=0.5,
               describe=lambda: f"{run.state()['state']}, steps {len(steps())}")
    job = next(s["job_id"] for s in run.state()["segments"] if s["state"] == "RUNNING")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True, capture_output=True)
    state = wait_for_run("pmvenv", timeout=360)
    logs = [run.layout.log(s["job_id"]).read_text() for s in started(state)]
    assert state["state"] == "COMPLETED", f"{state}\n{''.join(logs)[-3000:]}"
    ran = started(state)
    assert len(ran) >= 2 and all(s["state"] == "CONTINUE" for s in ran[:-1]), ran
    assert sorted(set(steps())) == list(range(1, 601))
    for seg_log in logs:  # every segment activated the venv built at submit, and built nothing
        assert f"hpcrl: venv {venv} (ready since" in seg_log and "building venv" not in seg_log, seg_log
        assert "Read-only file system" not in seg_log, seg_log
    assert _snapshot(venvs) == before, "the jobs wrote nothing under venv_root (marker, log, lock unchanged)"
