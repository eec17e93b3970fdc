"""#41 item 5: the run's first checkpoint is taken by time as well as steps. A segment that trains
slowly with periodic saves far apart (save_every 1000) saves once it has trained for
save_first_after_s, so a hard kill (kill -9: no signal, no stop save) still leaves progress; and
only that first one is by time (the rest follow save_every)."""

import signal

from hpcrl.checkpoints.store import CheckpointStore

from helpers import last_step, wait_until
from rl_helpers import start_trainer, write_config


def test_a_segment_killed_hard_before_its_first_periodic_save_keeps_the_one_taken_by_time(tmp_path):
    run_dir = tmp_path / "first"
    write_config(run_dir, total_steps=10_000, sft_steps=0, save_every=1000, save_first_after_s=1.0)
    store = CheckpointStore(run_dir / "checkpoints")
    # 0.3 s a step: the first save comes after a few steps, by time, while the trainer runs on
    proc = start_trainer(run_dir, step_delay_s=0.3)
    try:
        first = wait_until(lambda: store.latest_step(), 600, "a checkpoint taken by time", proc=proc)
        assert first >= 1
        # five steps later (by the order of steps, not a time): no second save by time
        wait_until(lambda: last_step(run_dir) >= first + 5, 600, "five more steps", proc=proc)
        assert store.latest_step() == first, "only the run's first checkpoint is by time"
    finally:
        proc.send_signal(signal.SIGKILL)  # like a node failure: no stop, no save
        proc.communicate(timeout=60)
    found = store.find_latest()  # sealed and intact: what the next segment resumes from
    assert found is not None and found[0] == first
