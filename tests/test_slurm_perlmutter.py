"""The built-in `perlmutter` profile end to end on the Perlmutter-shaped test cluster.

scripts/slurm-cluster builds that cluster (accounting with enforced QOS limits, account m1234_g,
two 128-CPU nodes with gpu:4 and feature gpu in their own namespaces, Lmod). The run goes through
a user site that `extends: perlmutter` and changes only what cannot be the same on this machine:
where venvs live, and lead times sized for 1-minute jobs. Outputs stay `$SCRATCH/hpcrl/runs`
with $SCRATCH pointed into the test's directory.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, hpcrl, read_metrics, started, wait_for_run, wait_until
from slurm_fixture import BOTH_NODES_WAIT_S

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420)]
ONE_MIN = "0.0167"
MODULE_LINE = "hpcrl-test: python module=${HPCRL_TEST_PYTHON_MODULE:-none} loaded=${LOADEDMODULES:-none}"


def _sacct(*args: str) -> list[dict]:
    fields = ["JobID", "JobName", "Account", "QOS", "State", "ExitCode", "AllocTRES", "Constraints", "NodeList"]
    out = subprocess.run(["sacct", "-X", "-P", "-n", "-o", ",".join(fields), *args],
                         capture_output=True, text=True, check=True).stdout
    return [dict(zip(fields, line.split("|"))) for line in out.splitlines() if line.strip()]


def _minutes(walltime: str) -> float:
    """sacctmgr's MaxWall ('2-00:00:00', '04:00:00', '00:30:00') in minutes."""
    days, _, hms = walltime.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return int(days or 0) * 1440 + h * 60 + m + s / 60


