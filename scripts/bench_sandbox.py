"""Sandboxed code rewards per second vs bare `python -c` spawns, in the same run; and the pool's
scaling with workers.

    PYTHONPATH=. python scripts/bench_sandbox.py [--n 100] [--repeats 5] [--workers 1,2,4]

Prints one JSON object. Compare ratios, not absolute rates: they depend on the machine and on
what else runs on it. The overhead is measured call by call, a bare spawn then a sandboxed
sample, alternating, so a burst of load on a shared machine hits both alike; each repeat gives
median(sandbox call) / median(bare call), and the figure is the median of the repeats' ratios.
Both sides start a fresh interpreter per sample (the sandbox: one exec, then forks inside its
namespaces); neither reuses a process.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=100, help="calls of each kind per repeat")
    p.add_argument("--repeats", type=int, default=5, help="repeats; the median of their ratios is reported")
    p.add_argument("--workers", default="1,2,4", help="pool sizes to measure")
    ns = p.parse_args()
    level = sandbox.isolation()
    sandboxed()  # probe + warm caches
    out = {"isolation": level, "n": ns.n, "repeats": ns.repeats, "python": sys.version.split()[0]}
    ratios, bare_ms, sandbox_ms = [], [], []
    for _ in range(ns.repeats):
        b, s = [], []
        for _ in range(ns.n):
            b.append(timed(bare_spawn))
            s.append(timed(sandboxed))
        bare_ms.append(statistics.median(b) * 1000)
        sandbox_ms.append(statistics.median(s) * 1000)
        ratios.append(sandbox_ms[-1] / bare_ms[-1])
    out["median_call_ms"] = {"bare": round(statistics.median(bare_ms), 2),
                             "sandbox": round(statistics.median(sandbox_ms), 2)}
    out["overhead_ratios"] = [round(r, 3) for r in ratios]
    out["overhead_vs_bare_spawn"] = round(statistics.median(ratios), 3)
    scaling = {}
    for w in (int(x) for x in ns.workers.split(",")):
        scaling[w] = round(rate(sandboxed, ns.n, w), 1)
    base = scaling.get(1) or 1000 / out["median_call_ms"]["sandbox"]
    out["pool_per_s"] = scaling
    out["pool_speedup"] = {w: round(r / base, 2) for w, r in scaling.items()}
    batch = [(f"def f(x):\n    return x * {i}", [f"assert f(2) == {2 * i}"]) for i in range(64)]
    t0 = time.perf_counter()
    assert all(r.score == 1.0 for r in sandbox.run_batch(batch, dedupe=False))
    out["batch64_run_batch_s"] = round(time.perf_counter() - t0, 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
