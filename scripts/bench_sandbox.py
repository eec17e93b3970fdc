"""Sandboxed code rewards per second vs bare `python -c` spawns, in the same run; and the pool's
scaling with workers.

    PYTHONPATH=. python scripts/bench_sandbox.py [--n 200] [--workers 1,2,4]

Prints one JSON object. Compare ratios (overhead = bare rate / sandbox rate), not absolute
rates: they depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcrl.rl import sandbox  # noqa: E402

CODE = "def f(a, b):\n    return a + b"
TESTS = ["assert f(1, 2) == 3", "assert f(2, 2) == 4"]


def bare_spawn() -> None:
    """What any process-per-sample reward pays at least: start the interpreter, run the code."""
    subprocess.run([sys.executable, "-I", "-S", "-c", CODE + "\n" + "\n".join(TESTS)], env={},
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True)


def sandboxed() -> None:
    assert sandbox.run_tests(CODE, TESTS).score == 1.0


def rate(fn, n: int, workers: int) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(lambda _: fn(), range(n)))
    return n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200, help="samples per measurement")
    p.add_argument("--workers", default="1,2,4", help="pool sizes to measure")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best of each is kept")
    ns = p.parse_args()
    level = sandbox.isolation()
    sandboxed()  # probe + warm caches
    out = {"isolation": level, "n": ns.n, "python": sys.version.split()[0]}
    best = {"bare": 0.0, "sandbox": 0.0}
    for _ in range(ns.rounds):  # alternate so drift in machine load hits both alike
        best["bare"] = max(best["bare"], rate(bare_spawn, ns.n, 1))
        best["sandbox"] = max(best["sandbox"], rate(sandboxed, ns.n, 1))
    out["one_worker_per_s"] = {k: round(v, 1) for k, v in best.items()}
    out["overhead_vs_bare_spawn"] = round(best["bare"] / best["sandbox"], 3)
    scaling = {}
    for w in (int(x) for x in ns.workers.split(",")):
        scaling[w] = round(rate(sandboxed, ns.n, w), 1)
    base = scaling.get(1) or best["sandbox"]
    out["pool_per_s"] = scaling
    out["pool_speedup"] = {w: round(r / base, 2) for w, r in scaling.items()}
    batch = [(f"def f(x):\n    return x * {i}", [f"assert f(2) == {2 * i}"]) for i in range(64)]
    t0 = time.perf_counter()
    assert all(r.score == 1.0 for r in sandbox.run_batch(batch, dedupe=False))
    out["batch64_run_batch_s"] = round(time.perf_counter() - t0, 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
