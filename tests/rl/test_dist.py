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

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from hpcrl import protocol
from hpcrl.checkpoints.store import CheckpointStore, checkpoint_name

from helpers import flip_bit, read_metrics, wait_for_step, wait_until
from rl_helpers import DIST_ARGS, checkpoint_model, exit_file_code, run_trainer, start_torchrun, write_config

TOTAL = 8  # 2 warm-up + 6 RL steps (DIST_ARGS)
EXACT = ("step", "phase", "reward_mean", "reward_std", "solve_rate", "response_len_mean", "lr")


def steps(run_dir):
    """step -> the fields that must be equal on any world size (the last record of a redone step):
    the batch's, and the reward's figures (reward/*: the whole batch's on any number of ranks)."""
    return {r["step"]: {k: v for k, v in r.items() if k in EXACT or k.startswith("reward/")}
            for r in read_metrics(run_dir) if r.get("phase") in ("sft", "train")}


def params_path(run_dir, step=TOTAL):
    found = CheckpointStore(run_dir / "checkpoints").find_latest()
    assert found is not None and found[0] == step, found
    return found[1]


def params(run_dir, step=TOTAL):
    return checkpoint_model(params_path(run_dir, step))


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
        assert sa[s].keys() == sb[s].keys(), f"step {s}: {sorted(sa[s])} vs {sorted(sb[s])}"
        for k in sa[s]:
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


def stopped_segment(run_dir, args: dict, at_step: int = 3, nproc: int = 2) -> int:
    """A torchrun segment stopped by the stop file (USR1 as the segment script delivers it)
    once step `at_step` is logged: every rank stops at one step, saves it, exit file 85."""
    write_config(run_dir, **args)
    proc = start_torchrun(run_dir, nproc=nproc, step_delay_s=0.5)
    wait_for_step(run_dir, at_step, 120, proc)
    (run_dir / "stop").touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and exit_file_code(run_dir) == protocol.EXIT_CONTINUE, err[-3000:]
    stopped = max(steps(run_dir))
    assert at_step <= stopped < TOTAL
    assert CheckpointStore(run_dir / "checkpoints").latest_step() == stopped
    assert f"stopping at step {stopped} (SIGUSR1)" in out
    return stopped


def finish_like_the_straight_run(run_dir, one_rank, base_params, resumed_at: int, nproc: int = 2) -> tuple:
    """Segment 2 on `nproc` ranks (1: a plain process) resumes at `resumed_at`, completes, and the
    run matches the 1-rank straight run; (stdout, stderr)."""
    rc, out, err = run_torchrun(run_dir, segment=2) if nproc > 1 else run_trainer(run_dir, segment=2)
    if nproc > 1:  # torchrun exits 0; rank 0 reports the code in the exit file
        assert rc == 0 and exit_file_code(run_dir) == protocol.EXIT_COMPLETE, err[-3000:]
    else:
        assert rc == protocol.EXIT_COMPLETE, err[-3000:]
    assert "resumed from" in out and f"at step {resumed_at} of {TOTAL}" in out
    assert_same_steps(one_rank, run_dir)
    assert_close_params(params(one_rank), params(run_dir), base_params)
    return out, err


FSDP_ARGS = {**DIST_ARGS, "parallel": "fsdp"}


