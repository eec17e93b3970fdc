"""Run directories, the run registry, and the run's state file (atomic, under a lock).

Layout of a run directory:
    spec.json          the resolved spec and site, frozen at submit (resume never re-derives it)
    job.sh             the segment script every segment executes
    state.json         lifecycle state: run state, segments, queued successor (atomic writes)
    checkpoints/       the trainer's checkpoints (protocol.py layout for hpcrl's trainers)
    logs/job-ID.log    one log per job (segment)
    metrics.jsonl      the trainer's metrics
    lib/hpcrl/         snapshot of the hpcrl package the job imports
The registry ($HPCRL_HOME/registry/RUN) holds each run's directory, so runs may live anywhere
(e.g. $SCRATCH on a cluster) and `status` still finds them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path

from .errors import RunError, did_you_mean
from .paths import hpcrl_home
from .atomicio import atomic_write_json, atomic_write_text

# Run states (what `status` shows).
PENDING, RUNNING, CHECKPOINTING, RESUBMITTED = "PENDING", "RUNNING", "CHECKPOINTING", "RESUBMITTED"
COMPLETED, FAILED, CANCELLED, STOPPED = "COMPLETED", "FAILED", "CANCELLED", "STOPPED"
ACTIVE_STATES = {PENDING, RUNNING, CHECKPOINTING, RESUBMITTED}
FINAL_STATES = {COMPLETED, FAILED, CANCELLED, STOPPED}

# Segment states.
SEG_QUEUED, SEG_RUNNING, SEG_SKIPPED, SEG_CANCELLED = "QUEUED", "RUNNING", "SKIPPED", "CANCELLED"
SEG_CONTINUE, SEG_COMPLETE, SEG_FAILED, SEG_LOST = "CONTINUE", "COMPLETE", "FAILED", "LOST"


def registry_dir() -> Path:
    return hpcrl_home() / "registry"


def register(run_id: str, run_dir: Path) -> None:
    atomic_write_text(registry_dir() / run_id, str(run_dir) + "\n")


def unregister(run_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (registry_dir() / run_id).unlink()


def registered_ids() -> list[str]:
    try:
        return sorted(n for n in os.listdir(registry_dir()) if not n.startswith("."))
    except FileNotFoundError:
        return []


def run_dir_of(run_id: str) -> Path:
    try:
        return Path((registry_dir() / run_id).read_text(encoding="utf-8").strip())
    except (FileNotFoundError, NotADirectoryError):
        ids = registered_ids()
        raise RunError(f"run '{run_id}': no such run{did_you_mean(run_id, ids)}; `hpcrl status` lists runs") from None
    except OSError as e:
        raise RunError(f"run '{run_id}': cannot read its registry entry ({e.strerror})") from None


class Run:
    """One run directory. Read state with `state()`; change it only inside `locked()`."""

    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir)

    @classmethod
    def by_id(cls, run_id: str) -> "Run":
        run = cls(run_dir_of(run_id))
        if not (run.dir / "state.json").is_file():
            raise RunError(f"run '{run_id}': its directory {run.dir} is gone or incomplete")
        return run

    @property
    def id(self) -> str:
        return self.dir.name

    def spec(self) -> dict:
        return json.loads((self.dir / "spec.json").read_text(encoding="utf-8"))

    def state(self) -> dict:
        return json.loads((self.dir / "state.json").read_text(encoding="utf-8"))

    @contextlib.contextmanager
    def locked(self):
        """Exclusive access to state.json across processes (and nodes, where flock works)."""
        with open(self.dir / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                state = self.state()
                yield state
                atomic_write_json(self.dir / "state.json", state)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def new_state(run_id: str, resolved: dict) -> dict:
    return {
        "run_id": run_id,
        "state": PENDING,
        "reason": "",
        "created": time.time(),
        "site": resolved["site"]["name"],
        "scheduler": resolved["site"]["scheduler"],
        "trainer": resolved["spec"]["trainer"],
        "budget": dict(resolved["spec"]["budget"]),  # resume may extend it; the spec stays frozen
        "segments": [],
        "no_progress": 0,
        "events": [],
    }


def add_event(state: dict, what: str) -> None:
    state["events"].append({"time": round(time.time(), 3), "what": what})
    del state["events"][:-200]  # bounded: state.json is rewritten on every change


def segment_by_job(state: dict, job_id: str) -> dict | None:
    for seg in state["segments"]:
        if seg.get("job_id") == str(job_id):
            return seg
    return None


def used_hours(state: dict, now: float | None = None) -> float:
    total = 0.0
    for seg in state["segments"]:
        if seg.get("started"):
            end = seg.get("ended") or (now if seg["state"] == SEG_RUNNING else seg["started"]) or seg["started"]
            total += max(0.0, end - seg["started"])
    return total / 3600.0


def ran_segments(state: dict) -> int:
    return sum(1 for s in state["segments"] if s.get("started"))
