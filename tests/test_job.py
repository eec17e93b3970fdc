"""The job-side package (hpcrl/job): one supervisor for a foreign trainer's process group, verl's and
MaxText's launchers as subclasses of it, run as the segment script runs them (`python -m
hpcrl.job.X` from a lib/ snapshot, no site-packages) against stand-in trainers (real processes:
bash scripts in place of the trainer's interpreter)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from hpcrl import protocol
from hpcrl.job import maxtext, supervisor, verl

from helpers import job_launcher, protocol_env

# Per launcher: its module, its arguments, and a stand-in that trains up to step 2, saves step $SAVED
# the way the trainer does (verl: tracker file + FileLogger line; MaxText: a committed step directory),
# then exits $RC.
LAUNCHERS = {
    "verl": ("hpcrl.job.verl", ["--ckpt-dir", "{ckpt}", "--save-freq", "1", "--save-time-s", "1"], """
echo '{{"step": 2, "data": {{"timing_s/step": 1.0}}}}' >> "$VERL_FILE_LOGGER_PATH"
mkdir -p "{ckpt}/global_step_$SAVED"; echo "$SAVED" > "{ckpt}/latest_checkpointed_iteration.txt"
exit "$RC"
"""),
    "maxtext": ("hpcrl.job.maxtext", ["--ckpt-root", "{ckpt}", "--period", "1", "--total-steps", "2"], """