@pytest.fixture(scope="module")
def two_ranks_fsdp(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fsdp")
    write_config(run_dir, **FSDP_ARGS)
    rc, out, err = run_torchrun(run_dir)
    assert rc == 0, err[-3000:]
    assert exit_file_code(run_dir) == protocol.EXIT_COMPLETE
    assert "fsdp: 2 modules sharded over 2 ranks" in out  # the one decoder layer and the root
    held = re.search(r"rank 0 holds (\d+) of (\d+) parameters, (\d+) of the reference's", out)
    assert held and int(held[1]) == int(held[3]) < 0.6 * int(held[2]), out  # the reference is sharded too
    return run_dir


def test_fsdp_two_ranks_match_one(one_rank, two_ranks_fsdp, base_params):
    """FSDP2 on 2 ranks (sharded weights, gradients reduce-scattered by FSDP, rollout and eval on
    gathered weights) takes the 1-rank run's steps: same rewards, parameters within the bound.
    DIST_ARGS has 2 mini-batches cut from the global batch, so a rank can hold 0 rows of one (its
    dummy micro-batch keeps the ranks' collectives in step), and a KL reference."""
    assert_same_steps(one_rank, two_ranks_fsdp)
    assert_close_params(params(one_rank), params(two_ranks_fsdp), base_params)
    evals = [r for r in read_metrics(two_ranks_fsdp) if r.get("phase") == "eval_after"]
    assert evals and evals[-1]["eval/n"] == DIST_ARGS["eval_size"]


def test_fsdp_ranks_write_their_own_parts_and_from_pretrained_loads_them(one_rank, two_ranks_fsdp):
    """Each rank wrote the whole tensors it owns (not all through rank 0): two model files, two
    optimizer files and two files of the (sharded) KL reference of about half the bytes each,
    Hugging Face's index, no rank report left; and the checkpoint is a model directory
    from_pretrained loads."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    path = CheckpointStore(two_ranks_fsdp / "checkpoints").find_latest()[1]
    names = sorted(p.name for p in path.iterdir())
    assert "model.safetensors" not in names and not [n for n in names if n.startswith(".part-")], names
    assert "ref.safetensors" not in names  # the reference is in parts too: no rank held all of it
    for kind in ("model", "optimizer", "ref"):
        files = [path / f"{kind}-0000{i}-of-00002.safetensors" for i in (1, 2)]
        sizes = [f.stat().st_size for f in files]
        assert min(sizes) > 0.25 * sum(sizes), (kind, sizes)  # both ranks wrote a real share
        for f in files:
            with safe_open(f, "pt") as g:
                assert list(g.keys()), f
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
    on_disk = checkpoint_model(path)
    assert on_disk.keys() <= loaded.keys()
    assert all(torch.equal(loaded[k], v) for k, v in on_disk.items())
    # the reference is the model after the warm-up (step 2), as in the 1-rank run: within
    # rounding, against how far RL moved the model from it
    assert_close_params(checkpoint_model(path, "ref"), checkpoint_model(params_path(one_rank), "ref"),
                        checkpoint_model(params_path(one_rank)))


def test_fsdp_two_ranks_resume_on_two_ranks_past_a_damaged_part(one_rank, base_params, tmp_path):
    """fsdp 2 -> fsdp 2: each rank reads a share of the files and scatters the shards. The newest
    checkpoint's file that rank 1 reads is damaged: both ranks fall back to the one before
    together, and the run still ends on the straight run's steps."""
    run_dir = tmp_path / "fsdp-again"
    stopped = stopped_segment(run_dir, FSDP_ARGS, at_step=5)
    older = [s for s, _ in CheckpointStore(run_dir / "checkpoints").list()][-2]
    # the files are dealt round-robin: model-1, model-2, optimizer-1, optimizer-2 -> rank 1 reads model-2
    flip_bit(run_dir / "checkpoints" / checkpoint_name(stopped) / "model-00002-of-00002.safetensors")
    out, err = finish_like_the_straight_run(run_dir, one_rank, base_params, older)
    assert "model-00002-of-00002.safetensors: fails its" in err


def test_fsdp_scatter_loads_every_shard_reference_and_optimizer_state_exactly(tmp_path):
    """What the resume tests check within a tolerance, exactly: scatter_share into a fresh sharded
    model, reference and AdamW leaves each rank holding the original's shards and state bit for
    bit (tests/rl/scatter_check.py; it fails when the reference is left out, for one)."""
    from hpcrl.rl.tiny import build_tiny_model

    from rl_helpers import REPO, trainer_env

    model_dir = build_tiny_model(tmp_path / "model", hidden_size=32, layers=2, heads=2, max_int=60)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(REPO / "tests" / "rl" / "scatter_check.py"), str(model_dir)],
                          env=trainer_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert proc.stdout.count(": 0 differ") == 2, proc.stdout


