"""The built-in trainer on several ranks: real `torchrun` processes on CPU (gloo), real files and
signals. What must hold: the same global batch on 1 or 2 ranks gives the same run, the ranks stop
together at one step, and a run moves between world sizes at a checkpoint.

Tolerance: the completions, rewards and data order are identical (discrete draws from streams
keyed by seed, step and prompt position, not by rank), but a 2-rank gradient is the sum of two
partial sums, so float32 rounding differs from the 1-rank sum (~1e-7 relative per step), and Adam
divides by the root of the second moment, which turns a tiny gradient difference into a
comparable update difference. Measured here: 3e-6 after 8 steps, where training moved the
parameters by 1.4e-2. The bound is 1% of the parameters' total change over the run: far above
rounding and far below any real difference (a wrong normalisation or a different batch moves
them by a large part of that change in one step).
"""

import time

import pytest
from safetensors.torch import load_file

from hpcrl import protocol
from hpcrl.ckptstore import CheckpointStore, checkpoint_name

from helpers import read_metrics, wait_for_step
from rl_helpers import DIST_ARGS, exit_file_code, run_trainer, start_torchrun, write_config

TOTAL = 8  # 2 warm-up + 6 RL steps (DIST_ARGS)
EXACT = ("step", "phase", "reward_mean", "reward_std", "solve_rate", "response_len_mean", "lr")


def steps(run_dir):
    """step -> the fields that must be equal on any world size (the last record of a redone step)."""
    return {r["step"]: {k: r.get(k) for k in EXACT}
            for r in read_metrics(run_dir) if r.get("phase") in ("sft", "train")}


def params(run_dir, step=TOTAL):
    found = CheckpointStore(run_dir / "checkpoints").find_latest()
    assert found is not None and found[0] == step, found
    return load_file(found[1] / "model.safetensors")


def assert_close_params(a, b, base):
    """a and b equal within 1% of how far training moved the parameters from `base`."""
    moved = max((a[k] - base[k]).abs().max().item() for k in a)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert moved > 0
    assert diff <= 0.01 * moved, f"parameters differ by {diff:.3g}; training moved them by {moved:.3g}"


def assert_same_steps(a, b):
    sa, sb = steps(a), steps(b)
    assert sa.keys() == sb.keys() == set(range(1, TOTAL + 1))
    for s in sa:
        for k in EXACT:
            x, y = sa[s][k], sb[s][k]
            if isinstance(x, float) and isinstance(y, float):
                assert abs(x - y) <= 1e-5, f"step {s} {k}: {x} vs {y}"
            else:
                assert x == y, f"step {s} {k}: {x} vs {y}"


def run_torchrun(run_dir, nproc=2, timeout=240, **kw):
    proc = start_torchrun(run_dir, nproc, **kw)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """One plain process, no launcher: the reference."""
    run_dir = tmp_path_factory.mktemp("one")
    write_config(run_dir, **DIST_ARGS)
    rc, out, err = run_trainer(run_dir)
    assert rc == protocol.EXIT_COMPLETE, err[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def base_params(one_rank):
    """The parameters after the warm-up (step 2): what RL starts from."""
    return load_file(one_rank / "checkpoints" / checkpoint_name(2) / "model.safetensors")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("two")
    write_config(run_dir, **DIST_ARGS)
    rc, out, err = run_torchrun(run_dir)
    assert rc == 0, err[-3000:]
    assert exit_file_code(run_dir) == protocol.EXIT_COMPLETE
    return run_dir


def test_two_ranks_match_one(one_rank, two_ranks, base_params):
    assert_same_steps(one_rank, two_ranks)
    assert_close_params(params(one_rank), params(two_ranks), base_params)
    # one metrics file, written by rank 0 alone: one record per step
    train = [r["step"] for r in read_metrics(two_ranks) if r.get("phase") in ("sft", "train")]
    assert train == list(range(1, TOTAL + 1))


def test_stop_file_stops_both_ranks_then_resume_on_one(one_rank, base_params, tmp_path):
    """USR1 as the segment script delivers it under torchrun (the stop file): every rank stops at
    the same step, one save, exit file 85, torchrun 0; the run then finishes on 1 rank (2 -> 1)."""
    run_dir = tmp_path / "cut"
    write_config(run_dir, **DIST_ARGS)
    proc = start_torchrun(run_dir, step_delay_s=0.5)
    wait_for_step(run_dir, 3, 120, proc)
    (run_dir / "stop").touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert exit_file_code(run_dir) == protocol.EXIT_CONTINUE
    stopped = max(steps(run_dir))
    assert 3 <= stopped < TOTAL
    assert CheckpointStore(run_dir / "checkpoints").latest_step() == stopped
    assert f"stopping at step {stopped} (SIGUSR1)" in out
    rc, out, err = run_trainer(run_dir, segment=2)
    assert rc == protocol.EXIT_COMPLETE, err[-3000:]
    assert "resumed from" in out and f"at step {stopped} of {TOTAL}" in out
    assert_same_steps(one_rank, run_dir)
    assert_close_params(params(one_rank), params(run_dir), base_params)


def test_one_rank_stopped_then_resume_on_two(one_rank, base_params, tmp_path):
    """1 -> 2: a 1-rank torchrun segment stopped by the stop file, the rest on 2 ranks."""
    run_dir = tmp_path / "grow"
    write_config(run_dir, **DIST_ARGS)
    proc = start_torchrun(run_dir, nproc=1, step_delay_s=0.5)
    wait_for_step(run_dir, 3, 120, proc)
    (run_dir / "stop").touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and exit_file_code(run_dir) == protocol.EXIT_CONTINUE, err[-3000:]
    stopped = CheckpointStore(run_dir / "checkpoints").latest_step()
    assert 3 <= stopped < TOTAL
    rc, out, err = run_torchrun(run_dir, segment=2)
    assert rc == 0 and exit_file_code(run_dir) == protocol.EXIT_COMPLETE, err[-3000:]
    assert f"at step {stopped} of {TOTAL}" in out
    assert_same_steps(one_rank, run_dir)
    assert_close_params(params(one_rank), params(run_dir), base_params)


def test_deadline_stops_both_ranks(tmp_path):
    """A deadline the run cannot finish before (8 steps of >= 3 s, 30 s): both ranks stop at one
    step, save it, exit file 85."""
    run_dir = tmp_path / "deadline"
    write_config(run_dir, **DIST_ARGS)
    proc = start_torchrun(run_dir, deadline=time.time() + 30, step_delay_s=3.0)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert exit_file_code(run_dir) == protocol.EXIT_CONTINUE
    assert "(deadline)" in out
    done = steps(run_dir)
    saved = CheckpointStore(run_dir / "checkpoints").latest_step()
    assert saved == (max(done) if done else None)
