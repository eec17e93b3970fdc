"""rl/walltime.py: the built-in trainer's stop decisions on one process, with a real StopFlag
(its handlers not installed: the flags are set as the handlers would) and deadlines far enough
from now that no timing matters."""

import time

from hpcrl import protocol
from hpcrl.rl.dist import Dist
from hpcrl.rl.walltime import Walltime


def walltime(tmp_path, seconds_left=None, stop_file=None):
    deadline = None if seconds_left is None else time.time() + seconds_left
    ctx = protocol.Context(tmp_path, tmp_path / "checkpoints", 1, deadline, tmp_path / "metrics.jsonl",
                           stop_file=stop_file)
    return Walltime(protocol.StopFlag(ctx, install=False), ctx, Dist())


def test_another_step_is_taken_only_while_it_and_a_save_fit(tmp_path):
    w = walltime(tmp_path, seconds_left=3600)
    assert w.before_step(save_s=60) is None
    w.step_took(3000.0)  # a step that long, plus the save, passes the deadline
    assert w.before_step(save_s=600) == "deadline"
    w.step_took(0.0)  # the slowest recent step is remembered, decaying
    assert w.step_s == 0.7 * 3000.0


def test_a_signal_or_the_stop_file_stops_at_once_and_names_itself(tmp_path):
    w = walltime(tmp_path, stop_file=tmp_path / "stop")
    assert w.before_step(save_s=1) is None and not w.requested(lambda: 1.0)
    (tmp_path / "stop").touch()
    assert w.requested(lambda: 1.0) and w.before_step(save_s=1) == "SIGUSR1"
    w.stop.term = True
    assert w.reason == "SIGTERM" and w.agreed() == "SIGTERM"


def test_a_stopping_segment_saves_unless_a_sigterm_leaves_no_time_for_it(tmp_path):
    w = walltime(tmp_path, seconds_left=100)
    assert w.save_at_stop("SIGTERM", unsaved=True, save_s=10)
    assert not w.save_at_stop("SIGTERM", unsaved=True, save_s=1000)  # the kill would land in the save
    assert w.save_at_stop("SIGUSR1", unsaved=True, save_s=1000)  # USR1 comes early enough
    assert not w.save_at_stop("SIGUSR1", unsaved=False, save_s=1)  # nothing new to save
    assert w.after_phase(cut=True) == "SIGUSR1" and w.after_phase(cut=False) is None
