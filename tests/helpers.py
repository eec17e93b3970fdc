"""The tests' shared helpers: one waiting primitive and the small things many tests repeat.

Importable as `helpers` from every test module (tests/ and tests/rl/): pytest puts tests/ on
sys.path for tests/conftest.py. Fixtures stay in conftest.py.

Waiting never changes what it waits on: `wait_for_run` reads the run's state.json and asks the
run's backend about its jobs (a read), and never calls `hpcrl status` (which reconciles a run
with its scheduler and may mark it STOPPED). A test that wants reconciliation calls status.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A hostile value for every quoting path: quotes, command substitution, backticks, newline.
HOSTILE = "a'; touch /tmp/PWNED-hpcrl #\"$(touch /tmp/PWNED-hpcrl2)`touch /tmp/PWNED-hpcrl3`\nx;y"
PWNED = [Path("/tmp/PWNED-hpcrl"), Path("/tmp/PWNED-hpcrl2"), Path("/tmp/PWNED-hpcrl3")]

RUN_END_STATES = ("COMPLETED", "FAILED", "CANCELLED", "STOPPED")


# ---------------------------------------------------------------- waiting


def wait_until(predicate, timeout: float, what: str, poll: float = 0.05, proc=None, describe=None):
    """Poll `predicate()` until it returns something truthy, and return that.

    Fails the test after `timeout` seconds, saying `what` it waited for and, when given,
    `describe()` (the last thing seen). With `proc` (a Popen with piped output), fails at once
    with its output when the process exits first.
    """
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"process exited ({proc.returncode}) before {what}:\n{out}\n{(err or '')[-3000:]}")
        if time.monotonic() >= end:
            seen = f": {describe()}" if describe is not None else ""
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}{seen}")
        time.sleep(poll)


def wait_for_run(run_id: str, states=RUN_END_STATES, timeout: float = 180, poll: float = 0.2) -> dict:
    """The run's state once it is in one of `states` with no segment and no job of it alive."""
    from hpcrl.backends import get_backend
    from hpcrl.runs import Run

    run = Run.by_id(run_id)
    site = run.spec()["site"]
    backend = get_backend(site["scheduler"], site)

    def settled():
        state = run.state()
        if state["state"] not in states or any(s["state"] in ("RUNNING", "QUEUED") for s in state["segments"]):
            return None
        jobs = [s["job_id"] for s in state["segments"] if s.get("job_id")]
        infos = backend.poll([(run, j) for j in jobs]) if jobs else {}
        return None if any(not info.state.finished for info in infos.values()) else state

    return wait_until(settled, timeout, f"run {run_id} to reach {'/'.join(states)} with no job left", poll,
                      describe=lambda: _state_summary(run.state()))


def _state_summary(state: dict) -> str:
    segs = ", ".join(f"{s.get('job_id')}:{s['state']}" for s in state["segments"])
    return f"{state['state']} ({state.get('reason') or '-'}); segments {segs or 'none'}"


def wait_for_job(backend, job_id: str, predicate, timeout: float, poll: float = 0.5):
    """The backend's JobInfo of `job_id` once predicate(info) holds."""
    seen = {}

    def check():
        seen["info"] = info = backend.query([job_id])[job_id]
        return info if predicate(info) else None

    return wait_until(check, timeout, f"job {job_id}", poll,
                      describe=lambda: f"still {seen['info'].state.value} ({seen['info'].reason})" if seen else "")


def wait_for_step(run_dir: Path, step: int, timeout: float = 120, proc=None) -> int:
    """The last training step in the run's metrics once it is at least `step`."""
    return wait_until(lambda: (last := last_step(run_dir)) >= step and last, timeout, f"step {step}",
                      proc=proc, describe=lambda: f"last step {last_step(run_dir)}")


# ---------------------------------------------------------------- runs and the CLI


