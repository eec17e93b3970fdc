"""Pure tests of the Slurm backend's parsers, fed outputs recorded from a real Slurm 22.05
(tests/data/slurm/record.sh made them; jobs.txt names which job is which), and of the #SBATCH
line builder with hostile values."""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import pytest

from hpcrl.backends.base import JobState
from hpcrl.backends.slurm import (SLURM_STATES, map_state, parse_sacct, parse_sbatch_parsable, parse_scontrol,
                                  parse_squeue_json, parse_squeue_text, sbatch_directives)
from hpcrl.errors import BackendError, SpecError

DATA = Path(__file__).parent / "data" / "slurm"


def _read(name: str) -> str:
    return (DATA / name).read_text()


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    # Slurm prints local wall-clock times; the recording machine ran in UTC.
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _jobs() -> dict[str, str]:
    # "jobs: ok=4 fail=5 ..." -> {"ok": "4", ...}
    return dict(pair.split("=") for pair in _read("jobs.txt").split()[1:])


def _ts(text: str) -> float:
    return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))


# --- state table -------------------------------------------------------------------------------

ALL_SLURM_STATES = ["BOOT_FAIL", "CANCELLED", "COMPLETED", "CONFIGURING", "COMPLETING", "DEADLINE", "FAILED",
                    "NODE_FAIL", "OUT_OF_MEMORY", "PENDING", "PREEMPTED", "RUNNING", "RESV_DEL_HOLD", "REQUEUE_FED",
                    "REQUEUE_HOLD", "REQUEUED", "RESIZING", "REVOKED", "SIGNALING", "SPECIAL_EXIT", "STAGE_OUT",
                    "STOPPED", "SUSPENDED", "TIMEOUT"]


def test_every_slurm_state_is_mapped():
    # The list is squeue(1)'s JOB STATE CODES; a state missing from the table would read UNKNOWN.
    assert sorted(SLURM_STATES) == sorted(ALL_SLURM_STATES)
    assert all(isinstance(v, JobState) and v is not JobState.UNKNOWN for v in SLURM_STATES.values())


