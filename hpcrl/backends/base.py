"""What every backend offers, the one job-state enum, and the one helper that runs commands."""

from __future__ import annotations

import enum
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import BackendError


class JobState(str, enum.Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"  # the job's script exited 0 (whatever the trainer did)
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    PREEMPTED = "PREEMPTED"
    UNKNOWN = "UNKNOWN"  # the scheduler no longer knows the job (purged) or could not say

    @property
    def finished(self) -> bool:
        return self not in (JobState.PENDING, JobState.RUNNING)


@dataclass
class JobInfo:
    """A job as its scheduler sees it. end_time: when it ended, or for a running job when the
    scheduler will end it (its limit)."""

    job_id: str
    state: JobState
    reason: str = ""
    start_time: float | None = None
    end_time: float | None = None
    exit_code: int | None = None


@dataclass
class CommandResult:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


def run_command(argv: list[str], timeout_s: float = 60, check: bool = True, input_text: str | None = None,
                env: dict | None = None) -> CommandResult:
    """Run a scheduler command; on failure raise BackendError with argv and the stderr tail."""
    exe = argv[0]
    if shutil.which(exe) is None and "/" not in exe:
        raise BackendError(f"'{exe}' is not on PATH; run hpcrl where the scheduler's commands are installed (a login node)")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, input=input_text,
                              env=env, stdin=None if input_text is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise BackendError(f"'{' '.join(argv[:3])} ...' did not answer within {timeout_s:.0f} s; is the scheduler up?") from None
    result = CommandResult(argv, proc.returncode, proc.stdout, proc.stderr)
    if check and proc.returncode != 0:
        raise BackendError(f"{' '.join(argv[:2])} failed: {stderr_tail(result)}")
    return result


def stderr_tail(result: CommandResult) -> str:
    """One line for the user: the last two non-empty stderr lines (or the exit code)."""
    lines = [ln.strip() for ln in (result.stderr or "").splitlines() if ln.strip()]
    return " ".join(lines[-2:])[:400] or f"exit code {result.returncode}"


class Backend:
    """A scheduler. `submit` queues a rendered script; `query`/`cancel` act on job ids."""

    name = "base"
    # True when the backend supports `--dependency=afterany`-style successors.
    chains_successors = True

    def __init__(self, site: dict):
        self.site = site

    def complete_site(self, site: dict) -> dict:
        """Fill in and check site values this scheduler knows itself (TPU: gcloud's project/zone)."""
        return site

    def dry_run(self, resolved: dict, run_id: str, job_script: str) -> str:
        """What `render` shows: the segment script, plus anything else submit would send."""
        return job_script

    def submit(self, script: Path, run_dir: Path, job_name: str, after: str | None = None) -> str:
        """Queue `script`; if `after` is a job id, start only after that job ends (any way)."""
        raise NotImplementedError

    def query(self, job_ids: list[str], run_dir: Path | None = None) -> dict[str, JobInfo]:
        """State of each job id (run_dir: where a backend keeps per-run queue files, if any)."""
        raise NotImplementedError

    def cancel(self, job_ids: list[str], run_dir: Path | None = None) -> None:
        raise NotImplementedError

    def current_job_id(self, environ) -> str | None:
        """Inside a job: this job's id from the environment."""
        raise NotImplementedError

    def end_time(self, job_id: str, run_dir: Path, environ) -> float | None:
        """Inside a job: when the scheduler will end it (unix s), from the scheduler itself."""
        info = self.query([job_id], run_dir=run_dir).get(job_id)
        return info.end_time if info else None