def test_fsdp_startup_holds_a_share_of_model_and_reference(tmp_path):
    """fsdp start-up (issue 19, item 2): the model and the KL reference are built on the meta device,
    sharded, and each rank reads only its rows from the files, so a rank's peak RSS over the
    start-up is about 1/world of both (here 1.0 x the model's float32 bytes on 2 ranks). The old
    path (whole model on every rank, deep-copied for the reference, then sharded) peaks above 2x;
    the script's "full" mode measures it (BENCHMARKS.md). Every shard equals its rows on disk."""
    from hpcrl.rl.tiny import build_tiny_model

    from rl_helpers import REPO, trainer_env

    model_dir = build_tiny_model(tmp_path / "model", hidden_size=512, layers=8, heads=8, max_int=1000)  # 84 MB
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(REPO / "tests" / "rl" / "startup_check.py"), str(model_dir), "meta"],
                          env=trainer_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    lines = re.findall(r"rank (\d): mode meta peak ([\d.]+) MB model ([\d.]+) MB; (\d+) differ", proc.stdout)
    assert len(lines) == 2, proc.stdout
    for rank, peak, model, differ in lines:
        assert differ == "0"
        # ideal 1.0 (half of each of two models); the whole model on a rank alone would be 1.0 more
        assert float(peak) < 1.35 * float(model), f"rank {rank} peaked at {peak} MB for a {model} MB model"


def test_fsdp_stopped_by_the_stop_file_resumes_on_one_rank(one_rank, base_params, tmp_path):
    """fsdp 2 ranks -> 1 plain process: the checkpoint's parts hold whole tensors, so the 1-rank
    segment loads them (each file into the parameters the index puts in it) and finishes the
    straight run."""
    run_dir = tmp_path / "fsdp-cut"
    stopped = stopped_segment(run_dir, FSDP_ARGS)
    finish_like_the_straight_run(run_dir, one_rank, base_params, stopped, nproc=1)


def test_one_rank_stopped_then_resume_with_fsdp_on_two(one_rank, base_params, tmp_path):
    """1 -> fsdp 2: the single-file checkpoint of a 1-rank segment (the same format as ddp's): rank
    0 reads the model file, rank 1 the optimizer's, and each scatters its tensors' shards."""
    run_dir = tmp_path / "fsdp-grow"
    stopped = stopped_segment(run_dir, FSDP_ARGS, nproc=1)  # parallel: fsdp on 1 rank is the plain path
    finish_like_the_straight_run(run_dir, one_rank, base_params, stopped)


def test_stop_file_stops_both_ranks_then_resume_on_one(one_rank, base_params, tmp_path):
    """USR1 as the segment script delivers it under torchrun (the stop file): every rank stops at
    the same step, one save, exit file 85, torchrun 0; the run then finishes on 1 rank (2 -> 1)."""
    run_dir = tmp_path / "cut"
    stopped = stopped_segment(run_dir, DIST_ARGS)
    finish_like_the_straight_run(run_dir, one_rank, base_params, stopped, nproc=1)


