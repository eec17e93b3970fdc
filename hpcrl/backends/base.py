"""What every backend offers (the hooks, documented on Backend) and the one job-state enum.
Scheduler commands run through hpcrl.proc.run_command."""

from __future__ import annotations

import enum
from dataclasses import dataclass


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
class Check:
    """One line of `hpcrl doctor`: status is pass, warn or fail; fix says what to do (not for pass)."""

    name: str
    status: str
    detail: str
    fix: str = ""


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
class RankLaunch:
    """How a torchrun trainer's ranks start under this scheduler (Backend.rank_launch). Every
    element is trusted shell text: literal values quoted by hpcrl.shell.q, variables as Word."""

    prelude: str  # bash run before the trainer (sets the variables the words below use); may be ''
    prefix: list  # argv before torchrun: what starts one torchrun per node (srun ...); [] for none
    rendezvous: list  # torchrun's rendezvous options


class Backend:
    """A scheduler: everything hpcrl knows about one lives in its backend module.

    Adding a scheduler = one module with a subclass of this (registered in backends/__init__.py)
    and a site YAML. Every hook below has a default that fits a scheduler which queues its own
    successors (Slurm-like); what a subclass must write is marked "must".

    Site: `site_keys` are the site-profile keys this backend adds (with defaults); spec.py merges
    them into the profile and rejects unknown ones. `complete_site` fills in what the scheduler
    knows itself and checks the values.
    Script: `directives` (header lines), `job_id_variable` (the environment variable that holds
    the job's id inside the job), `job_layout` (the run directory as the job sees it).
    Lifecycle: `submit`, `poll` (state of many jobs at once: what `status` uses), `query`,
    `cancel`, `end_time` (inside the job: when the scheduler will stop it).
    Reconciling: a backend whose jobs cannot queue their own successor sets
    `reconciles_outside_job` and implements `reconcile(run, ops)`, one step of a watcher.
    """

    name = "base"
    site_keys: dict = {}
    # True when jobs cannot queue a successor from inside (TPU VMs): `reconcile` keeps the chain.
    reconciles_outside_job = False
    # Inside a job: the environment variable holding its id (None: HPCRL_JOB_ID set by hpcrl).
    job_id_variable: str | None = None
    job_id_missing = "run this script through hpcrl: the local backend sets HPCRL_JOB_ID"
    # Jobs see this machine's modules, Python and venv_root (a login node and its compute nodes
    # share them); False where jobs run elsewhere (a TPU VM): `hpcrl doctor` then skips those.
    jobs_share_this_environment = True

    def __init__(self, site: dict):
        self.site = site

    def next_job_here(self, state: dict, job_id: str) -> str:
        """Inside job `job_id` of a machine that runs the run's next segment itself (a TPU VM,
        `_segment next`): the next segment's job id. Schedulers with a walltime cannot."""
        from ..errors import BackendError

        raise BackendError(f"the {self.name} backend cannot run a next segment inside job {job_id}")

    # -- site and script

    def complete_site(self, site: dict) -> dict:
        """Fill in and check site values this scheduler knows itself (TPU: gcloud's project/zone)."""
        return site

    def directives(self, resolved: dict, run_id: str, layout) -> list[str]:
        """Header lines of the segment script after #!/bin/bash (resources, walltime, signal)."""
        return []

    def job_id_line(self) -> str:
        """The bash line that exports HPCRL_JOB_ID inside the job."""
        if self.job_id_variable:
            return f'export HPCRL_JOB_ID="${self.job_id_variable}"'
        return f'export HPCRL_JOB_ID="${{HPCRL_JOB_ID:?{self.job_id_missing}}}"'

    def current_job_id(self, environ) -> str | None:
        """Inside a job: this job's id from the environment."""
        return environ.get(self.job_id_variable or "HPCRL_JOB_ID") or None

    def job_layout(self, run_id: str, layout):
        """The run directory as the job sees it (a TPU VM has its own copy elsewhere)."""
        return layout

    def rank_launch(self, resolved: dict) -> RankLaunch:
        """One torchrun per node of the job, and where their rendezvous is (a world of more than one
        rank: resources.nodes x resources.ranks_per_node). SpecError where this scheduler cannot."""
        from ..errors import SpecError

        raise SpecError(f"resources.ranks_per_node / resources.nodes: the {self.name} scheduler cannot start "
                        f"the ranks of a torchrun trainer; use nodes: 1 and ranks_per_node: 1")

    def dry_run(self, resolved: dict, run_id: str, job_script: str) -> str:
        """What `render` shows: the segment script, plus anything else submit would send."""
        return job_script

    def submit_hint(self, run_id: str) -> list[str]:
        """Extra lines `hpcrl submit` prints (what the user must keep doing, if anything)."""
        return []

    def doctor(self, site: dict) -> list[Check]:
        """`hpcrl doctor`'s checks of this scheduler for a site (the scheduler answers, the account,
        the QOS table, features and GPUs, credentials): each a Check, never an exception."""
        return []

    # -- jobs

    def submit(self, run, resolved: dict, after: str | None = None) -> str:
        """Must: queue the run's job script (run: hpcrl.runs.Run; resolved: its spec and site with
        the budget as it is now); if `after` is a job id, start only after that job ends (any
        way); return the job id."""
        raise NotImplementedError

    def query(self, job_ids: list[str], run=None) -> dict[str, JobInfo]:
        """Must: state of each job id (run: where a backend keeps per-run records, if any)."""
        raise NotImplementedError

    def poll(self, jobs: list[tuple]) -> dict[str, JobInfo]:
        """State of many jobs of many runs at once, [(run, job_id), ...] -> {job_id: info}, with a
        bounded number of scheduler calls whatever the number of runs (`status` uses this).
        The default asks `query` once per run: right for backends whose query reads files."""
        out: dict[str, JobInfo] = {}
        by_run: dict = {}
        for run, job_id in jobs:
            by_run.setdefault(run.dir, (run, []))[1].append(job_id)
        for run, ids in by_run.values():
            out.update(self.query(ids, run))
        return out

    def cancel(self, job_ids: list[str], run=None) -> None:
        """Must: cancel the jobs; cancelling a job that already ended is not an error."""
        raise NotImplementedError

    def checkpoint_stop(self, job_ids: list[str], run=None) -> None:
        """`hpcrl stop`: give the running jobs what their walltime gives them (USR1 to the batch
        shell: the trainer saves and exits for continuation). A job that already ended is fine."""
        from ..errors import BackendError

        raise BackendError(f"the {self.name} backend cannot signal a running job; `hpcrl cancel` stops it "
                           f"(without a final save: it resumes from the last periodic checkpoint)")

    def end_time(self, job_id: str, run, environ) -> float | None:
        """Inside a job: when the scheduler will end it (unix s), from the scheduler itself."""
        info = self.query([job_id], run).get(job_id)
        return info.end_time if info else None

    # -- runs whose chain is kept from outside the jobs

    def after_change(self, run) -> None:
        """Called after the launcher committed a change of the run's state (TPU: publish it)."""

    def reconcile(self, run, ops, interval_s: float) -> dict:
        """One step of the watcher for `reconciles_outside_job` backends; returns the state.
        ops: the lifecycle steps it may take (control.WatcherOps)."""
        raise NotImplementedError

    def settled(self, run) -> bool:
        """A finished run has nothing of this backend's left to close (TPU: its last QR)."""
        return True

    def status_note(self, run, state: dict) -> str | None:
        """A line `status` adds for this run (TPU: when no watcher has looked at it lately)."""
        return None

    def follow(self, run, ops, interval_s: float) -> None:
        """Keep the local copy of a run's logs current while `logs -f` prints (TPU: a ticker)."""
