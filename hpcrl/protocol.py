"""The walltime protocol: the one contract between the launcher and a trainer. Stdlib only.

The segment script gives the trainer, in its environment:

    HPCRL_RUN_DIR      the run directory (metrics go to HPCRL_METRICS inside it)
    HPCRL_CKPT_DIR     where the trainer keeps its checkpoints
    HPCRL_SEGMENT      the segment number, 1-based
    HPCRL_DEADLINE     absolute unix time (float seconds) by which the trainer must have
                       saved and exited
    HPCRL_METRICS      the JSON-lines file for metrics (one object per line, with "step")

    HPCRL_STOP_FILE    (multi-process launchers only) a path the segment script creates instead of
                       forwarding SIGUSR1: a launcher such as torchrun or srun would die of a USR1
                       or not pass it on, so the trainer's ranks look for this file (rank 0 is
                       enough: the ranks agree on the stop with a collective) and treat it as USR1
    HPCRL_EXIT_FILE    (multi-process launchers only) torchrun reports any non-zero worker exit
                       as 1, so the code the protocol needs (EXIT_COMPLETE or EXIT_CONTINUE) is
                       written here by rank 0 once every rank has finished saving, and every rank
                       then exits 0; the segment script takes the file's code when the launcher
                       itself exited 0, and the launcher's code (a failure) otherwise

Before the deadline the trainer also gets SIGUSR1 ("checkpoint now, then exit for
continuation"). SIGTERM means "you are being killed or preempted: save if you can, exit".
Exit codes: EXIT_COMPLETE (0) when training is done, EXIT_CONTINUE when it stopped to be
continued by the next segment; anything else is a failure. EXIT_NOTHING_TO_DO is the segment
script's own: `hpcrl _segment begin` exits with it when the run needs no more segments (complete,
cancelled or out of budget), and the script then exits without starting the trainer.

A trainer that fails for a reason it knows (a full disk, steps its loop ended without saving)
writes that reason, one line, to RUN_DIR/trainer_error.txt (ERROR_FILE) before it exits non-zero:
`_segment end` records it with the failed segment, and `status` shows it (a log's last lines are
often a traceback's or the framework's, not the cause). `_segment begin` removes an old one.
A trainer that stops for continuation before it could save anything may leave its reason there
too (the built-in trainer: how long its start-up and first evaluation took): it is shown only if
the run then fails for lack of progress.

Progress is the checkpoint's step, and, for a trainer that keeps other work across segments, the
`work` count in RUN_DIR/progress.json (PROGRESS_FILE, `write_progress`).

The checkpoint layout is not part of this contract: each trainer adapter says how the launcher
finds its trainer's last checkpoint (trainers/base.py `checkpoint_step`). hpcrl's own trainers
(built-in and smoke) share one store, hpcrl/checkpoints/store.py (step-N directories with a checksum
manifest, a LATEST pointer, the last K kept).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

EXIT_COMPLETE = 0
EXIT_CONTINUE = 85  # stopped for continuation (like Slurm's "requeue" convention of a named code)
EXIT_NOTHING_TO_DO = 3  # `_segment begin`: the run needs no more segments; the script exits at once

ENV_RUN_DIR = "HPCRL_RUN_DIR"
ENV_CKPT_DIR = "HPCRL_CKPT_DIR"
ENV_SEGMENT = "HPCRL_SEGMENT"
ENV_DEADLINE = "HPCRL_DEADLINE"
ENV_METRICS = "HPCRL_METRICS"
ENV_STOP_FILE = "HPCRL_STOP_FILE"
ENV_EXIT_FILE = "HPCRL_EXIT_FILE"

METRICS_FILE = "metrics.jsonl"
ERROR_FILE = "trainer_error.txt"  # in RUN_DIR: the failed trainer's own reason, one line
PROGRESS_FILE = "progress.json"  # in RUN_DIR: work the trainer kept besides its checkpoints


# ---------------------------------------------------------------- environment


class Context:
    """What the segment script told the trainer (or sensible stand-ins when run by hand)."""

    def __init__(self, run_dir, ckpt_dir, segment: int, deadline: float | None, metrics,
                 stop_file=None, exit_file=None):
        self.run_dir = Path(run_dir)
        self.stop_file = Path(stop_file) if stop_file else None
        self.exit_file = Path(exit_file) if exit_file else None
        self.ckpt_dir = Path(ckpt_dir)
        self.segment = segment
        self.deadline = deadline
        self.metrics_path = Path(metrics)

    @classmethod
    def from_env(cls, env=None, default_run_dir: str | os.PathLike = ".") -> "Context":
        env = os.environ if env is None else env
        run_dir = Path(env.get(ENV_RUN_DIR) or default_run_dir)
        deadline = env.get(ENV_DEADLINE)
        return cls(
            run_dir=run_dir,
            ckpt_dir=env.get(ENV_CKPT_DIR) or run_dir / "checkpoints",
            segment=int(env.get(ENV_SEGMENT) or 1),
            deadline=float(deadline) if deadline else None,
            metrics=env.get(ENV_METRICS) or run_dir / METRICS_FILE,
            stop_file=env.get(ENV_STOP_FILE) or None,
            exit_file=env.get(ENV_EXIT_FILE) or None,
        )

    def seconds_left(self, now: float | None = None) -> float:
        if self.deadline is None:
            return float("inf")
        return self.deadline - (time.time() if now is None else now)


class StopFlag:
    """Records SIGUSR1/SIGTERM so the training loop can stop at a safe point.

    The handlers only set flags: saving from inside a signal handler could interrupt a
    half-written step. The loop calls `should_stop(next_step_s)` between steps.
    """

    def __init__(self, ctx: Context, margin_s: float = 5.0, install: bool = True):
        self.ctx = ctx
        self.margin_s = margin_s
        self.usr1 = False
        self.term = False
        if install:
            signal.signal(signal.SIGUSR1, self._on_usr1)
            signal.signal(signal.SIGTERM, self._on_term)
            import atexit

            atexit.register(ignore_late_signals)

    def _on_usr1(self, signum, frame):
        self.usr1 = True

    def _on_term(self, signum, frame):
        self.term = True

    def poll_stop_file(self) -> bool:
        """Under a multi-process launcher the USR1 arrives as HPCRL_STOP_FILE: one stat, so call
        it where the loop checks for a stop (between steps, between chunks of a long phase)."""
        if not self.usr1 and self.ctx.stop_file is not None and self.ctx.stop_file.exists():
            self.usr1 = True
        return self.usr1

    @property
    def reason(self) -> str | None:
        self.poll_stop_file()
        if self.term:
            return "SIGTERM"
        if self.usr1:
            return "SIGUSR1"
        if self.ctx.seconds_left() <= self.margin_s:
            return "deadline"
        return None

    def should_stop(self, next_step_s: float = 0.0, save_s: float = 0.0) -> bool:
        """True when a signal came, or the next step plus a save would overrun the deadline."""
        if self.poll_stop_file() or self.term:
            return True
        return not next_save_fits(self.ctx.seconds_left(), next_step_s, save_s, self.margin_s)


def next_save_fits(seconds_left: float, work_s: float, save_s: float = 0.0, margin_s: float = 0.0) -> bool:
    """The walltime rule, for every trainer: the work up to the next save, the save itself and a
    margin (the stop, a poll interval) must all end before the deadline. StopFlag asks it between
    the built-in trainer's steps; the job-side supervisor of a foreign trainer (hpcrl/job) asks it
    after each save it sees, with the work sized from the steps it measured."""
    return seconds_left > work_s + save_s + margin_s


def exit_code_for_launcher(ctx: Context, code: int) -> int:
    """The code the trainer process should exit with. Without a multi-process launcher that is
    `code` itself; under one (HPCRL_EXIT_FILE set) the caller's rank 0 has everyone's agreement
    that the ranks finished, the code goes to the file (atomically) and the process exits 0."""
    if ctx.exit_file is None:
        return code
    tmp = ctx.exit_file.with_name(ctx.exit_file.name + ".tmp")
    tmp.write_text(f"{int(code)}\n", encoding="ascii")
    os.replace(tmp, ctx.exit_file)
    return 0


def ignore_late_signals() -> None:
    """Ignore USR1/TERM from now on (registered at exit by StopFlag).

    Python resets handled signals to their default action while it shuts down, and a large
    process (torch) takes a while to: a USR1 forwarded just as the trainer exits for
    continuation would then kill it, turning a clean 85 into a failed segment (138). A trainer
    that is exiting has already saved; an ignored signal stays ignored through finalization.
    """
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


# ---------------------------------------------------------------- metrics


def append_metrics(path, record: dict) -> None:
    """Append one JSON object as a line, written through at once so `status` and `logs` see it.

    Not fsync'ed: a metrics line is a report, not state (the checkpoint is the state, and steps
    after it are redone on resume), and an fsync per step cost ~10% of a small model's step time
    here (more on a parallel filesystem).
    """
    line = json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)


def read_last_metrics(path, max_bytes: int = 65536, key: str | None = None) -> dict | None:
    """The newest complete metrics record (optionally the newest that has `key`)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line or the cut first line of the tail
        if isinstance(rec, dict) and (key is None or key in rec):
            return rec
    return None