mkdir -p "{ckpt}/$SAVED"
exit "$RC"
"""),
}


def run_launcher(tmp_path, which: str, saved: int, rc: int, deadline_in_s: float = 3600):
    module, args, body = LAUNCHERS[which]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    stand_in = tmp_path / "stand-in"
    stand_in.write_text("#!/bin/bash\n" + body.format(ckpt=ckpt))
    stand_in.chmod(0o755)
    launcher, env = job_launcher(tmp_path, module)
    env.update(protocol_env(tmp_path, deadline=time.time() + deadline_in_s), SAVED=str(saved), RC=str(rc))
    argv = [*launcher, "--python", str(stand_in), *[a.format(ckpt=ckpt) for a in args], "--", "x=1"]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("which", sorted(LAUNCHERS))
def test_a_saved_end_completes_and_a_failure_passes_through(tmp_path, which):
    done = run_launcher(tmp_path, which, saved=2, rc=0)
    assert done.returncode == protocol.EXIT_COMPLETE, done.stderr
    assert "hpcrl: running " in done.stderr and not (tmp_path / protocol.ERROR_FILE).exists()
    failed = run_launcher(tmp_path, which, saved=2, rc=3)
    assert failed.returncode == 3, failed.stderr


@pytest.mark.parametrize("which, reason", [
    ("verl", "verl ended at step 2 but its newest checkpoint is step 1: the last 1 steps are not saved"),
    ("maxtext", "MaxText exited 0 but its newest checkpoint is step 1 of 2: the run would read COMPLETED"),
])
def test_an_unsaved_end_is_a_failure_with_its_reason_for_status(tmp_path, which, reason):
    # the trainer exits 0 with its last step unsaved: the supervisor's rule, each launcher's words
    out = run_launcher(tmp_path, which, saved=1, rc=0)
    assert out.returncode == supervisor.EXIT_UNSAVED_END, out.stderr
    assert f"hpcrl: {reason}" in out.stderr
    assert protocol.take_error(tmp_path).startswith(reason)


def test_both_launchers_are_the_one_supervisor_with_their_own_knowledge():
    for cls in (verl.VerlSupervisor, maxtext.MaxTextSupervisor):
        assert issubclass(cls, supervisor.Supervisor)
        # the protocol's machinery is the base's alone: the process group, the exit code, the entry point
        for shared in ("signal_group", "stop_group", "exit_code", "parse_args", "main", "_on_signal"):
            assert shared not in vars(cls), f"{cls.__name__} redefines {shared}"
    assert verl.main == verl.VerlSupervisor.main and maxtext.main == maxtext.MaxTextSupervisor.main


def test_the_deadline_rule_is_the_protocols_for_every_trainer(monkeypatch, tmp_path):
    """StopFlag (the built-in trainer) and both launchers decide "does the next save fit" with
    protocol.next_save_fits: replaced by a spy, every one of them asks it and obeys its answer."""
    asked = []

    def spy(seconds_left, work_s, save_s=0.0, margin_s=0.0):
        asked.append((seconds_left, work_s, save_s, margin_s))
        return answer

    monkeypatch.setattr(protocol, "next_save_fits", spy)
    monkeypatch.setattr(verl, "next_save_fits", spy)
    monkeypatch.setattr(maxtext, "next_save_fits", spy)
    flag = protocol.StopFlag(protocol.Context(tmp_path, tmp_path, 1, time.time() + 10_000, tmp_path / "m"), install=False)
    v_opts = verl.parse_args(["--python", "p", "--ckpt-dir", "c", "--save-freq", "1", "--save-time-s", "300"])
    m_opts = maxtext.parse_args(["--python", "p", "--ckpt-root", "c", "--period", "5"])
    for answer in (True, False):
        asked.clear()
        assert flag.should_stop(1.0, 2.0) is (not answer)
        assert verl.should_stop(v_opts, 10_000, [100.0]) is (not answer)
        assert maxtext.should_stop(m_opts, 10_000, 4.0, 6.0) is (not answer)
        assert len(asked) == 3
    # what each asks with: its own sizing of the work up to the next save
    assert asked[1] == (10_000, 100.0, 300.0, verl.STOP_MARGIN_S)
    assert asked[2] == (10_000, maxtext.PACE_SAFETY * 5 * 4.0 + 4.0, 6.0, maxtext.MARGIN_S)


def test_the_rule_itself():
    assert protocol.next_save_fits(100.0, 50.0, 30.0, 10.0)
    assert not protocol.next_save_fits(90.0, 50.0, 30.0, 10.0)  # exactly the need: does not fit
    assert not protocol.next_save_fits(float("-inf"), 0.0)
    assert protocol.next_save_fits(float("inf"), 1e9, 1e9, 1e9)  # no deadline


def test_dry_runs_show_what_each_would_run(tmp_path):
    for which, module in (("verl", verl), ("maxtext", maxtext)):
        launcher, env = job_launcher(tmp_path, f"hpcrl.job.{which}")
        args = [a.format(ckpt=tmp_path / "ckpt") for a in LAUNCHERS[which][1]]
        out = subprocess.run([*launcher, "--python", "py", *args, "--dry-run", "--", "x=1"], env=env,
                             capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        argv = json.loads(out.stdout)["argv"]
        assert argv[:2] == ["py", "-m"] and "x=1" in argv, argv
        assert not (tmp_path / "ckpt").exists()  # a dry run prepares nothing


@pytest.mark.parametrize("which, code, said", [
    ("verl", 128 + 15, None),  # TERM goes to verl at once; its death by TERM is the segment's code
    ("maxtext", protocol.EXIT_CONTINUE, "stopped MaxText after its committed save of step 1: TERM"),
])
def test_a_term_while_training_reaches_the_trainer_by_each_launchers_policy(tmp_path, which, code, said):
    from helpers import wait_until

    module, args, _ = LAUNCHERS[which]
    ckpt = tmp_path / "ckpt"
    (ckpt / "1").mkdir(parents=True)  # MaxText: an earlier committed save
    stand_in = tmp_path / "stand-in"
    stand_in.write_text(f"#!/bin/bash\ntouch {tmp_path}/started\nsleep 60\nexit 0\n")
    stand_in.chmod(0o755)
    launcher, env = job_launcher(tmp_path, module)
    env.update(protocol_env(tmp_path, deadline=time.time() + 3600))
    proc = subprocess.Popen([*launcher, "--python", str(stand_in), *[a.format(ckpt=ckpt) for a in args], "--", "x=1"],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (tmp_path / "started").exists(), 60, "the stand-in to start", proc=proc)
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    assert said is None or said in err