def test_one_rank_stopped_then_resume_on_two(one_rank, base_params, tmp_path):
    """1 -> 2: a 1-rank torchrun segment stopped by the stop file, the rest on 2 ranks."""
    run_dir = tmp_path / "grow"
    stopped = stopped_segment(run_dir, DIST_ARGS, nproc=1)
    finish_like_the_straight_run(run_dir, one_rank, base_params, stopped)


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


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs for the checkpoints (we run as root in CI; elsewhere the test is skipped)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_disk_full_during_a_save_keeps_the_last_checkpoint(one_rank, base_params, tmp_path, small_disk, parallel):
    """ENOSPC in a save of a 2-rank run: the previous checkpoint stays valid, the partial one is
    gone, the segment fails with 'disk full at PATH' (stderr and RUN_DIR/trainer_error.txt), and a
    rerun once space is freed resumes from the previous checkpoint and matches the straight run.
    fsdp: both ranks write parts, whichever fails first; rank 0 names the disk either way."""
    run_dir = tmp_path / "full"
    write_config(run_dir, **DIST_ARGS, parallel=parallel)
    ckpt = small_disk / "checkpoints"
    proc = start_torchrun(run_dir, step_delay_s=0.5, HPCRL_CKPT_DIR=ckpt)
    wait_until(lambda: CheckpointStore(ckpt).latest_step() == 2, 120, "checkpoint 2", proc=proc)
    free = shutil.disk_usage(small_disk).free
    filler = small_disk / "filler"
    with open(filler, "wb") as f:  # leave far less than one checkpoint (~400 KB) free
        f.write(b"\0" * max(0, free - 64 * 1024))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert f"hpcrl.rl: error: disk full at {ckpt}" in err
    assert (run_dir / "trainer_error.txt").read_text().startswith(f"disk full at {ckpt}")
    store = CheckpointStore(ckpt)
    assert store.find_latest()[0] == 2  # intact (find_latest checks the manifest)
    assert [p.name for p in ckpt.iterdir() if p.name.startswith(".")] == []  # no partial directory left
    filler.unlink()
    rc, out, err = run_torchrun(run_dir, segment=2, HPCRL_CKPT_DIR=ckpt)
    assert rc == 0 and exit_file_code(run_dir) == protocol.EXIT_COMPLETE, err[-3000:]
    assert f"at step 2 of {TOTAL}" in out
    assert not (run_dir / "trainer_error.txt").exists()
    assert_same_steps(one_rank, run_dir)
    found = CheckpointStore(ckpt).find_latest()
    assert_close_params(params(one_rank), checkpoint_model(found[1]), base_params)


