"""The deadline backstop's first save and the sandbox's worker count (issue 19, item 8)."""

import json
import types

from hpcrl import protocol
from hpcrl.checkpoints.store import CheckpointStore
from hpcrl.checkpoints.trainer import checkpointer
from hpcrl.rewards.cpus import workers_per_rank
from hpcrl.rl.loop import RLTrainer

from rl_helpers import run_trainer, write_config


def budget(last_save_s=0.0, carried_save_s=0.0, nbytes=0):
    """RLTrainer._save_budget_s of a trainer in that state."""
    me = types.SimpleNamespace(ckpt=types.SimpleNamespace(last_save_s=last_save_s), carried_save_s=carried_save_s,
                               _ckpt_bytes=lambda: nbytes)
    return RLTrainer._save_budget_s(me)


def test_the_first_save_is_budgeted_from_the_checkpoint_size_or_the_runs_last_save():
    gb12 = 12 * 10 ** 9  # a 1B model's float32 weights and AdamW moments on one rank
    assert budget(nbytes=gb12) == 2 * checkpointer.estimate_save_s(gb12) >= 100  # not the 1 s of before
    assert budget(nbytes=1000) == 1.0  # a tiny model: the floor
    assert budget(carried_save_s=80.0, nbytes=1000) == 160.0  # the last segment's save took 80 s
    assert budget(last_save_s=3.0, carried_save_s=80.0, nbytes=gb12) == 6.0  # timed in this process: that


def test_the_save_time_is_carried_to_the_next_segment(tmp_path):
    run_dir = tmp_path / "run"
    write_config(run_dir, sft_steps=0, total_steps=2, save_every=1, eval_before=False, eval_after=False,
                 async_save=False)
    rc, out, err = run_trainer(run_dir)
    assert rc == protocol.EXIT_COMPLETE, err[-3000:]
    states = [json.loads((p / "trainer_state.json").read_text()) for _, p in CheckpointStore(run_dir / "checkpoints").list()]
    assert [s["step"] for s in states] == [1, 2]
    assert states[0]["save_s"] == 0.0 and states[1]["save_s"] > 0.0  # step 2 carries step 1's save time


def test_sandbox_workers_follow_the_affinity_mask_and_the_ranks_on_the_node():
    assert workers_per_rank({}, affinity=64, node_cpus=64) == 64
    assert workers_per_rank({"LOCAL_WORLD_SIZE": "4"}, affinity=64, node_cpus=64) == 16  # the node's 4 ranks
    assert workers_per_rank({"LOCAL_WORLD_SIZE": "4"}, affinity=16, node_cpus=64) == 16  # srun bound this rank
    assert workers_per_rank({}, affinity=8, node_cpus=256) == 8  # a Slurm step's mask, not os.cpu_count()
    assert workers_per_rank({"LOCAL_WORLD_SIZE": "8"}, affinity=4, node_cpus=4) == 1
    assert workers_per_rank() >= 1
