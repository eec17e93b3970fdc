#!/usr/bin/env python
"""The built-in trainer on 1 and 2 ranks (torchrun, gloo, CPU): step time and the share of it
spent in collectives; stop-file-to-exit latency (a stop in the middle of a rollout) and the
checkpoint save/load against raw I/O of the same bytes, for the tiny model and the 30 M one.
--fsdp: only the 2-rank step, save and load with parallel: ddp (rank 0 writes the replicated
state, every rank reads all of it) against parallel: fsdp (each rank writes and reads its part).

    PYTHONPATH=. .venv/bin/python scripts/bench_dist.py [--steps 12] [--skip-30m] [--fsdp]

Everything is a ratio against a baseline measured in the same run (this machine is shared and
its speed drifts). Prints a markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = {  # the demo's model (countdown-tiny), sizes for a few seconds per step on 2 cores
    "model": "tiny", "tiny_hidden_size": 128, "tiny_layers": 2, "tiny_max_int": 200, "prompt_template": "tiny",
    "countdown_min_count": 2, "countdown_max_count": 2, "countdown_max_number": 9, "countdown_max_target": 100,
    "countdown_train_size": 512, "countdown_test_size": 16, "batch_size": 8, "group_size": 8, "lr": 5e-4,
    "beta": 0.04, "max_response_length": 8, "eval_before": False, "eval_after": False, "save_every": 0,
    "threads": 1, "seed": 0,
}
# scripts/bench_rl.py's checkpoint model: hidden 512, 8 layers (~30 M parameters with its vocabulary)
BIG = {**TINY, "tiny_hidden_size": 512, "tiny_layers": 8, "tiny_heads": 8, "tiny_max_int": 1000,
       "batch_size": 4, "group_size": 4, "max_response_length": 32}


def env_for(run_dir: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPCRL_")}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", HPCRL_RUN_DIR=str(run_dir),
               HPCRL_STOP_FILE=str(run_dir / "stop"), HPCRL_EXIT_FILE=str(run_dir / "exit"))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def argv(nproc: int, run_dir: Path) -> list:
    cfg = ["--config", str(run_dir / "trainer.json")]
    if nproc == 1:
        return [sys.executable, "-m", "hpcrl.rl.train", *cfg]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "hpcrl.rl.train", *cfg]


def prepare(run_dir: Path, args: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "trainer.json").write_text(json.dumps(args))


def metrics(run_dir: Path) -> list:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def step_times(nproc: int, work: Path, args: dict, steps: int) -> dict:
    run_dir = work / f"steps-{nproc}"
    prepare(run_dir, {**args, "total_steps": steps})
    res = subprocess.run(argv(nproc, run_dir), env=env_for(run_dir), capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"{nproc}-rank run failed:\n{res.stderr[-3000:]}")
    recs = [r for r in metrics(run_dir) if r.get("phase") == "train"][2:]  # the first steps warm caches
    out = {"step_s": statistics.median(r["step_time_s"] for r in recs)}
    if nproc > 1:
        out["comm_s"] = statistics.median(r["timing_s/comm"] for r in recs)
    return out


def stop_latency(work: Path, name: str, args: dict, delay_s: float) -> dict:
    """2 ranks; the stop file `delay_s` after step 2 ended (inside step 3's rollout); the time
    from the file to torchrun's exit, the save inside it, then a resume segment's load."""
    run_dir = work / f"stop-{name}"
    prepare(run_dir, {**args, "total_steps": 1000})
    proc = subprocess.Popen(argv(2, run_dir), env=env_for(run_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    while not any(r.get("step", 0) >= 2 and r.get("phase") == "train" for r in metrics(run_dir)):
        if proc.poll() is not None:
            sys.exit(f"{name}: trainer ended early:\n{proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    step_s = [r for r in metrics(run_dir) if r.get("phase") == "train"][-1]["step_time_s"]
    time.sleep(delay_s * step_s)
    t0 = time.monotonic()
    (run_dir / "stop").touch()
    out, err = proc.communicate()
    latency = time.monotonic() - t0
    if (run_dir / "exit").read_text().strip() != "85":
        sys.exit(f"{name}: expected exit 85:\n{err[-3000:]}")
    save_s = float(re.search(r"\(save ([0-9.]+) s\)", out).group(1))
    ckpt = max((run_dir / "checkpoints").glob("step-*"))
    nbytes = sum(p.stat().st_size for p in ckpt.iterdir())
    # the resume: every rank reads the whole (replicated) checkpoint
    (run_dir / "stop").touch()  # the resumed segment stops again at once, after loading
    res = subprocess.run(argv(2, run_dir), env=env_for(run_dir, HPCRL_SEGMENT=2), capture_output=True, text=True)
    load_s = float(re.search(r"\(load ([0-9.]+) s\)", res.stdout).group(1))
    return {"step_s": step_s, "latency_s": latency, "save_s": save_s, "load_s": load_s, "bytes": nbytes,
            "raw_write_s": raw_write(work / "raw", nbytes), "raw_read_s": raw_read(work / "raw")}


def raw_write(path: Path, nbytes: int) -> float:
    """Sequential write + fsync of the same number of bytes, in 8 MiB blocks: the disk's floor."""
    block = os.urandom(min(nbytes, 8 << 20))
    t0 = time.monotonic()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[:min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())
    return time.monotonic() - t0


def raw_read(path: Path) -> float:
    """Two concurrent sequential reads of the file (2 ranks each reading the whole checkpoint),
    page cache warm as it is for the trainer's resume right after the save."""
    import threading

    def read():
        with open(path, "rb") as f:
            while f.read(8 << 20):
                pass

    threads = [threading.Thread(target=read) for _ in range(2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - t0


def fsdp_vs_ddp(work: Path, sizes: list) -> int:
    """One stop in the middle of step 3 on 2 ranks, ddp then fsdp, per model size."""
    print("| measure (2 ranks) | ddp | fsdp | fsdp / ddp |\n|---|---|---|---|")
    for name, args in sizes:
        got = {par: stop_latency(work / par, name, {**args, "parallel": par}, 0.5) for par in ("ddp", "fsdp")}
        for key, what in (("step_s", "step"), ("save_s", "save (stop)"), ("load_s", "load (resume)"),
                          ("latency_s", "stop file -> exit")):
            d, f = got["ddp"][key], got["fsdp"][key]
            print(f"| {name}: {what} | {d:.3f} s | {f:.3f} s | **{f / max(d, 1e-6):.2f}x** |")
        print(f"| {name}: checkpoint bytes | {got['ddp']['bytes'] / 1e6:.1f} MB | {got['fsdp']['bytes'] / 1e6:.1f} MB | |")
        print(f"| {name}: raw write+fsync / 2 concurrent raw reads of those bytes | "
              f"{got['ddp']['raw_write_s']:.3f} / {got['ddp']['raw_read_s']:.3f} s | "
              f"{got['fsdp']['raw_write_s']:.3f} / {got['fsdp']['raw_read_s']:.3f} s | |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip-30m", action="store_true")
    ap.add_argument("--fsdp", action="store_true", help="ddp vs fsdp on 2 ranks: step, save, load")
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-dist-") as tmp:
        work = Path(tmp)
        if ns.fsdp:
            return fsdp_vs_ddp(work, [("tiny", TINY)] + ([] if ns.skip_30m else [("30M", BIG)]))
        one = step_times(1, work, TINY, ns.steps)
        two = step_times(2, work, TINY, ns.steps)
        print("| measure | value |\n|---|---|")
        print(f"| tiny step, 1 rank (1 thread) | {one['step_s']:.3f} s |")
        print(f"| tiny step, 2 ranks (1 thread each, same global batch) | {two['step_s']:.3f} s "
              f"(**{two['step_s'] / one['step_s']:.2f}x** the 1-rank step) |")
        print(f"| share of the 2-rank step in collectives | **{two['comm_s'] / two['step_s']:.0%}** "
              f"({two['comm_s']:.3f} s) |")
        sizes = [("tiny", TINY)] + ([] if ns.skip_30m else [("30M", BIG)])
        for name, args in sizes:
            worst = None
            for delay in (0.2, 0.5, 0.8):  # a stop early, midway and late in the rollout
                r = stop_latency(work / f"{delay}", name, args, delay)
                print(f"| {name}: stop file at {delay:.0%} of a step -> exit (2 ranks) | {r['latency_s']:.2f} s "
                      f"= {r['latency_s'] / r['step_s']:.2f} steps; save {r['save_s']:.2f} s |")
                worst = r if worst is None or r["latency_s"] > worst["latency_s"] else worst
            mb = worst["bytes"] / 1e6
            print(f"| {name}: checkpoint {mb:.1f} MB, save (rank 0) vs raw write+fsync | {worst['save_s']:.3f} s vs "
                  f"{worst['raw_write_s']:.3f} s (**{worst['save_s'] / max(worst['raw_write_s'], 1e-6):.2f}x**) |")
            print(f"| {name}: load (2 ranks, each the whole file) vs 2 concurrent raw reads | {worst['load_s']:.3f} s vs "
                  f"{worst['raw_read_s']:.3f} s (**{worst['load_s'] / max(worst['raw_read_s'], 1e-6):.2f}x**) |")
            print(f"| {name}: worst stop-to-exit | **{worst['latency_s']:.2f} s** ({worst['latency_s'] / worst['step_s']:.2f} steps) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