def worker_pids(launcher_pid: int) -> dict:
    """rank -> pid of torchrun's worker processes (its children, RANK from their environment)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            env = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        for var in env:
            if var.startswith(b"RANK="):
                out[int(var[5:])] = int(entry)
    return out


def test_kill_9_of_one_rank_ends_the_segment_and_a_rerun_resumes(one_rank, base_params, tmp_path):
    run_dir = tmp_path / "killed"
    write_config(run_dir, **DIST_ARGS)
    proc = start_torchrun(run_dir, step_delay_s=0.5)
    wait_until(lambda: CheckpointStore(run_dir / "checkpoints").latest_step() == 4, 120, "checkpoint 4", proc=proc)
    ranks = wait_until(lambda: len(w := worker_pids(proc.pid)) == 2 and w, 30, "two workers")
    t0 = time.monotonic()
    os.kill(ranks[1], signal.SIGKILL)
    # the hang guard is far below the process group's 300 s timeout: a dead peer must not wait for it
    out, err = proc.communicate(timeout=90)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    print(f"kill -9 of rank 1 -> torchrun exit {proc.returncode} after {took:.1f} s")
    assert exit_file_code(run_dir) is None
    saved = CheckpointStore(run_dir / "checkpoints").find_latest()[0]
    assert saved >= 4
    rc, out, err = run_torchrun(run_dir, segment=2)
    assert rc == 0 and exit_file_code(run_dir) == protocol.EXIT_COMPLETE, err[-3000:]
    assert f"at step {saved} of {TOTAL}" in out
    assert_same_steps(one_rank, run_dir)
    assert_close_params(params(one_rank), params(run_dir), base_params)


def test_stop_during_a_long_evaluation_is_honoured_between_batches(tmp_path):
    """An evaluation of 2 batches per rank, each taking 30 s (a test hook that asks for a stop
    every 1.5 s, as the decoding loop does every few tokens): a stop file during it ends the
    segment long before the evaluation would have, with the step before it saved."""
    run_dir = tmp_path / "longeval"
    write_config(run_dir, **{**DIST_ARGS, "eval_before": False, "eval_every": 4, "eval_batch_size": 2})
    proc = start_torchrun(run_dir, eval_delay_s=30.0)
    wait_until(lambda: CheckpointStore(run_dir / "checkpoints").latest_step() == 4, 120, "checkpoint 4", proc=proc)
    t0 = time.monotonic()
    (run_dir / "stop").touch()
    out, err = proc.communicate(timeout=25)  # the evaluation alone would take 2 x 30 s
    print(f"stop file during an evaluation -> exit after {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 0, err[-3000:]
    assert exit_file_code(run_dir) == protocol.EXIT_CONTINUE
    assert "eval abandoned: stop requested" in out and "stopping at step 4 (SIGUSR1)" in out
    assert CheckpointStore(run_dir / "checkpoints").latest_step() == 4
    assert not [r for r in read_metrics(run_dir) if r.get("phase") == "eval"]  # the half-done one is discarded


def test_sigterm_to_torchrun_reaches_every_rank_and_they_save_together(tmp_path):
    """torchrun forwards TERM to its workers (and SIGKILLs them 30 s later): the ranks agree on
    one step, save it, rank 0 writes 85 to the exit file. torchrun itself then exits 1 (it raises
    on the signal it got), so the exit file, not torchrun's code, says the save happened."""
    run_dir = tmp_path / "term"
    write_config(run_dir, **{**DIST_ARGS, "total_steps": 1000})
    proc = start_torchrun(run_dir, step_delay_s=0.5)
    wait_for_step(run_dir, 4, 120, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert exit_file_code(run_dir) == protocol.EXIT_CONTINUE, err[-3000:]
    stopped = max(steps(run_dir))
    assert f"stopping at step {stopped} (SIGTERM)" in out
    assert CheckpointStore(run_dir / "checkpoints").latest_step() == stopped


def grads_run(tmp_path, name, nproc, parallel="ddp", **extra):
    """A 2-step run (1 warm-up step, 1 RL step of 2 mini-batches) through hooked_train.py, which
    writes the reduced gradients of each of its 3 optimizer steps: {file name: {param: grad}}."""
    from rl_helpers import HOOKED, trainer_env

    run_dir = tmp_path / name
    write_config(run_dir, **{**DIST_ARGS, "sft_steps": 1, "total_steps": 1, "ppo_epochs": 1, "parallel": parallel,
                             "eval_before": False, "eval_after": False, "save_every": 0, **extra})
    grads = run_dir / "grads"
    grads.mkdir()
    hooked = [str(HOOKED), f"--grads-dir={grads}", "--config", str(run_dir / "trainer.json")]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    proc = subprocess.run([sys.executable, *launcher, *hooked], cwd=run_dir, capture_output=True, text=True,
                          timeout=300, env=trainer_env(run_dir, HPCRL_STOP_FILE=run_dir / "stop",
                                                       HPCRL_EXIT_FILE=run_dir / "exit"))
    assert proc.returncode in (0, protocol.EXIT_COMPLETE), proc.stderr[-3000:]
    return {p.name: torch.load(p) for p in sorted(grads.glob("grads-*.pt"))}


def test_gradients_equal_on_one_and_two_ranks_ddp_and_fsdp(tmp_path):
    """The gradients each optimizer step uses (reduced, before clipping and AdamW, which would hide
    a uniform scale) are the same on 1 rank, 2 ddp ranks and 2 fsdp ranks: the warm-up's, and the
    RL step's two mini-batches' (a rank may hold no rows of one: its dummy pass weighs 0). Bound:
    1e-4 of each tensor's largest gradient (float32 rounding of sums in another order is ~1e-7);
    a gradient scaled by the world size, or a rank's rows counted twice, is off by its whole size."""
    one = grads_run(tmp_path, "one", 1)
    assert sorted(one) == ["grads-1-0.pt", "grads-2-0.pt", "grads-2-1.pt"]
    # and fsdp with gradient checkpointing and chunked logits: each layer's and each chunk's
    # recomputation inside FSDP2's gathers (the LM head read from the root after its forward)
    for parallel, extra in (("ddp", {}), ("fsdp", {}),
                            ("fsdp", {"gradient_checkpointing": True, "logit_chunk_tokens": 5})):
        two = grads_run(tmp_path, parallel + "-ckpt" * bool(extra), 2, parallel, **extra)
        assert sorted(two) == sorted(one)
        for step in one:
            for name, g in one[step].items():
                scale = g.abs().max().item()
                diff = (two[step][name] - g).abs().max().item()
                assert diff <= 1e-4 * scale + 1e-12, f"{parallel} {step} {name}: differs by {diff:.3g} of {scale:.3g}"
            assert any(g.abs().max().item() > 0 for g in one[step].values())


def test_ddp_ranks_that_see_different_newest_checkpoints_fail_in_one_line(one_rank, tmp_path):
    """ddp resume (issue 19, item 4): one decision for every rank, as under fsdp. Rank 1's checkpoint
    directory (a node whose file system is not rank 0's; hooked_train.py points it elsewhere)
    lacks the newest checkpoint: the ranks stop at the same point with one line naming the
    steps (stderr, trainer_error.txt), instead of each loading its own newest."""
    from rl_helpers import HOOKED, trainer_env

    run_dir = tmp_path / "split"
    write_config(run_dir, **DIST_ARGS)
    shutil.copytree(one_rank / "checkpoints", run_dir / "checkpoints")
    shutil.copytree(one_rank / "checkpoints", tmp_path / "other")
    shutil.rmtree(tmp_path / "other" / checkpoint_name(TOTAL))  # its newest: step 6
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(HOOKED),
            f"--ckpt-dir-of-rank=1={tmp_path / 'other'}", "--config", str(run_dir / "trainer.json")]
    proc = subprocess.run(argv, cwd=run_dir, capture_output=True, text=True, timeout=300,
                          env=trainer_env(run_dir, segment=2, HPCRL_STOP_FILE=run_dir / "stop",
                                          HPCRL_EXIT_FILE=run_dir / "exit"))
    assert proc.returncode != 0
    line = f"hpcrl.rl: error: the ranks see different newest checkpoints (steps [{TOTAL - 2}, {TOTAL}])"
    assert line in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr.split(line)[0][-2000:]
    assert (run_dir / "trainer_error.txt").read_text().startswith("the ranks see different newest checkpoints")


