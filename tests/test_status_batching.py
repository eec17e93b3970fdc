"""`hpcrl status` costs a bounded number of scheduler calls, whatever the number of runs, and
never waits on the network for a run's progress. Calls are counted where every scheduler
command goes: the Slurm backend's command helper (replaced by a recording TEST DOUBLE that
answers like squeue and sacct)."""

from __future__ import annotations

import json
import os
import time

import pytest

from helpers import hpcrl, use_fake_gcloud
from hpcrl import cli
from hpcrl import control
from hpcrl.backends import slurm
from hpcrl.lifecycle import SegState
from hpcrl.proc import CommandResult
from hpcrl.spec import resolve


class SlurmDouble:
    """Answers squeue for the jobs it knows as RUNNING/PENDING, sacct for the rest; records argv."""

    def __init__(self, running: set, forgotten: set):
        self.running, self.forgotten, self.calls = running, forgotten, []

    def __call__(self, argv, timeout_s=60, check=True, input_text=None, env=None):
        self.calls.append(argv)
        ids = argv[argv.index("-j") + 1].split(",")
        if argv[0] == "squeue":
            out = "".join(f"{j}|{'RUNNING' if j in self.running else 'PENDING'}|None|N/A|N/A\n"
                          for j in ids if j not in self.forgotten)
        else:  # sacct
            out = "".join(f"{j}|COMPLETED|0:0|N/A|N/A\n" for j in ids if j in self.forgotten)
        return CommandResult(argv, 0, out, "")


def make_runs(n: int, forget_every: int = 0) -> tuple[set, set]:
    """n Slurm runs, each with a RUNNING segment and its QUEUED successor (2 live jobs)."""
    resolved = resolve(None, "slurm", ["site.account=m1", f"site.outputs={os.environ['HPCRL_HOME']}/runs"],
                       {"trainer": "smoke"})
    running, forgotten = set(), set()
    for i in range(n):
        run = control.create_run(resolved, f"r{i:03d}")
        a, b = str(1000 + 2 * i), str(1001 + 2 * i)
        with run.locked() as state:
            state["state"] = "RUNNING"
            state["segments"] = [
                {"job_id": a, "state": SegState.RUNNING.value, "submitted": time.time(), "started": time.time(), "k": 1},
                {"job_id": b, "state": SegState.QUEUED.value, "submitted": time.time(), "after": a}]
        running.add(a)
        if forget_every and i % forget_every == 0:
            forgotten.update({a, b})  # both jobs ended outside hpcrl and squeue forgot them
    return running, forgotten