# ---------------------------------------------------------------- progress besides checkpoints


def write_progress(run_dir, work: int) -> None:
    """Record `work`, a count that only grows, of what the trainer kept outside its checkpoints (the
    built-in trainer: evaluation rows scored and kept, so an evaluation longer than a segment goes
    on in the next). A segment that raised it made progress, as one that advanced the checkpoint
    did: the crash-loop rule (two segments in a row without progress fail the run) then does not
    fail a run whose first evaluation simply spans segments. Atomic: a torn file reads as none."""
    path = Path(run_dir) / PROGRESS_FILE
    tmp = path.with_name(f".{PROGRESS_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps({"work": int(work)}) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_progress(run_dir) -> int | None:
    """The trainer's `work` count (write_progress), or None when it keeps none."""
    try:
        return int(json.loads((Path(run_dir) / PROGRESS_FILE).read_text(encoding="utf-8"))["work"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------- a failure's reason


def report_error(run_dir: Path, reason: str) -> None:
    """Leave `reason` for `_segment end` (ERROR_FILE). Best effort: on a full disk this write may
    fail too, and the reason is then only in the log."""
    try:
        (Path(run_dir) / ERROR_FILE).write_text(" ".join(reason.split())[:500] + "\n", encoding="utf-8")
    except OSError:
        pass


def take_error(run_dir: Path) -> str | None:
    """The reason a trainer left (ERROR_FILE), removed once read; None when there is none."""
    path = Path(run_dir) / ERROR_FILE
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        path.unlink()
    except OSError:
        return None
    return text or None