def test_states_with_live_processes_are_not_finished():
    for state in ["PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "STAGE_OUT", "REQUEUED"]:
        assert not SLURM_STATES[state].finished, state
    for state in ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"]:
        assert SLURM_STATES[state].finished, state


def test_map_state_accepts_sacct_spellings_and_unknowns():
    assert map_state("CANCELLED by 0") is JobState.CANCELLED
    assert map_state("running") is JobState.RUNNING
    assert map_state("SOMETHING_NEW") is JobState.UNKNOWN


# --- parsers on recorded outputs ---------------------------------------------------------------

def test_squeue_text_early_snapshot():
    j = _jobs()
    jobs = parse_squeue_text(_read("squeue_early.txt"))
    assert jobs[j["run"]].state is JobState.RUNNING
    assert jobs[j["run"]].start_time == _ts("2026-12-02T10:47:37")
    assert jobs[j["run"]].end_time is None  # running: the expected end is not an end
    assert jobs[j["dep"]].state is JobState.PENDING and jobs[j["dep"]].reason == "Dependency"
    # A pending job waiting for CPUs has an *expected* start; it must not read as started.
    assert jobs[j["res"]].state is JobState.PENDING and jobs[j["res"]].start_time is None
    assert jobs[j["res"]].reason == "Resources"
    assert jobs[j["ok"]].state is JobState.COMPLETED and jobs[j["ok"]].reason == ""
    assert jobs[j["fail"]].state is JobState.FAILED and jobs[j["fail"]].reason == "NonZeroExitCode"


def test_squeue_text_late_snapshot():
    j = _jobs()
    jobs = parse_squeue_text(_read("squeue_late.txt"))
    assert jobs[j["tmo"]].state is JobState.TIMEOUT and jobs[j["tmo"]].reason == "TimeLimit"
    assert jobs[j["tmo"]].end_time - jobs[j["tmo"]].start_time == 75  # the 60 s limit + 15 s until slurmctld's 30 s limit check
    assert jobs[j["run"]].state is JobState.CANCELLED
    assert jobs[j["dep"]].reason == "DependencyNeverSatisfied"
    assert set(jobs) == set(j.values())


def test_squeue_text_skips_noise():
    assert parse_squeue_text("slurm_load_jobs error: Invalid job id specified\n\n") == {}


def test_squeue_json_matches_text():
    # Same cluster, same moment, two formats: they must agree on state and times.
    data = json.loads(_read("squeue_late.json"))
    from_json = parse_squeue_json(data, _jobs().values())
    from_text = parse_squeue_text(_read("squeue_late.txt"))
    assert set(from_json) == set(from_text)
    for job_id, info in from_text.items():
        other = from_json[job_id]
        assert (other.state, other.reason, other.start_time, other.end_time) == \
               (info.state, info.reason, info.start_time, info.end_time), job_id


def test_squeue_json_exit_codes_and_filter():
    j = _jobs()
    jobs = parse_squeue_json(json.loads(_read("squeue_late.json")), [j["fail"], j["tmo"], j["ok"], "424242"])
    assert set(jobs) == {j["fail"], j["tmo"], j["ok"]}  # --json ignores -j: we filter
    assert jobs[j["fail"]].exit_code == 3  # raw wait status 768
    assert jobs[j["tmo"]].exit_code == 128 + 15  # killed by SIGTERM at the walltime
    assert jobs[j["ok"]].exit_code == 0
    everything = parse_squeue_json(json.loads(_read("squeue_late.json")))
    assert len(everything) > len(jobs)


def test_squeue_json_newer_shape():
    # Not recorded here (this machine has 22.05): the 23.02+ shape with state lists and
    # {"set","infinite","number"} numbers, as the data_parser plugins emit it.
    data = {"jobs": [{"job_id": 7, "job_state": ["TIMEOUT"], "state_reason": "TimeLimit",
                      "start_time": {"set": True, "infinite": False, "number": 100},
                      "end_time": {"set": True, "infinite": False, "number": 175},
                      "exit_code": {"status": ["SIGNALED"], "return_code": {"set": True, "number": 0},
                                    "signal": {"id": {"set": True, "number": 15}, "name": "TERM"}}},
                     {"job_id": 8, "job_state": ["PENDING"], "state_reason": "Priority",
                      "start_time": {"set": True, "infinite": False, "number": 0},
                      "end_time": {"set": False, "infinite": False, "number": 0},
                      "exit_code": {"status": ["PENDING"], "return_code": {"set": False, "number": 0}}}]}
    jobs = parse_squeue_json(data)
    assert (jobs["7"].state, jobs["7"].start_time, jobs["7"].end_time, jobs["7"].exit_code) == \
           (JobState.TIMEOUT, 100, 175, 143)
    assert (jobs["8"].state, jobs["8"].reason, jobs["8"].start_time) == (JobState.PENDING, "Priority", None)


@pytest.mark.parametrize("name,state,reason,exit_code", [
    ("scontrol_pending.txt", JobState.PENDING, "Dependency", None),
    ("scontrol_running.txt", JobState.RUNNING, "", None),
    ("scontrol_completed.txt", JobState.COMPLETED, "", 0),
    ("scontrol_failed.txt", JobState.FAILED, "NonZeroExitCode", 3),
    ("scontrol_timeout.txt", JobState.TIMEOUT, "TimeLimit", 143),
    ("scontrol_cancelled.txt", JobState.CANCELLED, "", 143),
])
def test_scontrol(name, state, reason, exit_code):
    jobs = parse_scontrol(_read(name))
    assert len(jobs) == 1
    info = next(iter(jobs.values()))
    assert (info.state, info.reason, info.exit_code) == (state, reason, exit_code)
    assert (info.start_time is None) == (state is JobState.PENDING)
    assert (info.end_time is None) == (not state.finished)


def test_scontrol_times_and_multiple_records():
    j = _jobs()
    text = _read("scontrol_timeout.txt") + "\n" + _read("scontrol_cancelled.txt")
    jobs = parse_scontrol(text)
    assert set(jobs) == {j["tmo"], j["run"]}
    assert jobs[j["tmo"]].start_time == _ts("2026-12-02T10:47:37")
    assert jobs[j["tmo"]].end_time == _ts("2026-12-02T10:48:52")


def test_scontrol_error_output_is_empty():
    assert parse_scontrol("slurm_load_jobs error: Invalid job id specified\n") == {}


def test_sacct_jobcomp_output():
    j = _jobs()
    jobs = parse_sacct(_read("sacct_jobcomp.txt") + f"{j['fail']}.batch|FAILED|3:0|2026-12-02T10:47:31|Unknown\n")
    assert jobs[j["fail"]].state is JobState.FAILED and jobs[j["fail"]].exit_code == 3
    assert jobs[j["tmo"]].state is JobState.TIMEOUT
    assert f"{j['fail']}.batch" not in jobs  # job steps are not jobs


def test_sacct_disabled_message_parses_to_nothing():
    assert "accounting storage is disabled" in _read("sacct_disabled.txt")
    assert parse_sacct(_read("sacct_disabled.txt")) == {}


def test_sbatch_parsable():
    assert parse_sbatch_parsable(_read("sbatch_parsable.txt")) == _jobs()["ok"]
    assert parse_sbatch_parsable("1234;perlmutter\n") == "1234"
    with pytest.raises(BackendError, match="not a job id"):
        parse_sbatch_parsable("Submitted batch job 12\n")


# --- #SBATCH lines -----------------------------------------------------------------------------

def test_directives_sorted_flags_and_skips():
    lines = sbatch_directives({"time": "04:00:00", "account": "m1234_g", "exclusive": True,
                               "requeue": False, "mail-user": None, "nodes": 2})
    assert lines == ["#SBATCH --account=m1234_g", "#SBATCH --exclusive", "#SBATCH --nodes=2",
                     "#SBATCH --time=04:00:00"]


HOSTILE = ["a'; touch /tmp/PWNED #", "$(id)", "`id`", 'say "hi"', "back\\slash", "x#y", "two words", "", "'"]


def _sbatch_unquote(arg: str) -> str:
    # A model of sbatch's _get_argument (src/sbatch/opt.c): quotes group, a backslash escapes the
    # next character anywhere, an unquoted '#' ends the line. Checked against real sbatch in
    # tests/test_slurm_backend.py::test_directive_values_reach_slurm_verbatim.
    out, quote, escape = [], "", False
    for ch in arg:
        if escape:
            out.append(ch)
            escape = False
        elif ch == "\\":
            escape = True
        elif quote:
            if ch == quote:
                quote = ""
            else:
                out.append(ch)
        elif ch in "'\"":
            quote = ch
        elif ch == "#" or ch.isspace():
            break
        else:
            out.append(ch)
    return "".join(out)


@pytest.mark.parametrize("value", HOSTILE)
def test_directive_values_survive_sbatch_parsing(value):
    (line,) = sbatch_directives({"comment": value})
    assert line.startswith("#SBATCH --comment=")
    assert "\n" not in line
    assert _sbatch_unquote(line[len("#SBATCH --comment="):]) == value
    # bash sees the whole line as one comment: nothing in it can run.
    assert shlex.split(line, comments=True) == []


@pytest.mark.parametrize("value", ["a\nb", "x\r", "nul\0"])
def test_directive_rejects_multiline_values(value):
    with pytest.raises(SpecError, match="sbatch option 'comment'.*newline") as err:
        sbatch_directives({"comment": value})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("key", ["Time", "-time", "time=1 --uid", "a b", "x;y", "", "tíme", "time\n"])
def test_directive_rejects_bad_option_names(key):
    with pytest.raises(SpecError, match="sbatch option") as err:
        sbatch_directives({key: "1"})
    assert "\n" not in str(err.value)


def test_current_job_id_from_environment():
    from hpcrl.backends.slurm import SlurmBackend
    backend = SlurmBackend({})
    assert backend.current_job_id({"SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242"}) == "4242"
    assert backend.current_job_id({}) is None