@pytest.mark.parametrize("n", [10, 100])
def test_status_of_many_live_slurm_runs_makes_a_bounded_number_of_calls(home, monkeypatch, capsys, n):
    running, forgotten = make_runs(n, forget_every=5)
    double = SlurmDouble(running, forgotten)
    monkeypatch.setattr(slurm, "run_command", double)
    assert cli.main(["status", "--json"]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    assert len(rows) == n
    # one squeue for all 2n live jobs, one sacct for the ids squeue no longer lists: not per run
    assert [argv[0] for argv in double.calls] == ["squeue", "sacct"]
    assert len(double.calls[0][double.calls[0].index("-j") + 1].split(",")) == 2 * n
    stopped = {r for r, row in rows.items() if row["state"] == "STOPPED"}
    assert stopped == {f"r{i:03d}" for i in range(0, n, 5)}, "the runs whose jobs vanished, and only those"
    assert {row["state"] for r, row in rows.items() if r not in stopped} == {"RUNNING"}


def test_status_of_a_maxtext_run_with_gs_checkpoints_never_calls_gcloud(home, tmp_path, monkeypatch):
    # gcloud is the fake (a TEST DOUBLE that records every call): status must not call it at all
    use_fake_gcloud(monkeypatch, tmp_path)
    # where Tunix writes on GCS: checkpoints/actor/<step>/, committed by commit_success.txt
    (tmp_path / "gcs" / "bucket" / "mx" / "checkpoints" / "actor" / "40").mkdir(parents=True)
    (tmp_path / "gcs" / "bucket" / "mx" / "checkpoints" / "actor" / "40" / "commit_success.txt").write_text("")
    sets = ["site.project=my-proj", "site.zone=us-east5-a", "site.bucket=gs://bucket",
            "args.load_parameters_path=gs://bucket/base", "args.base_output_directory=gs://bucket"]
    resolved = resolve(None, "tpu-v5p-8", sets, {"trainer": "maxtext"})
    run = control.create_run(resolved, "mx")
    with run.locked() as state:  # a segment on its VM, as the watcher last saw it
        state["state"] = "RUNNING"
        state["segments"] = [{"job_id": "hpcrl-mx-1", "state": "RUNNING", "submitted": 1.0, "started": time.time(), "k": 1}]
    calls = tmp_path / "fake" / "calls.jsonl"
    for args in (("status",), ("status", "--json"), ("status", "mx")):
        out = hpcrl(*args).stdout
        assert not calls.exists(), f"`hpcrl {' '.join(args)}` ran gcloud: {calls.read_text()}"
    row = json.loads(hpcrl("status", "--json").stdout)[0]
    assert row["checkpoint_step"] is None and "hpcrl watch mx" in row["note"]
    # what the watcher (or the VM's end hook) lists, status then shows without listing itself
    control.WatcherOps().refresh_checkpoint_cache(run)
    assert calls.exists()
    listed = calls.read_text()
    assert json.loads(hpcrl("status", "--json").stdout)[0]["checkpoint_step"] == 40
    assert calls.read_text() == listed
    assert "mx" in out


def test_status_cache_sees_a_rewrite_within_the_same_mtime(home):
    resolved = resolve(None, "local", [], {"trainer": "smoke"})
    run = control.create_run(resolved, "cached")
    with run.locked() as state:
        state["state"], state["reason"] = "STOPPED", "first"
    assert json.loads(hpcrl("status", "--json").stdout)[0]["reason"] == "first"  # now cached
    st = os.stat(run.layout.state)
    with run.locked() as state:
        state["reason"] = "second, longer"
    os.utime(run.layout.state, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same mtime tick
    assert os.stat(run.layout.state).st_mtime_ns == st.st_mtime_ns
    assert json.loads(hpcrl("status", "--json").stdout)[0]["reason"] == "second, longer"


def test_a_final_runs_segment_that_died_without_its_hook_is_closed(home, monkeypatch, capsys):
    # `hpcrl cancel` killed the job before its end hook ran: the run is CANCELLED, its segment was
    # left RUNNING. Status closes it as LOST once the scheduler says the job ended, not before.
    running, forgotten = make_runs(2)
    for rid in ("r000", "r001"):
        with control.Run.by_id(rid).locked() as state:
            state["state"] = "CANCELLED"
            state["segments"][1].update(state=SegState.CANCELLED.value, ended=time.time())
    forgotten.add("1000")  # r000's job ended; r001's (1002) still runs
    monkeypatch.setattr(slurm, "run_command", SlurmDouble(running - {"1000"}, forgotten))
    assert cli.main(["status", "--json"]) == 0
    capsys.readouterr()
    segs = {rid: control.Run.by_id(rid).state()["segments"][0] for rid in ("r000", "r001")}
    assert segs["r000"]["state"] == SegState.LOST.value and "cancelled" in segs["r000"]["reason"]
    assert segs["r001"]["state"] == SegState.RUNNING.value
    assert control.Run.by_id("r000").state()["state"] == "CANCELLED"


def test_a_finished_job_without_an_exit_code_from_scontrol_gets_it_from_sacct(monkeypatch):
    # squeue lists the job COMPLETED (its format has no exit code) and scontrol knows nothing of
    # it: sacct's record gives the code. A RUNNING job is never asked of sacct.
    calls = []

    def double(argv, timeout_s=60, check=True, input_text=None, env=None):
        calls.append(argv[0])
        if argv[0] == "squeue":
            return CommandResult(argv, 0, "7|COMPLETED|None|N/A|N/A\n8|RUNNING|None|N/A|N/A\n", "")
        if argv[0] == "scontrol":
            return CommandResult(argv, 1, "", "slurm_load_jobs error: Invalid job id specified")
        assert argv[argv.index("-j") + 1] == "7", argv
        return CommandResult(argv, 0, "7|COMPLETED|0:0|N/A|N/A\n", "")

    monkeypatch.setattr(slurm, "run_command", double)
    infos = slurm.SlurmBackend({}).query(["7", "8"])
    assert (infos["7"].state, infos["7"].exit_code) == (slurm.JobState.COMPLETED, 0)
    assert infos["8"].state == slurm.JobState.RUNNING and calls == ["squeue", "scontrol", "sacct"]
    # and when sacct has no record either, squeue's state stays (not UNKNOWN)
    monkeypatch.setattr(slurm, "run_command", lambda argv, **kw: double(argv) if argv[0] != "sacct"
                        else CommandResult(argv, 0, "", ""))
    infos = slurm.SlurmBackend({}).query(["7"])
    assert (infos["7"].state, infos["7"].exit_code) == (slurm.JobState.COMPLETED, None)
