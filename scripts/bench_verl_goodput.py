#!/usr/bin/env python3
"""Where a verl segment's time goes, and its goodput against the built-in trainer's at the same
segment length, both measured in this run (issue 23 item 7).

    .venv/bin/python scripts/bench_verl_goodput.py [--hours 0.08] [--only verl|builtin]

Each trainer runs one segment of `--hours` through `hpcrl submit --site local` that must stop for
continuation (far more steps than fit): verl 0.9.1 (scripts/verl-venv, the tiny Llama and
Countdown data of tests/test_verl_tier.py, its CPU configuration and platform test double) and the
built-in trainer (recipe countdown-tiny). From the run's files (state.json, metrics.jsonl,
verl-metrics, the tracker), per segment:

    start-up    segment start -> the first training step began (first record's time - its step time)
    training    the first step began -> the last step's record
    after       the last step's record -> the segment's end (save, stop, exit)
    unused      the segment's end -> its walltime
    goodput     training / (walltime - start-up)     start-up excluded, the issue's goal
    status      what `hpcrl status RUN --json` shows as goodput (start-up included)

and for verl the warm-up (its first step), the ESI window it computes and the steps it trained.
Prints one JSON line per trainer and a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def cli(*args, env=None, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "hpcrl.cli", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"hpcrl {' '.join(map(str, args[:2]))} failed: {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def wait_done(run_id: str, timeout_s: float) -> dict:
    from hpcrl.runs import Run

    end = time.time() + timeout_s
    while time.time() < end:
        state = Run.by_id(run_id).state()
        if state["state"] not in ("RUNNING", "PENDING", "RESUBMITTED", "CHECKPOINTING", "QUEUED") and not any(
                s["state"] in ("RUNNING", "QUEUED") for s in state["segments"]):
            return state
        time.sleep(2)
    raise SystemExit(f"{run_id}: not finished within {timeout_s:.0f} s")


def submit_verl(work: Path, hours: float) -> str:
    from test_verl_tier import CPU_ENV, CPU_OVERRIDES, DOUBLE_DIR, TINY_ARGS

    verl_py = subprocess.run([str(ROOT / "scripts" / "verl-venv")], capture_output=True, text=True,
                             check=True).stdout.strip().splitlines()[-1]
    tiny = work / "tiny"
    cli("data", "countdown", "--out", tiny / "data", "--train", "64", "--test", "8", "--template", "tiny",
        "--max-number", "20", "--max-target", "50")
    cli("model", "tiny", "--out", tiny / "model", "--hidden-size", "128", "--layers", "2", "--heads", "4",
        "--max-int", "100")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny / "model")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(tiny / "model")
    spec = work / "verl.yaml"
    cli("init", "--recipe", "tinyzero-countdown-grpo", "--out", spec)
    sets = {"site.trainer_python": verl_py, "args.model": tiny / "model",
            "args.train_files": tiny / "data" / "train.parquet", "args.val_files": tiny / "data" / "test.parquet",
            "resources.gpus_per_node": 1, "resources.cpus_per_task": 8, "resources.mem_gb": "null",
            "budget.hours_min": "null", "env.RAY_TMPDIR": f"/tmp/hpcrl-bench-{os.getpid()}",
            "args.overrides": json.dumps(CPU_OVERRIDES)}
    args = {**TINY_ARGS, "total_epochs": 1000, "total_training_steps": 100_000, "save_freq": 100_000}
    sets.update({f"args.{k}": ("null" if v is None else v) for k, v in args.items()})
    sets.update({f"env.{k}": v for k, v in CPU_ENV.items()})
    argv = ["submit", spec, "--site", "local", "--name", "bench-verl", "--hours", hours, "--total-hours", "1",
            "--max-segments", "1"]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    cli(*argv, env={"PYTHONPATH": os.pathsep.join([str(DOUBLE_DIR), str(ROOT)])})
    return "bench-verl"


def submit_builtin(work: Path, hours: float) -> str:
    spec = work / "builtin.yaml"
    cli("init", "--recipe", "countdown-tiny", "--out", spec)
    cli("submit", spec, "--site", "local", "--name", "bench-builtin", "--hours", hours, "--total-hours", "1",
        "--max-segments", "1", "--set", "args.total_steps=100000")
    return "bench-builtin"


def breakdown(run_id: str) -> dict:
    from hpcrl.status import metrics as run_metrics
    from hpcrl.runs import Run

    run = Run.by_id(run_id)
    state = run.state()
    seg = state["segments"][0]
    walltime_s = float(state["budget"].get("hours") or 0) * 3600.0  # as `status` reads it (report.run_facts)
    recs = [r for r in run_metrics.read_records(run.layout.metrics) if run_metrics.is_train(r) and r.get("segment") == 1]
    if not recs:
        return {"run": run_id, "state": state["state"], "error": "no training record in segment 1"}
    first_step_s = recs[0].get("step_time_s") or recs[0].get("step_s") or 0.0
    began = recs[0]["time"] - first_step_s
    started, ended = seg["started"], seg["ended"]
    out = {"run": run_id, "state": state["state"], "rc": seg.get("rc"), "walltime_s": round(walltime_s, 1),
           "startup_s": round(began - started, 1), "training_s": round(recs[-1]["time"] - began, 1),
           "after_s": round(ended - recs[-1]["time"], 1), "unused_s": round(started + walltime_s - ended, 1),
           "steps": len(recs), "first_step_s": round(first_step_s, 2)}
    out["goodput_excl_startup"] = round(out["training_s"] / max(1e-9, walltime_s - out["startup_s"]), 3)
    shown = json.loads(cli("status", run_id, "--json"))
    rows = shown if isinstance(shown, list) else [shown]
    out["status_goodput"] = [g.get("goodput") for row in rows for g in (row.get("goodput") or [])]
    if (run.dir / "verl-metrics").is_dir():
        out["tracker"] = int((run.layout.checkpoints / "latest_checkpointed_iteration.txt").read_text())
        out["last_record_step"] = recs[-1]["step"]
        steps = [r.get("step_s") for r in recs[1:] if r.get("step_s")]
        out["median_step_s"] = round(sorted(steps)[len(steps) // 2], 2) if steps else None
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hours", type=float, default=0.08, help="segment length (0.08 h = 4.8 min)")
    p.add_argument("--only", choices=("verl", "builtin"))
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hpcrl-bench-verl-"))
    os.environ["HPCRL_HOME"] = str(work / "home")
    os.environ["HPCRL_SITES_DIR"] = str(work / "sites")
    (work / "sites").mkdir()
    load = os.getloadavg()
    out = {}
    for name, submit in (("verl", submit_verl), ("builtin", submit_builtin)):
        if a.only and a.only != name:
            continue
        run_id = submit(work, a.hours)
        wait_done(run_id, a.hours * 3600 + 900)
        out[name] = breakdown(run_id)
        print(json.dumps(out[name]), flush=True)
    if len(out) == 2:
        gap = out["builtin"].get("goodput_excl_startup", 0) - out["verl"].get("goodput_excl_startup", 0)
        print(json.dumps({"segment_h": a.hours, "builtin_minus_verl_points": round(100 * gap, 1),
                          "goal_met": gap <= 0.10, "load_before": [round(x, 1) for x in load],
                          "load_after": [round(x, 1) for x in os.getloadavg()]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
