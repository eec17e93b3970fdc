"""The smoke trainer: no ML stack, obeys the walltime protocol exactly.

It counts steps with a configurable step time, checkpoints atomically every `save_every` steps
and whenever it stops, honours SIGUSR1, SIGTERM and the deadline, and writes one metrics line
per step. Run it on a debug QOS to test the whole submission chain before a full-scale run; the
lifecycle tests use it too. `crash_at_step` makes it fail on purpose (crash-loop tests).

Run by the segment script as `python -m hpcrl.trainers.smoke --config RUN_DIR/smoke.json`, or
with `resources.ranks_per_node` / `resources.nodes` above one under torchrun exactly as the built-in
trainer is (srun + c10d rendezvous on Slurm), to test that launch before a full-scale run: then
rank 0 trains as above (polling HPCRL_STOP_FILE, its code in HPCRL_EXIT_FILE), and the other ranks
keep step with it until it has written that file, then exit 0. No torch.distributed: the smoke
trainer needs no ML stack, only torch's launcher where hpcrl runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

from .. import protocol
from ..checkpoints.store import CheckpointStore
from ..schemas import Float, Int, Schema, Str
from .base import Trainer, TrainerContext

SCHEMA = Schema("smoke", [
    Int("steps", 60, "total steps of the whole run (across segments)", ge=1),
    Float("step_time_s", 0.5, "seconds one step takes", ge=0),
    Int("save_every", 10, "periodic checkpoint interval in steps (what a hard kill can lose)", ge=1),
    Int("keep_last", 3, "checkpoints kept", ge=1),
    Int("crash_at_step", None, "exit 1 (without saving) when reaching this step: crash-loop tests", ge=1, nullable=True),
    Str("fail_if_exists", None, "exit 1 (without saving) at start or between steps while this file exists: "
        "repeated-failure tests", nullable=True),
])


class SmokeTrainer(Trainer):
    name = "smoke"
    schema = SCHEMA
    ranks = "any"  # one process unless ranks_per_node / nodes ask for more (then under torchrun)

    def files(self, ctx: TrainerContext) -> dict[str, str]:
        return {"smoke.json": json.dumps(ctx.args, indent=1, sort_keys=True) + "\n"}

    def total_steps(self, args: dict) -> int | None:
        return int(args.get("steps", SCHEMA.defaults["steps"]))

    def command(self, ctx: TrainerContext) -> list[str]:
        return [ctx.python, *self.entry(ctx)]

    def entry(self, ctx: TrainerContext) -> list[str]:
        return ["-m", "hpcrl.trainers.smoke", "--config", str(ctx.run_dir / "smoke.json")]


def _digest(prev: str, step: int) -> str:
    # A running hash over all steps: a resumed run that skipped or repeated a step ends with a
    # different value than one that ran straight through.
    return hashlib.sha256(f"{prev}:{step}".encode()).hexdigest()[:16]


def _save(store: CheckpointStore, step: int, digest: str) -> None:
    tmp = store.new_tmp_dir()
    (tmp / "state.json").write_text(json.dumps({"step": step, "digest": digest}), encoding="utf-8")
    store.publish(tmp, step)
    print(f"smoke: checkpoint step {step}", flush=True)


def _restore(store: CheckpointStore) -> tuple[int, str]:
    found = store.find_latest()
    if found is None:
        return 0, "start"
    state = json.loads((found[1] / "state.json").read_text(encoding="utf-8"))
    return int(state["step"]), str(state["digest"])


def _fails(cfg: dict) -> bool:
    if cfg.get("fail_if_exists") and os.path.exists(cfg["fail_if_exists"]):
        print(f"smoke: error: {cfg['fail_if_exists']} exists", file=sys.stderr, flush=True)
        return True
    return False


def train(cfg: dict, ctx: protocol.Context) -> int:
    stop = protocol.StopFlag(ctx, margin_s=1.0)
    store = CheckpointStore(ctx.ckpt_dir, keep_last=cfg["keep_last"])
    step, digest = _restore(store)
    saved = step
    print(f"smoke: segment {ctx.segment} starts at step {step} of {cfg['steps']}", flush=True)
    if _fails(cfg):
        return 1
    while step < cfg["steps"]:
        if stop.should_stop(next_step_s=cfg["step_time_s"], save_s=0.5):
            if saved != step:
                _save(store, step, digest)
            print(f"smoke: stopping for continuation at step {step} ({stop.reason or 'deadline'})", flush=True)
            return protocol.EXIT_CONTINUE
        time.sleep(cfg["step_time_s"])
        if _fails(cfg):
            return 1
        step += 1
        digest = _digest(digest, step)
        protocol.append_metrics(ctx.metrics_path, {"step": step, "segment": ctx.segment, "loss": round(1.0 / step, 6),
                                                   "time": round(time.time(), 3)})
        if cfg.get("crash_at_step") == step:
            print(f"smoke: simulated crash at step {step}", file=sys.stderr, flush=True)
            return 1
        if step % cfg["save_every"] == 0:
            _save(store, step, digest)
            saved = step
    if saved != step:
        _save(store, step, digest)
    print(f"smoke: done at step {step}, digest {digest}", flush=True)
    return protocol.EXIT_COMPLETE


def follow(cfg: dict, ctx: protocol.Context, rank: int) -> int:
    """A rank other than 0: step alongside rank 0 until it has written the exit file (it then has
    saved), then exit 0. A TERM ends it at once (rank 0 saves for everyone); torchrun ends it
    when another rank dies."""
    stop = protocol.StopFlag(ctx, margin_s=1.0)
    while ctx.exit_file is None or not ctx.exit_file.exists():
        if stop.term:
            break
        time.sleep(min(cfg["step_time_s"], 0.2) or 0.05)
    print(f"smoke: rank {rank} done", flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcrl.trainers.smoke")
    parser.add_argument("--config", required=True)
    ns = parser.parse_args(argv)
    with open(ns.config, encoding="utf-8") as f:
        cfg = {**SCHEMA.defaults, **json.load(f)}
    ctx = protocol.Context.from_env()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        import socket  # here: `hpcrl render` loads this module for its schema

        print(f"smoke: rank {rank} of {world} on {socket.gethostname()} (local rank "
              f"{os.environ.get('LOCAL_RANK', '?')}, node {os.environ.get('GROUP_RANK', '?')})", flush=True)
    if rank != 0:
        return follow(cfg, ctx, rank)
    code = train(cfg, ctx)
    return code if code not in (protocol.EXIT_COMPLETE, protocol.EXIT_CONTINUE) else \
        protocol.exit_code_for_launcher(ctx, code)


if __name__ == "__main__":
    sys.exit(main())