def hpcrl(*args, check=True, env=None, timeout=120, cwd=None):
    """Run the real CLI as a subprocess; returns CompletedProcess with text output."""
    proc = subprocess.run([sys.executable, "-m", "hpcrl.cli", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"hpcrl {' '.join(map(str, args))} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_dir(run_id: str) -> Path:
    """The run's directory, from the registry (no `status` call)."""
    from hpcrl.runs import Run

    return Run.by_id(run_id).dir


def log_tails(run_dir: Path, lines: int = 15) -> str:
    """The last lines of each segment's job log: what an assertion on a run's segments prints,
    so that a failure in CI (where the run directory is gone afterwards) says why."""
    out = []
    for log in sorted((run_dir / "logs").glob("job-*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {log.name}\n" + "\n".join(tail))
    return "\n".join(out) or f"(no job logs under {run_dir / 'logs'})"


def run_state(run_id: str) -> dict:
    from hpcrl.runs import Run

    return Run.by_id(run_id).state()


def started(state: dict) -> list[dict]:
    """The segments of a run that ran (in order)."""
    return [s for s in state["segments"] if s.get("started")]


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_step(run_dir: Path) -> int:
    """The newest training step recorded (evaluation records, which repeat a step, left out)."""
    steps = [r["step"] for r in read_metrics(run_dir) if r.get("phase") in (None, "sft", "train")]
    return max(steps, default=0)


# ---------------------------------------------------------------- checkpoints


def trainer_pids(run_dir: Path, module: str = "hpcrl.rl.train", under: bool = False) -> list[int]:
    """The processes of this run that run `python -m MODULE` (found by their HPCRL_RUN_DIR; a
    Slurm test cluster's jobs share this machine's process table). under=True: any run dir below
    `run_dir` (a fake TPU VM's, whose path the VM's startup script chooses)."""
    out = []
    for proc in processes_with(f"HPCRL_RUN_DIR={run_dir}{'/' if under else chr(0)}".encode()):
        try:
            if module.encode() in (proc / "cmdline").read_bytes():
                out.append(int(proc.name))
        except OSError:
            continue
    return out


def processes_with(tag: bytes) -> list[Path]:
    """The /proc entries of the processes whose environment holds `tag` (those this user may read)."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and tag in (proc / "environ").read_bytes():
                out.append(proc)
        except OSError:
            continue
    return out


@contextlib.contextmanager
def trainer_paused(run_dir: Path, timeout: float = 60, **which):
    """The run's trainer held (SIGSTOP) between two steps' worth of anything: what the test does
    meanwhile (a CLI call, slow on a loaded machine) cannot race the trainer to the run's end. A
    signal sent to it meanwhile is delivered when it continues, as on a slow node (`pending`
    tells when it has arrived). `which`: trainer_pids's module and under."""
    pids = wait_until(lambda: trainer_pids(run_dir, **which), timeout, "the run's trainer process")
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield pids
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def pending(pid: int, sig: int) -> bool:
    """Whether `sig` waits to be delivered to process `pid` (one held by trainer_paused)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    masks = [int(ln.split()[1], 16) for ln in status.splitlines() if ln.startswith(("SigPnd:", "ShdPnd:"))]
    return any(m >> (sig - 1) & 1 for m in masks)


def publish_checkpoint(ckpt_dir: Path, step: int, files: dict | None = None, keep_last: int = 3) -> Path:
    """Seal a checkpoint of `files` (name -> bytes) at `step` in hpcrl's store; its path."""
    from hpcrl.checkpoints.store import CheckpointStore

    store = CheckpointStore(ckpt_dir, keep_last)
    tmp = store.new_tmp_dir()
    for name, data in (files or {"weights.bin": b"x" * 1000}).items():
        (tmp / name).write_bytes(data)
    return store.publish(tmp, step)


def flip_bit(path: Path, at: float = 0.75) -> None:
    """Flip one bit of the byte at fraction `at` of the file: same size, only a digest can tell."""
    data = bytearray(Path(path).read_bytes())
    data[int(len(data) * at)] ^= 0x01
    Path(path).write_bytes(bytes(data))


# ---------------------------------------------------------------- what a trainer is given


def protocol_env(run_dir: Path, segment: int = 1, deadline: float | None = None) -> dict:
    """The walltime protocol's variables as the segment script sets them for a run directory."""
    from hpcrl import protocol

    run_dir = Path(run_dir)
    env = {protocol.ENV_RUN_DIR: str(run_dir), protocol.ENV_CKPT_DIR: str(run_dir / "checkpoints"),
           protocol.ENV_SEGMENT: str(segment), protocol.ENV_METRICS: str(run_dir / protocol.METRICS_FILE)}
    if deadline is not None:
        env[protocol.ENV_DEADLINE] = f"{deadline:.3f}"
    return env


def protocol_context(run_dir: Path, segment: int = 1, deadline: float | None = None):
    """The protocol.Context a trainer started by the segment script would read."""
    from hpcrl import protocol

    return protocol.Context.from_env(protocol_env(run_dir, segment, deadline))


def adapter_context(trainer, args: dict, run_dir, site: dict | None = None, resources: dict | None = None,
                    python: str = "python3", run_id: str = "r-1"):
    """A launcher-side TrainerContext for `trainer` with its validated `args`."""
    from hpcrl.trainers.base import TrainerContext

    run_dir = Path(run_dir)
    return TrainerContext(run_id=run_id, run_dir=run_dir, ckpt_dir=run_dir / "checkpoints",
                          args=trainer.validate_args(args), site=site or {}, resources=resources or {}, python=python)


# ---------------------------------------------------------------- the fake gcloud (a TEST DOUBLE)


FAKE_GCLOUD = ROOT / "tests" / "fake_gcloud"


def use_fake_gcloud(monkeypatch, root: Path) -> tuple[Path, Path]:
    """Put the fake gcloud first on PATH with its record dir and gs:// root under `root`:
    (fake dir with calls.jsonl and scenario.json, the local directory gs:// maps to)."""
    import os

    fake, gcs = Path(root) / "fake", Path(root) / "gcs"
    fake.mkdir(parents=True, exist_ok=True)
    gcs.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("PATH", f"{FAKE_GCLOUD}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_GCLOUD_DIR", str(fake))
    monkeypatch.setenv("FAKE_GCS_ROOT", str(gcs))
    return fake, gcs


def job_launcher(tmp_path: Path, module: str) -> tuple[list[str], dict]:
    """How the segment script runs a job-side launcher: `python -m hpcrl.job.X` with PYTHONPATH at
    a lib/ snapshot of hpcrl (copied as control.py copies it). -s -S: no site-packages, so the
    launcher has only the stdlib and the snapshot, as in a trainer venv without hpcrl."""
    import shutil

    lib = tmp_path / "lib"
    if not lib.exists():
        pkg = Path(__file__).resolve().parents[1] / "hpcrl"
        shutil.copytree(pkg, lib / "hpcrl", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    return [sys.executable, "-s", "-S", "-m", module], {**env, "PYTHONPATH": str(lib)}


def stand_in_verl_inputs(tmp_path: Path, rows: int = 2048) -> tuple[Path, Path, Path]:
    """A model directory and train/test parquet files for specs whose verl is a stand-in that reads
    none of them: submit checks that the model directory holds config.json and that the data has
    the prompt column and a batch's rows, in the job's interpreter, before anything is queued."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = tmp_path / "stand-in-model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}\n")
    files = []
    for name in ("train", "test"):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"prompt": [f"stand-in {i}" for i in range(rows)]}), path)
        files.append(path)
    return model, files[0], files[1]


# The CPU priority the deadline tiers give their jobs (see dedicated_node): nice -10 weighs ~9x a
# nice-0 process in the kernel's fair scheduler.
DEDICATED_NICE = -10


@contextlib.contextmanager
def dedicated_node(home: Path, nice: int = DEDICATED_NICE, poll: float = 1.0):
    """While inside: every process of the runs under `home` (the job's shell, the trainer, its Ray
    workers, Slurm's steps: all carry HPCRL_RUN_DIR=<home>/runs/... in their environment), each
    thread of it, gets CPU priority `nice`, as on a node that runs nothing else.

    Why: the tiers whose segments end at a wall-clock deadline (verl's ESI save, MaxText's save
    before the stop) need the trainer's start-up to fit in a segment. Beside the rest of the suite
    (~6 test workers and their trainers on 2 cores, load 15-24) verl's start-up, ~55 s alone, took
    over 6 minutes (CI of 2026-12-06: three segments killed before their first step). What those
    tests assert is hpcrl's protocol at the deadline, not how long a start-up takes on a shared
    CPU; every bound they have stays as it was. Raising priority needs root (CAP_SYS_NICE): as a
    regular user this changes nothing, and the tests run as before.

    What it does not do: where the kernel's autogroup scheduling is on (this machine:
    /proc/sys/kernel/sched_autogroup_enabled is 1), the CPU is shared between sessions first, and a
    thread's nice weighs only against the threads of its own session; a segment (setsid) is a
    session of its own. Measured in session 23 (BENCHMARKS.md): the SmolLM2 run's trainer got the
    same 0.3-0.5 of a core at nice -5 and -10 as at 0. The tiers' longer first segments are what
    holds their start-ups; a session's own weight would be /proc/PID/autogroup (not set here)."""
    import threading

    tag = f"HPCRL_RUN_DIR={home}/runs/".encode()
    stop = threading.Event()

    def raise_all():
        # every thread of every tagged process, each time: pids are reused (pid_max 32768 here),
        # and a thread started by a process at nice 0 (slurmstepd's, a Ray worker that set its
        # own) does not inherit the priority; ~300 environ reads a second cost milliseconds
        for proc in processes_with(tag):
            try:
                tids = [int(t.name) for t in (proc / "task").iterdir()]
            except OSError:
                continue  # gone
            for tid in tids:
                try:
                    if os.getpriority(os.PRIO_PROCESS, tid) != nice:
                        os.setpriority(os.PRIO_PROCESS, tid, nice)
                except OSError:
                    pass  # gone, or not allowed (a regular user: the priority stays)

    def loop():
        while not stop.wait(poll):
            raise_all()

    worker = threading.Thread(target=loop, name="dedicated-node", daemon=True)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join(timeout=10)
