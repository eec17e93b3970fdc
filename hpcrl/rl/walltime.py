"""When a segment of the built-in trainer stops: signals, the stop file, the deadline, and whether
the next step and a save still fit before it (protocol.next_save_fits, the rule every trainer
uses, asked through protocol.StopFlag; late signals after the exit are ignored by StopFlag's
atexit hook, protocol.ignore_late_signals).

Every rank decides for itself and the ranks then agree (the strongest reason wins, dist.REASONS):
between steps with one collective, inside a long phase (rollout, evaluation) with a local check
only, agreed right after the phase.
"""

from __future__ import annotations

from .. import protocol
from ..checkpoints.trainer import checkpointer as checkpoint


def save_budget_s(last_save_s: float, carried_save_s: float, nbytes) -> float:
    """The time to reserve for a save: twice the last save's time; before this process has saved,
    the time the run's last save took (carried in the trainer state) or what this rank's
    checkpoint bytes (`nbytes()`, asked only then) need at a conservative rate, whichever is
    longer: a multi-GB first save must still fit the deadline."""
    last = last_save_s or max(carried_save_s, checkpoint.estimate_save_s(nbytes()))
    return max(1.0, 2.0 * last)


class Walltime:
    """The stop decisions of one segment (stop: the process's protocol.StopFlag)."""

    def __init__(self, stop: protocol.StopFlag, ctx: protocol.Context, dist):
        self.stop, self.ctx, self.dist = stop, ctx, dist
        self.step_s = 0.0  # the slowest recent step, to decide whether another one fits

    def step_took(self, seconds: float) -> None:
        self.step_s = max(seconds, 0.7 * self.step_s)  # decays, but one slow step is remembered

    @property
    def reason(self) -> str:
        """Why this rank stops (a deadline when no signal came)."""
        return self.stop.reason or "deadline"

    def before_step(self, save_s: float) -> str | None:
        """Between steps, on every rank: the agreed reason to stop now (None: take another step,
        which with a save still fits)."""
        local = self.reason if self.stop.should_stop(next_step_s=self.step_s, save_s=save_s) else None
        return self.dist.agree_stop(local)

    def requested(self, save_s) -> bool:
        """Inside a phase, on this rank alone (no collective: ranks reach this point at different
        times): a signal, the stop file, or no time left for a save (`save_s()`, asked only then)."""
        return self.stop.poll_stop_file() or self.stop.term or self.stop.should_stop(save_s=save_s())

    def agreed(self) -> str | None:
        """This rank's reason (it wants to stop) agreed with every other rank's."""
        return self.dist.agree_stop(self.reason)

    def after_phase(self, cut: bool) -> str | None:
        """After a phase a stop may have cut short on some rank: the agreed reason (None: none was)."""
        return self.dist.agree_stop("SIGUSR1" if cut else None)

    def save_at_stop(self, reason: str, unsaved: bool, save_s: float) -> bool:
        """Whether a stopping segment saves its last steps: always, unless a SIGTERM came and the
        save no longer fits. Rank 0 decides (its save time is the one that counts), every rank
        gets its answer."""
        fits = protocol.next_save_fits(self.ctx.seconds_left(), 0.0, save_s)
        save = unsaved and (reason != "SIGTERM" or fits)
        return bool(self.dist.max([float(save) if self.dist.is_main else 0.0])[0])
