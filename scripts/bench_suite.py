#!/usr/bin/env python3
"""The whole suite as CI runs it, timed, on a fresh clone, optionally beside a CPU hog.

    scripts/bench_suite.py [--hog N] [--runs K] [--repo DIR] [--out FILE] [--times DIR]

Each run clones DIR (default: this checkout's committed HEAD) into ~/.cache/hpcrl-suite/ and runs
its `.ci/run` (that is `./scripts/test`: set-up, the Slurm cluster, both phases) with N busy
processes (`--hog`, default 0) spinning beside it for the whole run. It prints one line a run:
wall time, exit code, pytest's summary lines, and the machine's load average at the end; with
--out the lines are appended to FILE too. The hog is N `python -c "while True: pass"`s: a
neighbour that wants N whole cores, which on this 2-core machine is the suite's fair share
taken away.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def start_hog(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def one_run(repo: Path, hog: int, log: Path, times: Path | None = None) -> dict:
    # not under /tmp: doctor rightly fails a hooks interpreter there (compute nodes do not share
    # it), and the Slurm doctor tests use the clone's own .venv as one, as CI's clone does
    base = Path.home() / ".cache" / "hpcrl-suite"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=base))
    clone = work / "hpcrl"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    head = subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    env = {**os.environ, "CI": "true"}
    if times:  # tests/conftest.py writes each test's start and stop there (scripts/suite_times.py)
        times.mkdir(parents=True, exist_ok=True)
        env["HPCRL_TEST_TIMES"] = str(times)
    sampler = None
    if times:  # and where the CPU went (scripts/cpu_sampler.py), read by scripts/suite_times.py
        sampler = subprocess.Popen([sys.executable, str(REPO / "scripts" / "cpu_sampler.py"), str(times / "sampled.tsv")])
    hogs = start_hog(hog)
    t0 = time.monotonic()
    try:
        with log.open("w") as out:
            rc = subprocess.run(["bash", ".ci/run"], cwd=clone, stdout=out, stderr=subprocess.STDOUT,
                                env=env).returncode
    finally:
        for p in hogs:
            p.kill()
            p.wait()
        if sampler:
            sampler.terminate()
            sampler.wait()
    wall = time.monotonic() - t0
    text = log.read_text(errors="replace")
    summaries = re.findall(r"^=* ?(\d+ (?:passed|failed).*?) in ([\d.]+)s", text, re.M)
    shutil.rmtree(work, ignore_errors=True)
    return {"commit": head, "hog": hog, "rc": rc, "wall_s": round(wall), "phases": summaries,
            "load": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hog", type=int, default=0, help="busy processes beside the suite (default 0)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--repo", type=Path, default=REPO)
    ap.add_argument("--out", type=Path, help="append each run's line to this file too")
    ap.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()),
                    help="where each run's full output goes (suite-RUN.log)")
    ap.add_argument("--times", type=Path,
                    help="record each test's start and stop under DIR/run-K/ (see scripts/suite_times.py)")
    a = ap.parse_args()
    # a SIGTERM (a stopped benchmark) unwinds like ^C, so that the hog is killed, not orphaned
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    worst = 0
    for k in range(1, a.runs + 1):
        r = one_run(a.repo, a.hog, a.logs / f"suite-{k}.log", a.times / f"run-{k}" if a.times else None)
        phases = "; ".join(f"{s} in {t} s" for s, t in r["phases"]) or "no pytest summary (see the log)"
        line = (f"run {k}: commit {r['commit']}, hog {r['hog']}: rc {r['rc']}, {r['wall_s']} s "
                f"({r['wall_s'] / 60:.1f} min); {phases}; load at end {r['load']:.1f}")
        print(line, flush=True)
        if a.out:
            with a.out.open("a") as f:
                f.write(line + "\n")
        worst = worst or r["rc"]
    return worst


if __name__ == "__main__":
    sys.exit(main())
