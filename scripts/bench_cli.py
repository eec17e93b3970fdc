#!/usr/bin/env python3
"""CLI and lifecycle benchmarks, as ratios to baselines measured in the same run.

    .venv/bin/python scripts/bench_cli.py [--repeat 15] [--slurm]

- start-up: `hpcrl --help`, `hpcrl render`, `hpcrl status` with 1,000 runs in the registry (piped,
  --json, and on a pseudo-terminal where rich draws), each against `python -c pass` (median of
  --repeat runs, interleaved so that machine noise hits both);
- local backend: per-segment overhead (a segment whose trainer does one instant step: job start to
  job end) and the resubmit gap (end of one segment to the start of the next);
- with --slurm (needs `scripts/slurm-cluster start`): the resubmit gap on the test cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(argv, env) -> float:
    t = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def timed_tty(argv, env) -> float:
    """Wall time of argv with its stdout on a pseudo-terminal (what a person at a terminal sees:
    rich draws), its output drained as it comes."""
    import pty
    import threading

    master, slave = pty.openpty()
    os.set_blocking(master, True)
    import fcntl
    import struct
    import termios

    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 120, 0, 0))  # a 120-column terminal

    def drain():
        try:
            while os.read(master, 65536):
                pass
        except OSError:
            pass

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    t = time.perf_counter()
    subprocess.run(argv, env={k: v for k, v in env.items() if k not in ("COLUMNS", "LINES")}, stdout=slave,
                   stderr=subprocess.DEVNULL, check=True)
    elapsed = time.perf_counter() - t
    os.close(slave)
    reader.join(5)
    os.close(master)
    return elapsed


def fake_registry(home: Path, n: int) -> None:
    """n finished runs, each with a state, a frozen spec, a checkpoint pointer and a metrics file."""
    from hpcrl import atomicio, lifecycle, runs

    os.environ["HPCRL_HOME"] = str(home)
    budget = {"hours": 1, "total_hours": 10, "max_segments": 10}
    for i in range(n):
        run_dir = home / "runs" / f"bench-{i:04d}"
        (run_dir / "checkpoints").mkdir(parents=True)
        state = lifecycle.new_state(run_dir.name, "local", "local", "smoke", budget, 1e9)
        state["state"] = lifecycle.RunState.COMPLETED.value
        state["segments"] = [{"job_id": str(k), "k": k + 1, "state": "CONTINUE", "started": 1e9 + k * 3600,
                              "ended": 1e9 + k * 3600 + 3500, "start_step": k * 10, "end_step": k * 10 + 10}
                             for k in range(3)]
        atomicio.atomic_write_json(run_dir / "state.json", state)
        atomicio.atomic_write_json(run_dir / "spec.json", {"site": {"name": "local", "scheduler": "local"},
                                                           "spec": {"trainer": "smoke", "args": {"steps": 30},
                                                                    "resources": {"nodes": 1}}})
        (run_dir / "checkpoints" / "LATEST").write_text("step-00000030\n")
        (run_dir / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "segment": (s - 1) // 10 + 1, "loss": 1 / s, "time": 1e9 + s * 350}) + "\n"
            for s in range(1, 31)))
        runs.register(run_dir.name, run_dir)


def bench_startup(repeat: int) -> dict:
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        fake_registry(home, 1000)
        env = dict(os.environ, HPCRL_HOME=str(home), HPCRL_SITES_DIR=str(Path(tmp) / "sites"))
        cases = {"python -c pass": [py, "-c", "pass"],
                 "hpcrl --help": [py, "-m", "hpcrl.cli", "--help"],
                 "hpcrl render --trainer smoke": [py, "-m", "hpcrl.cli", "render", "--trainer", "smoke"],
                 "hpcrl status (1,000 runs, piped)": [py, "-m", "hpcrl.cli", "status"],
                 "hpcrl status --json (1,000 runs)": [py, "-m", "hpcrl.cli", "status", "--json"],
                 "hpcrl status (1,000 runs, terminal: rich)": [py, "-m", "hpcrl.cli", "status"]}
        timed(cases["hpcrl status (1,000 runs, piped)"], env)  # the first one fills the finished-run cache
        timed(cases["hpcrl render --trainer smoke"], env)  # and the template's and the parsed YAML's
        samples = {k: [] for k in cases}
        for _ in range(repeat):
            for name, argv in cases.items():
                samples[name].append((timed_tty if "terminal" in name else timed)(argv, env))
    base = statistics.median(samples["python -c pass"])
    return {name: {"median_s": round(statistics.median(s), 4), "ratio": round(statistics.median(s) / base, 2)}
            for name, s in samples.items()}


def _segments_of(run_id: str, env) -> list[dict]:
    from hpcrl.runs import Run

    os.environ.update(env)
    return [s for s in Run.by_id(run_id).state()["segments"] if s.get("started")]


def _run_chain(site: str, hours: str, args: list[str], env, timeout_s: float) -> list[dict]:
    py = sys.executable
    name = f"bench-{site}-{int(time.time())}"
    subprocess.run([py, "-m", "hpcrl.cli", "submit", "--site", site, "--trainer", "smoke", "--hours", hours,
                    "--name", name, *args], env=env, check=True, stdout=subprocess.DEVNULL)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        out = subprocess.run([py, "-m", "hpcrl.cli", "status", name, "--json"], env=env, capture_output=True,
                             text=True, check=True).stdout
        if json.loads(out)[0]["state"] in ("COMPLETED", "FAILED", "STOPPED", "CANCELLED"):
            break
        time.sleep(1)
    return _segments_of(name, env)


def _gaps(segs: list[dict]) -> list[float]:
    return [round(b["started"] - a["ended"], 2) for a, b in zip(segs, segs[1:])]


def bench_local(tmp: Path) -> dict:
    sites = tmp / "sites"
    sites.mkdir()
    (sites / "benchlocal.yaml").write_text("extends: local\nsignal_lead_s: 3\nexit_margin_s: 1\nkill_grace_s: 2\n")
    env = dict(os.environ, HPCRL_HOME=str(tmp / "home"), HPCRL_SITES_DIR=str(sites))
    # Overhead: a segment whose trainer does one instant step (nothing but hpcrl's own work).
    one = _run_chain("benchlocal", "0.01", ["--set", "args.steps=1", "--set", "args.step_time_s=0"], env, 60)
    overhead = round(one[0]["ended"] - one[0]["started"], 3)
    chain = _run_chain("benchlocal", "0.002", ["--set", "args.steps=60", "--set", "args.step_time_s=0.1"], env, 120)
    return {"segment_overhead_s": overhead, "segments": len(chain), "resubmit_gaps_s": _gaps(chain)}


def bench_slurm(tmp: Path) -> dict:
    env = dict(os.environ, HPCRL_HOME=str(tmp / "home-slurm"))
    chain = _run_chain("testcluster", "0.0167", ["--set", "args.steps=240", "--set", "args.step_time_s=0.5"],
                       env, 600)
    return {"segments": len(chain), "resubmit_gaps_s": _gaps(chain)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--slurm", action="store_true", help="also measure the resubmit gap on the test cluster")
    ap.add_argument("--startup-only", action="store_true", help="only the start-up ratios")
    ns = ap.parse_args()
    results = {"startup": bench_startup(ns.repeat)}
    if ns.startup_only:
        print(json.dumps(results, indent=1))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        results["local"] = bench_local(Path(tmp))
        if ns.slurm:
            results["slurm"] = bench_slurm(Path(tmp))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