@pytest.fixture
def pm_site(home, pm_cluster, tmp_path, monkeypatch):
    """The user's site file: extends the built-in perlmutter, changes what cannot be the same."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("SCRATCH", str(scratch))
    site = {
        "extends": "perlmutter",
        "venv_root": str(tmp_path / "venvs"),   # /global/common/software does not exist here
        "signal_lead_s": 30, "exit_margin_s": 8, "kill_grace_s": 5,   # 1-minute jobs, 30 s tick
        "setup": [f'echo "{MODULE_LINE}"'],      # what the test reads back from the job's log
    }
    (Path(os.environ["HPCRL_SITES_DIR"]) / "pmci.yaml").write_text(yaml.safe_dump(site))
    names: list[str] = []
    yield names
    for name in names:
        subprocess.run(["scancel", "--name", name], capture_output=True)


def test_slurm_qos_table_and_account_agree_with_the_perlmutter_profile(pm_cluster):
    profile = yaml.safe_load((ROOT / "site_configs" / "perlmutter.yaml").read_text())
    out = subprocess.run(["sacctmgr", "-n", "-P", "show", "qos", "format=Name,MaxWall,Flags"],
                         capture_output=True, text=True, check=True).stdout
    slurm = {name: (wall, flags) for name, wall, flags in (ln.split("|") for ln in out.splitlines() if ln)}
    slurm.pop("normal", None)  # Slurm's own default QOS, not one of NERSC's
    assert set(slurm) == set(profile["qos_table"]), (sorted(slurm), sorted(profile["qos_table"]))
    for qos, limits in profile["qos_table"].items():
        wall, flags = slurm[qos]
        assert _minutes(wall) == pytest.approx(limits["max_hours"] * 60), (qos, wall, limits)
        assert "DenyOnLimit" in flags, (qos, flags)
    assoc = subprocess.run(["sacctmgr", "-n", "-P", "show", "assoc", f"account={pm_cluster.account}",
                            "user=root", "format=Account,User,QOS"], capture_output=True, text=True, check=True).stdout
    acct, user, qos_list = assoc.strip().split("|")
    assert (acct, user) == (pm_cluster.account, "root") and acct.endswith("_g")
    assert set(qos_list.split(",")) == set(profile["qos_table"])
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %c %G %f"], capture_output=True, text=True, check=True).stdout
    assert sorted(nodes.split("\n")[:2]) == ["nid001 128 gpu:4 gpu,a100,hbm40g", "nid002 128 gpu:4 gpu,a100,hbm40g"]


def test_hours_above_the_qos_limit_refused_by_hpcrl_before_slurm_and_by_slurm(pm_site, pm_cluster, tmp_path):
    pm_site.append("pm-long")
    r = hpcrl("submit", "--site", "pmci", "--account", pm_cluster.account, "--qos", "debug", "--hours", "1",
              "--trainer", "smoke", "--name", "pm-long", check=False)
    assert r.returncode != 0 and "debug" in r.stderr and "0.5" in r.stderr, r.stderr
    assert not _sacct("--name", "pm-long", "-S", "now-10minutes"), "hpcrl must refuse before Slurm sees it"
    # Slurm agrees when asked directly with the same resources.
    direct = subprocess.run(["sbatch", "-A", pm_cluster.account, "-q", "debug", "-t", "60", "-C", "gpu",
                             "--gpus-per-node=4", "--cpus-per-task=128", "-J", "pm-long", "-o", "/dev/null",
                             "--wrap", "true"], capture_output=True, text=True)
    assert direct.returncode != 0 and "QOSMaxWallDurationPerJobLimit" in direct.stderr, direct.stderr
    # and an account that does not exist is Slurm's refusal too (enforced associations)
    other = subprocess.run(["sbatch", "-A", "m0000_g", "-q", "debug", "-t", "5", "-o", "/dev/null", "--wrap", "true"],
                           capture_output=True, text=True)
    assert other.returncode != 0 and "Invalid account" in other.stderr, other.stderr


def test_perlmutter_profile_smoke_chain_on_regular_completes_with_sacct_telling_the_truth(pm_site, pm_cluster):
    from hpcrl.backends.base import JobState
    from hpcrl.backends.slurm import SlurmBackend
    from hpcrl.runs import Run

    pm_site.append("pm-chain")
    # ~40 s of work against a USR1 that comes at most 30 s into a 1-minute job: >= 2 segments.
    # The chain test the README gives: short segments on regular (debug forbids chaining).
    hpcrl("submit", "--site", "pmci", "--account", pm_cluster.account, "--qos", "regular", "--hours", ONE_MIN,
          "--trainer", "smoke", "--name", "pm-chain", "--set", "args.steps=100", "--set", "args.step_time_s=0.4",
          "--set", "args.save_every=1000")
    run = Run.by_id("pm-chain")
    script = run.layout.script.read_text()
    for line in ("--constraint=gpu", "--gpus-per-node=4", "--cpus-per-task=128",
                 f"--account={pm_cluster.account}", "--qos=regular", "--time=1"):
        assert f"#SBATCH {line}\n" in script, (line, script)
    assert "module load python\n" in script
    assert str(run.dir).startswith(os.environ["SCRATCH"] + "/hpcrl/runs/"), run.dir

    state = wait_for_run("pm-chain", timeout=360)
    log = hpcrl("logs", "pm-chain").stdout
    assert state["state"] == "COMPLETED", f"{state}\n{log}"
    ran = started(state)
    assert len(ran) >= 2, ran
    assert [m["step"] for m in read_metrics(run.dir)] == list(range(1, 101))
    assert all(s["state"] == "CONTINUE" and s["rc"] == 85 for s in ran[:-1]), ran
    # `module load python` ran in the job's own shell: Lmod's LOADEDMODULES and the module's variable
    for seg in ran:
        seg_log = run.layout.log(seg["job_id"]).read_text()
        assert "hpcrl-test: python module=python/3.11 loaded=python/3.11" in seg_log, seg_log

    # Slurm's own accounting: every job of the run under the account and QOS, every one COMPLETED
    # (the continuation segments exit 0 for the scheduler), with what the profile asked for.
    jobs = {j["JobID"]: j for j in _sacct("--name", run.id, "-S", "now-1hour")}
    for seg in ran:
        job = jobs[seg["job_id"]]
        assert (job["Account"], job["QOS"], job["State"], job["ExitCode"]) == (pm_cluster.account, "regular",
                                                                                "COMPLETED", "0:0"), job
        assert "gres/gpu=4" in job["AllocTRES"] and "cpu=128" in job["AllocTRES"], job
        assert job["Constraints"] == "gpu" and job["NodeList"] in pm_cluster.nodes, job
    assert all(j["State"] == "COMPLETED" for j in jobs.values()), jobs  # the no-op successor too

    # squeue forgets finished jobs after MinJobAge (10 s here, purged on slurmctld's ~60 s tick);
    # poll must then answer from sacct, with the exit code.
    first = ran[0]["job_id"]
    backend = SlurmBackend({"scheduler": "slurm"})
    wait_until(lambda: backend._squeue([first]) == {}, 120, f"squeue to forget job {first}", poll=2)
    info = backend.poll([(run, first)])[first]
    assert (info.state, info.exit_code) == (JobState.COMPLETED, 0), info
    assert info.start_time and info.end_time and info.start_time <= info.end_time
    assert re.fullmatch(r"\d+", first)


@pytest.mark.both_nodes
@pytest.mark.timeout(420 + BOTH_NODES_WAIT_S)
def test_two_nodes_own_hostnames_module_in_srun_tasks_and_epilog_ends_leftovers(pm_cluster, tmp_path):
    """What multi-node jobs rely on: srun task i on node i with that node's hostname and address,
    `module load python` inside srun tasks, and (Perlmutter's cgroups) no process outliving its job."""
    out = tmp_path / "two.out"
    script = tmp_path / "two.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH -N 2 --ntasks-per-node=1 -C gpu --gpus-per-node=4 -A {pm_cluster.account} -q debug -t 1 -o {out}
srun bash -c 'module load python; echo "task $SLURM_PROCID $(hostname) $(hostname --ip-address) $HPCRL_TEST_PYTHON_MODULE"'
srun -w nid002 -N 1 -n 1 bash -c 'setsid sleep 300 </dev/null >/dev/null 2>&1 & echo "left $!"'
""")
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True).stdout.strip()
    # both nodes at once: it may queue behind the tiers' Slurm verl run (300 s ran out once with the
    # job PENDING, and the module's 420 s timeout once)
    wait_until(lambda: _sacct("-j", job) and _sacct("-j", job)[0]["State"] == "COMPLETED", BOTH_NODES_WAIT_S + 60,
               f"job {job}",
               poll=0.5, describe=lambda: _sacct("-j", job))
    text = out.read_text()
    addr = {n: subprocess.run(["scontrol", "show", "node", n], capture_output=True, text=True).stdout
            .split("NodeAddr=")[1].split()[0] for n in pm_cluster.nodes}
    assert f"task 0 nid001 {addr['nid001']} python/3.11" in text and f"task 1 nid002 {addr['nid002']} python/3.11" in text, text
    left = int(text.split("left ")[1].split()[0])
    wait_until(lambda: not Path(f"/proc/{left}").exists(), 120, f"the Epilog to end the leftover process {left}")
    epilog_log = Path(pm_cluster.env["HPCRL_SLURM_DIR"]) / "log" / "epilog-nid002.log"
    assert f"job {job}: ended 1 leftover process(es): {left}" in epilog_log.read_text()


def test_debug_run_is_one_job_that_queues_no_other(pm_site, pm_cluster):
    """NERSC forbids job chaining on debug: a debug run is one segment, and its job submits no
    batch job at all (not even a successor that would find nothing to do); a chain is refused."""
    run, chain = f"pm-debug-{os.getpid()}", f"pm-debug-chain-{os.getpid()}"  # sacct remembers earlier runs' jobs
    pm_site.extend([run, chain])
    r = hpcrl("submit", "--site", "pmci", "--account", pm_cluster.account, "--qos", "debug", "--hours", ONE_MIN,
              "--total-hours", "1", "--trainer", "smoke", "--name", chain, check=False)
    assert r.returncode != 0 and "chaining" in r.stderr and "--qos regular" in r.stderr, r.stderr
    assert not _sacct("--name", chain, "-S", "now-10minutes")
    # more work than one 1-minute segment holds: the run stops after it, out of segments
    hpcrl("submit", "--site", "pmci", "--account", pm_cluster.account, "--qos", "debug", "--hours", ONE_MIN,
          "--total-hours", ONE_MIN, "--trainer", "smoke", "--name", run, "--set", "args.steps=300",
          "--set", "args.step_time_s=0.4")
    state = wait_for_run(run, timeout=240)
    assert len(started(state)) == 1 and len(state["segments"]) == 1, state["segments"]
    assert state["state"] != "COMPLETED", state  # stopped by its one-segment budget, resumable
    jobs = _sacct("--name", run, "-S", "now-1hour")
    assert len(jobs) == 1 and jobs[0]["QOS"] == "debug", jobs
    # a resume runs one more segment, queued by the resume itself; never a chain
    r = hpcrl("resume", run, "--max-segments", "5", check=False)
    assert r.returncode != 0 and "chaining" in r.stderr and "--max-segments 2" in r.stderr, r.stderr
    hpcrl("resume", run)
    state = wait_for_run(run, timeout=240)
    assert len(started(state)) == 2 and len(state["segments"]) == 2, state["segments"]
    assert len(_sacct("--name", run, "-S", "now-1hour")) == 2


def test_shared_qos_job_holds_its_share_of_the_node(pm_site, pm_cluster):
    """--qos shared with one GPU: Slurm allocates a quarter of the node (32 CPUs, 64 GB), not 128 CPUs."""
    name = f"pm-shared-{os.getpid()}"
    pm_site.append(name)
    hpcrl("submit", "--site", "pmci", "--account", pm_cluster.account, "--qos", "shared", "--hours", ONE_MIN,
          "--trainer", "smoke", "--name", name, "--set", "resources.gpus_per_node=1", "--set", "args.steps=5",
          "--set", "args.step_time_s=0.2")
    state = wait_for_run(name, timeout=240)
    assert state["state"] == "COMPLETED", state
    job_id = started(state)[0]["job_id"]
    # by name too: the accounting database outlives a restarted test cluster, whose job ids start again
    jobs = wait_until(lambda: [j for j in _sacct("-j", job_id) if j["JobName"] == name], 60,
                      f"sacct to know job {job_id}", poll=1)
    assert jobs[0]["QOS"] == "shared", jobs
    tres = jobs[0]["AllocTRES"]
    assert "cpu=32," in tres and "gres/gpu=1" in tres, tres
    # this cluster does not count memory as a consumable (no mem in AllocTRES): the request is the record
    rows = subprocess.run(["sacct", "-X", "-P", "-n", "-j", job_id, "-o", "JobName,ReqMem"], capture_output=True,
                          text=True, check=True).stdout.split()
    mem = [row.split("|")[1] for row in rows if row.split("|")[0] == name]
    assert mem and mem[0] in ("64G", "64Gn", "65536M", "65536Mn"), mem