def test_the_vllm_weight_sync_streams_one_tensor_at_a_time_after_freeing_the_gradients(tmp_path):
    """Issue 27, item 3: the sync to each rank's vLLM engine held the whole float32 state_dict
    (gathered on every rank) beside the gradients; streamed, it holds about one tensor in the
    compute dtype (two while the engine copies one and the next is gathered: memory.sync_bytes),
    and the gradients are freed first. Measured by tests/rl/sync_check.py with an engine test
    double that checks every weight arrived right."""
    from hpcrl.rl import memory
    from hpcrl.rl.tiny import build_tiny_model

    from rl_helpers import REPO, trainer_env

    model_dir = build_tiny_model(tmp_path / "model", hidden_size=64, layers=2, heads=2, max_int=200)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(REPO / "tests" / "rl" / "sync_check.py"), str(model_dir)],
                          env=trainer_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    got = re.findall(r"rank (\d): peak (\d+) largest (\d+) wrong (\d+)", proc.stdout)
    assert len(got) == 2, proc.stdout
    model_bytes = sum(p.numel() * 4 for p in policy_params(model_dir))
    for _, peak, largest, wrong in got:
        assert int(wrong) == 0
        assert int(peak) <= memory.sync_bytes(int(largest) // 2, "bfloat16"), (peak, largest)
        assert int(peak) < model_bytes / 4  # the old path: the whole float32 model (and the gradients' shards)


def policy_params(model_dir):
    from hpcrl.rl import policy

    model, _ = policy.load_policy(model_dir, torch.device("cpu"))
    return list(model.parameters())
