"""The hpcrl version is recorded in each run, and `hpcrl resume` by another hpcrl says so in one
line (the run's jobs keep running the code of its lib/ snapshot, the creator's). Runs created
before the version was recorded resume as before. Real local runs (the smoke trainer)."""

import json

from helpers import hpcrl, run_dir, started, wait_for_run

import hpcrl as hpcrl_pkg
from hpcrl.atomicio import atomic_write_json

WALL = "0.003"  # 10.8 s per segment on the fast local site (tests/conftest.py fast_local)


def _submit_one_segment(site, name):
    # more steps than one segment trains: the run stops at max_segments, resumable
    hpcrl("submit", "--site", site, "--trainer", "smoke", "--hours", WALL, "--name", name, "--max-segments", "1",
          "--set", "args.steps=40", "--set", "args.step_time_s=0.2", "--set", "args.save_every=1000")


def _rewrite_state(name, change):
    path = run_dir(name) / "state.json"
    state = json.loads(path.read_text(encoding="utf-8"))
    change(state)
    atomic_write_json(path, state)


def test_a_run_records_its_hpcrl_and_another_hpcrl_resuming_it_says_so_while_an_old_run_resumes_quietly(
        fast_local):
    for name in ("older", "legacy"):  # both at once: each waits mostly on its walltime
        _submit_one_segment(fast_local, name)
    for name in ("older", "legacy"):
        state = wait_for_run(name)
        assert state["state"] == "STOPPED" and len(started(state)) == 1, state["reason"]
        assert state["hpcrl_version"] == hpcrl_pkg.__version__
    assert hpcrl("--version").stdout == f"hpcrl {hpcrl_pkg.__version__}\n"
    from hpcrl import control
    from hpcrl.runs import Run

    assert control.version_note(Run.by_id("older")) is None, "its own run: nothing to say"

    # as if an older hpcrl had created it (the version this one is not)
    _rewrite_state("older", lambda s: s.update(hpcrl_version="0.0.1"))
    out = hpcrl("resume", "older", "--max-segments", "10").stdout.splitlines()
    lib = run_dir("older") / "lib"
    assert out[0] == (f"run older was created by hpcrl 0.0.1; resuming with {hpcrl_pkg.__version__} "
                      f"(its jobs keep running the 0.0.1 code in {lib})"), out
    assert out[1].startswith("resumed run older (job "), out

    # a run made before versions were recorded: no key at all, no note, and it resumes
    _rewrite_state("legacy", lambda s: s.pop("hpcrl_version"))
    out = hpcrl("resume", "legacy", "--max-segments", "10").stdout.splitlines()
    assert len(out) == 1 and out[0].startswith("resumed run legacy (job "), out

    for name in ("older", "legacy"):
        state = wait_for_run(name, states=("COMPLETED",))
        assert started(state)[-1]["end_step"] == 40
    events = [e["what"] for e in json.loads((run_dir("older") / "state.json").read_text())["events"]]
    assert f"resumed with hpcrl {hpcrl_pkg.__version__} (created by 0.0.1)" in events
    legacy = json.loads((run_dir("legacy") / "state.json").read_text())
    assert "hpcrl_version" not in legacy and not [e for e in legacy["events"] if "created by" in e["what"]]

