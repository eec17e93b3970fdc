"""SlurmBackend against the real throwaway cluster (scripts/slurm-cluster start).

Timing facts these tests lean on (notes/slurm-dev-cluster.md): the scheduler runs every 5 s,
limits are checked on a 30 s tick, so a 1-minute job is killed 60-90 s after it starts and its
--signal warning may come up to 30 s early. Every job submitted is cancelled at teardown.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import pytest

from hpcrl.backends.base import JobState
from hpcrl.proc import run_command
from hpcrl.backends.slurm import sbatch_directives

from helpers import wait_for_job, wait_until

# The root conftest imports these too; importing here keeps this file runnable on its own.
try:
    from .slurm_fixture import slurm_backend, slurm_cluster  # noqa: F401  (tests/ as a package)
except ImportError:
    from slurm_fixture import slurm_backend, slurm_cluster  # noqa: F401  (rootdir-relative import)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]

# How long a job of these tests may wait to start: the default partition's two nodes are shared
# with the tests beside them, and a job on both (the two-node Ray test's asks for all 128 CPUs of
# each) held a job of this file pending past 30 s in a run beside a CPU hog
START_S = 240


def _script(run_dir: Path, name: str, body: str, **opts) -> Path:
    directives = {"job-name": f"hpcrl-test-{name}", "output": f"{run_dir}/{name}-%j.out", "time": 1, **opts}
    path = run_dir / f"{name}.sh"
    path.write_text("#!/bin/bash\n" + "\n".join(sbatch_directives(directives)) +
                    f"\nRUN={shlex.quote(str(run_dir))}\n" + body)
    return path


# Waits (at most ~50 s) for the test to create $RUN/go, then exits with the given code.
_WAIT_FOR_GO = """
date +%s > "$RUN/started-$SLURM_JOB_ID"
for _ in $(seq 100); do [ -e "$RUN/go" ] && exit {code}; sleep 0.5; done
exit 99
"""


def test_submit_query_running_then_completed(slurm_backend, tmp_path):
    job = slurm_backend.sbatch(_script(tmp_path, "one", _WAIT_FOR_GO.format(code=0)))
    assert job.isdigit()
    assert slurm_backend.query([job])[job].state in (JobState.PENDING, JobState.RUNNING)

    running = wait_for_job(slurm_backend, job, lambda i: i.state is JobState.RUNNING, timeout=START_S)
    assert abs(running.start_time - time.time()) < 60
    # a running job's end is its limit: the segment's deadline is computed from it
    assert running.end_time == running.start_time + 60 and running.exit_code is None

    (tmp_path / "go").touch()
    done = wait_for_job(slurm_backend, job, lambda i: i.state.finished, timeout=30)
    assert (done.state, done.exit_code, done.reason) == (JobState.COMPLETED, 0, "")
    assert done.start_time <= done.end_time
    assert (tmp_path / f"started-{job}").is_file()  # the script really ran, with its own job id


def test_afterany_successor_runs_after_a_failed_predecessor(slurm_backend, tmp_path):
    first = slurm_backend.sbatch(_script(tmp_path, "first", _WAIT_FOR_GO.format(code=3)))
    second = slurm_backend.sbatch(_script(tmp_path, "second", 'date +%s > "$RUN/second-ran"\n'),
                                  after=first)
    wait_for_job(slurm_backend, first, lambda i: i.state is JobState.RUNNING, timeout=START_S)
    time.sleep(2)  # a scheduler that ignored the dependency would have started it by now
    waiting = slurm_backend.query([second])[second]
    assert (waiting.state, waiting.reason) == (JobState.PENDING, "Dependency")
    assert not (tmp_path / "second-ran").exists()

    (tmp_path / "go").touch()
    after = wait_for_job(slurm_backend, second, lambda i: i.state.finished, timeout=START_S)
    before = slurm_backend.query([first])[first]
    assert (before.state, before.exit_code) == (JobState.FAILED, 3)  # afterany: runs after a failure too
    assert after.state is JobState.COMPLETED
    gap_s = after.start_time - before.end_time
    print(f"resubmit gap (end of job {first} to start of job {second}): {gap_s:.0f} s")
    assert 0 <= gap_s <= 15, f"successor started {gap_s:.0f} s after its predecessor ended (sched_interval=5)"


def _dead_or_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (FileNotFoundError, IndexError):
        return True


def test_cancel_running_and_pending(slurm_backend, tmp_path):
    body = 'sleep 300 & echo $! > "$RUN/sleep.pid"; wait\n'
    running = slurm_backend.sbatch(_script(tmp_path, "victim", body))
    queued = slurm_backend.sbatch(_script(tmp_path, "queued", "true\n"), after=running)
    wait_for_job(slurm_backend, running, lambda i: i.state is JobState.RUNNING, timeout=START_S)
    pid_file = tmp_path / "sleep.pid"
    wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), 60, "the job's sleep to start")
    pid = int(pid_file.read_text())

    slurm_backend.cancel([running, queued])
    for job in (running, queued):
        info = wait_for_job(slurm_backend, job, lambda i: i.state.finished, timeout=20)
        assert info.state is JobState.CANCELLED, job
    deadline = time.monotonic() + 15  # KillWait=5
    while not _dead_or_zombie(pid) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert _dead_or_zombie(pid), f"the cancelled job's process {pid} still runs"
    slurm_backend.cancel([running, queued])  # cancelling finished jobs again is not an error


def test_unknown_job_reads_unknown(slurm_backend):
    infos = slurm_backend.query(["999999"])
    assert infos["999999"].state is JobState.UNKNOWN
    assert slurm_backend.query([]) == {}


@pytest.mark.parametrize("value", ["a'; touch /tmp/PWNED #", "$(id)", "`id`", 'say "hi" \\ there', "x#y"])
def test_directive_values_reach_slurm_verbatim(slurm_backend, tmp_path, value):
    # A held job never runs; it only shows how sbatch parsed the #SBATCH line.
    job = slurm_backend.sbatch(_script(tmp_path, "held", "true\n", comment=value, hold=True))
    comment = run_command(["squeue", "-h", "-t", "all", "-j", job, "-o", "%k"]).stdout.rstrip("\n")
    assert comment == value


_TRAP_USR1 = """
trap 'date +%s > "$RUN/usr1"' USR1
sleep 300 &
child=$!
# A trap runs only between commands: wait again after each signal until the child is gone.
while kill -0 "$child" 2>/dev/null; do wait "$child"; done
"""


def test_walltime_kill_is_timeout_after_usr1_to_the_batch_shell(slurm_backend, tmp_path):
    job = slurm_backend.sbatch(_script(tmp_path, "walltime", _TRAP_USR1, signal="B:USR1@30"))
    info = wait_for_job(slurm_backend, job, lambda i: i.state.finished, timeout=150, poll=2)
    assert (info.state, info.reason) == (JobState.TIMEOUT, "TimeLimit")
    assert 60 <= info.end_time - info.start_time <= 100  # 1 min + up to one 30 s limit tick
    marker = tmp_path / "usr1"
    assert marker.is_file(), "the batch shell never got USR1 before the walltime"
    assert info.start_time <= int(marker.read_text()) <= info.end_time
    print(f"USR1 {int(marker.read_text()) - info.start_time:.0f} s after start; "
          f"killed {info.end_time - info.start_time:.0f} s after start")
