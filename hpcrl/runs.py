"""The run directory (its one layout model), the run registry, and the state file (atomic, locked).

`RunLayout` is the only place that spells out where things live in a run directory; every
module and template takes paths from it (the segment script gets them rendered in). A layout
can be rooted elsewhere than the launcher's copy: a TPU VM runs the same files under its own
root (see Backend.job_layout).

The registry ($HPCRL_HOME/registry/RUN) holds each run's directory, so runs may live anywhere
(e.g. $SCRATCH on a cluster) and `status` still finds them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

from .atomicio import atomic_write_json, atomic_write_text
from .errors import RunError, did_you_mean
from .paths import hpcrl_home
from .samplestore import SAMPLES_DIR


class RunLayout:
    """Where each file of a run lives, under `root`. Immutable. (A plain class, not a dataclass:
    `status` imports this module, and dataclasses pulls in inspect, ~10 ms of every start.)"""

    __slots__ = ("root",)

    def __init__(self, root):
        object.__setattr__(self, "root", Path(root))

    def __setattr__(self, name, value):
        raise AttributeError("RunLayout is immutable")

    def __eq__(self, other):
        return isinstance(other, RunLayout) and other.root == self.root

    def __hash__(self):
        return hash(self.root)

    def __repr__(self):
        return f"RunLayout(root={self.root!r})"

    @property
    def spec(self) -> Path:  # the resolved spec and site, frozen at submit (budget: see state)
        return self.root / "spec.json"

    @property
    def script(self) -> Path:  # the segment script every segment executes
        return self.root / "job.sh"

    @property
    def state(self) -> Path:  # lifecycle state (hpcrl.lifecycle), the budget's one owner
        return self.root / "state.json"

    @property
    def lock(self) -> Path:
        return self.root / ".lock"

    @property
    def checkpoints(self) -> Path:  # the trainer's checkpoints (hpcrl.checkpoints.store layout for hpcrl's)
        return self.root / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, job_id) -> Path:  # one log per job (segment)
        return self.logs / f"job-{job_id}.log"

    def log_pattern(self, job_id_placeholder: str) -> Path:  # e.g. Slurm's %j
        return self.logs / f"job-{job_id_placeholder}.log"

    @property
    def metrics(self) -> Path:  # the trainer's metrics (JSON lines)
        return self.root / "metrics.jsonl"

    @property
    def samples(self) -> Path:  # the built-in trainer's samples of its steps (hpcrl/samplestore.py)
        return self.root / SAMPLES_DIR

    @property
    def exports(self) -> Path:  # one JSON line per `hpcrl export`: where, from which step and digest
        return self.root / "exports.jsonl"

    @property
    def lib(self) -> Path:
        # A snapshot of the hpcrl package taken at submit: the job imports it, so a run keeps
        # working with the code it was created with even if hpcrl is upgraded meanwhile.
        return self.root / "lib"

    @property
    def requirements(self) -> Path:
        return self.root / "requirements.txt"

    @property
    def checkpointing_flag(self) -> Path:  # exists while a segment saves for its walltime
        return self.root / ".checkpointing"

    def trainer_rc(self, job_id) -> Path:
        return self.root / f".trainer-rc-{job_id}"

    def trainer_stop(self, job_id) -> Path:  # HPCRL_STOP_FILE: USR1 for ranks under torchrun/srun
        return self.root / f".trainer-stop-{job_id}"

    def trainer_exit(self, job_id) -> Path:  # HPCRL_EXIT_FILE: their protocol exit code
        return self.root / f".trainer-exit-{job_id}"

    @property
    def checkpoint_cache(self) -> Path:
        # The newest checkpoint step of a trainer whose checkpoints are remote (gs://), written
        # by whoever can list them (the job's end hook, a watcher) so `status` never has to.
        return self.root / ".checkpoint-step.json"

    def private(self, owner: str) -> Path:
        """A directory a backend keeps its own records in (.queue for local, .tpu for TPU)."""
        return self.root / f".{owner}"

    def file(self, name: str) -> Path:
        """A file a trainer adapter writes at submit (its name relative to the run dir)."""
        return self.root / name


def registry_dir() -> Path:
    return hpcrl_home() / "registry"


def check_run_id(run_id) -> str:
    """A run id is a run name: nothing else may reach the registry's file system paths."""
    from .names import RUN_ID_RE

    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
        raise RunError(f"run {run_id[:100]!r}: not a run id (letters, digits and . _ -); `hpcrl status` lists runs")
    return run_id


def register(run_id: str, run_dir: Path) -> None:
    atomic_write_text(registry_dir() / check_run_id(run_id), str(run_dir) + "\n")


def unregister(run_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (registry_dir() / check_run_id(run_id)).unlink()


def registered_ids() -> list[str]:
    try:
        return sorted(n for n in os.listdir(registry_dir()) if not n.startswith("."))
    except FileNotFoundError:
        return []


def resolve_id(text: str) -> str:
    """The run id a user means: the id itself, or the one id starting with `text` (a prefix that
    matches several runs lists them)."""
    check_run_id(text)
    if (registry_dir() / text).is_file():
        return text
    ids = registered_ids()
    matches = [i for i in ids if i.startswith(text)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        shown = ", ".join(matches[:8]) + (f" and {len(matches) - 8} more" if len(matches) > 8 else "")
        raise RunError(f"run '{text}': {len(matches)} runs start with it ({shown}); give more of the id")
    raise RunError(f"run '{text}': no such run{did_you_mean(text, ids)}; `hpcrl status` lists runs")


def run_dir_of(run_id: str) -> Path:
    run_id = resolve_id(run_id)
    try:
        return Path((registry_dir() / run_id).read_text(encoding="utf-8").strip())
    except (FileNotFoundError, NotADirectoryError):
        raise RunError(f"run '{run_id}': no such run; `hpcrl status` lists runs") from None
    except OSError as e:
        raise RunError(f"run '{run_id}': cannot read its registry entry ({e.strerror})") from None


class Run:
    """One run directory. Read state with `state()`; change it only inside `locked()`."""

    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir)
        self.layout = RunLayout(self.dir)

    @classmethod
    def by_id(cls, run_id: str) -> "Run":
        """The run of an id or of a unique prefix of one."""
        run = cls(run_dir_of(run_id))
        if not run.layout.state.is_file():
            raise RunError(f"run '{run_id}': its directory {run.dir} is gone or incomplete")
        return run

    @property
    def id(self) -> str:
        return self.dir.name

    def spec(self) -> dict:
        """The frozen resolved spec and site, with the budget as it is now (from state.json)."""
        resolved = json.loads(self.layout.spec.read_text(encoding="utf-8"))
        resolved["spec"]["budget"] = dict(self.state()["budget"])
        return resolved

    def site(self) -> dict:
        """The run's resolved site profile (frozen at submit; no state read)."""
        return json.loads(self.layout.spec.read_text(encoding="utf-8"))["site"]

    def state(self) -> dict:
        return json.loads(self.layout.state.read_text(encoding="utf-8"))

    @contextlib.contextmanager
    def locked(self):
        """Exclusive access to state.json across processes (and nodes, where flock works)."""
        with open(self.layout.lock, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                state = self.state()
                yield state
                atomic_write_json(self.layout.state, state)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def frozen_spec(resolved: dict) -> dict:
    """What spec.json holds: the resolved spec without the budget, whose one owner is state.json
    (resume changes it there)."""
    spec = {k: v for k, v in resolved["spec"].items() if k != "budget"}
    return {**resolved, "spec": spec}
