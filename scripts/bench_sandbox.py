"""Sandboxed code rewards per second vs bare `python -c` spawns, in the same run; and the pool's
scaling with workers.

    PYTHONPATH=. python scripts/bench_sandbox.py [--n 100] [--repeats 5] [--workers 1,2,4] [--compare OLD.py]

--compare loads another version of sandbox.py (e.g. `git show main:hpcrl/rewards/sandbox.py > /tmp/old.py`)
and measures it in the same rounds (its own fork server), as `other_fork` and `other_spawn`.

`batch_ms_per_sample` (KIND/WORKERS): 64 calls through a thread pool, bare spawns, this sandbox
and --compare's in turn; `batch_vs_bare_spawn` their ratio per round, the median.

Prints one JSON object. Compare ratios, not absolute rates: they depend on the machine and on
what else runs on it. Calls are measured one by one, each kind in turn (bare spawn, bare fork,
sandbox through the fork server, sandbox spawned), so a burst of load on a shared machine hits
all alike; each repeat gives median(kind) / median(bare spawn), and the figure is the median of
the repeats' ratios.

What is compared: a bare spawn starts a fresh interpreter and runs the code (what any
process-per-sample reward pays at least). The sandbox's fork server (namespaces level) does not
start an interpreter per sample: it forks one started once, and the program runs in that fork
(as it ran in the spawned harness's interpreter before: never in an interpreter of its own). So
the fair comparator for its isolation is a bare fork: this process forks, the child runs the
code, the parent waits. `fork_stages_ms` splits the fork server's call: bare fork -> the same
call with no namespaces (server round trip, the sample's process, the worker's fork, rlimits,
environment, payload, the test interpreter's process) -> full isolation (namespaces, the pid-1 fork, /proc, tmpfs and bind
mounts, uid nobody).
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcrl.rewards import sandbox  # noqa: E402

CODE = "def f(a, b):\n    return a + b"
TESTS = ["assert f(1, 2) == 3", "assert f(2, 2) == 4"]


def bare_spawn() -> None:
    """What any process-per-sample reward pays at least: start the interpreter, run the code."""
    subprocess.run([sys.executable, "-I", "-S", "-c", CODE + "\n" + "\n".join(TESTS)], env={},
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True)


def bare_fork() -> None:
    """The comparator for the fork server: a fork (no exec) that runs the code, no isolation."""
    pid = os.fork()
    if pid == 0:
        try:
            exec(CODE + "\n" + "\n".join(TESTS), {})
            os._exit(0)
        except BaseException:
            os._exit(1)
    assert os.waitpid(pid, 0)[1] == 0


def sandboxed() -> None:
    assert sandbox.run_tests(CODE, TESTS).score == 1.0


def sandbox_fork() -> None:
    sandbox.FORK_SERVER = True
    sandboxed()


def sandbox_spawn() -> None:
    sandbox.FORK_SERVER = False
    sandboxed()
    sandbox.FORK_SERVER = True


WORK = tempfile.mkdtemp(prefix="hpcrl-bench-")


def served_no_namespaces() -> None:
    """The fork server's call with the isolation switched off (bench only: the worker runs as
    this user in WORK): what is left is the server round trip and the harness's processes."""
    head = {"code": CODE, "mode": "serve", "nonce": "n0", "cap": sandbox._RESULT_CAP,
            "limits": asdict(sandbox.Limits()), "ns": False, "drop": False, "unshare": False, "work": WORK,
            "prefix": sys.base_prefix}
    payload = sandbox._frame(head) + sandbox._frame(sandbox._test_plans(TESTS))  # the tests go to the test interpreter
    out, _ = sandbox._SERVER.run(payload, time.monotonic() + 5)
    assert out == b'n0 {"tests":[["pass"],["pass"]]}\n', out


def _other(path: str) -> dict:
    """Calls through another version of the module (stdlib only, so it loads from its file alone)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sandbox_other", path)
    other = importlib.util.module_from_spec(spec)
    sys.modules["sandbox_other"] = other  # dataclasses look their module up there
    spec.loader.exec_module(other)

    def fork() -> None:
        other.FORK_SERVER = True
        assert other.run_tests(CODE, TESTS).score == 1.0

    def spawn() -> None:
        other.FORK_SERVER = False
        assert other.run_tests(CODE, TESTS).score == 1.0

    fork(), spawn()  # probe, start its server
    return {"other_fork": fork, "other_spawn": spawn}


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
    p.add_argument("--compare", help="another sandbox.py measured in the same rounds (e.g. main's)")
    ns = p.parse_args()
    level = sandbox.isolation()
    served = level == "namespaces"
    sandbox_fork()  # probe + start the server + warm caches
    sandbox_spawn()
    out = {"isolation": level, "n": ns.n, "repeats": ns.repeats, "python": sys.version.split()[0],
           "fork_server": served}
    kinds = {"bare_spawn": bare_spawn, "bare_fork": bare_fork, "sandbox_fork": sandbox_fork,
             "sandbox_spawn": sandbox_spawn}
    if served:
        kinds["fork_no_namespaces"] = served_no_namespaces
    if ns.compare:
        kinds.update(_other(ns.compare))
    medians = {k: [] for k in kinds}
    for _ in range(ns.repeats):
        calls = {k: [] for k in kinds}
        for _ in range(ns.n):
            for k, fn in kinds.items():
                calls[k].append(timed(fn))
        for k in kinds:
            medians[k].append(statistics.median(calls[k]) * 1000)
    out["median_call_ms"] = {k: round(statistics.median(v), 2) for k, v in medians.items()}
    ratio = lambda k, base: round(statistics.median(a / b for a, b in zip(medians[k], medians[base])), 3)
    shown = [k for k in ("sandbox_fork", "sandbox_spawn", "other_fork", "other_spawn") if k in kinds]
    out["overhead_ratios"] = {k: [round(a / b, 3) for a, b in zip(medians[k], medians["bare_spawn"])] for k in shown}
    out["overhead_vs_bare_spawn"] = {k: ratio(k, "bare_spawn") for k in shown + ["bare_fork"]}
    out["sandbox_fork_vs_bare_fork"] = ratio("sandbox_fork", "bare_fork")
    if served:
        m = out["median_call_ms"]
        out["fork_stages_ms"] = {"bare fork": m["bare_fork"],
                                 "+ server round trip, harness processes, rlimits": round(m["fork_no_namespaces"] - m["bare_fork"], 2),
                                 "+ namespaces, mounts, uid nobody": round(m["sandbox_fork"] - m["fork_no_namespaces"], 2)}
    # pool sizes take turns, `repeats` rounds of 4n calls each; the median rate per size (one
    # short window per size swung 1.5-4x with other work on the machine)
    sizes, rates = [int(x) for x in ns.workers.split(",")], {}
    for _ in range(ns.repeats):
        for w in sizes:
            rates.setdefault(w, []).append(rate(sandboxed, 4 * ns.n, w))
    scaling = {w: round(statistics.median(r), 1) for w, r in rates.items()}
    base = scaling.get(1) or 1000 / out["median_call_ms"]["sandbox_fork"]
    out["pool_per_s"] = scaling
    out["pool_speedup"] = {w: round(r / base, 2) for w, r in scaling.items()}
    # a batch's cost a sample: 64 calls through a pool, each kind in turn, against as many bare
    # spawns through the same pool (what a reward over a rollout batch pays)
    pools = {}
    for _ in range(ns.repeats):
        for w in sizes:
            for k in ("bare_spawn", "sandbox_fork", "other_fork"):
                if k in kinds:
                    pools.setdefault((k, w), []).append(1000 / rate(kinds[k], 64, w))
    out["batch_ms_per_sample"] = {f"{k}/{w}": round(statistics.median(v), 2) for (k, w), v in pools.items()}
    out["batch_vs_bare_spawn"] = {
        f"{k}/{w}": round(statistics.median(a / b for a, b in zip(v, pools[("bare_spawn", w)])), 3)
        for (k, w), v in pools.items() if k != "bare_spawn"}
    batch = [(f"def f(x):\n    return x * {i}", [f"assert f(2) == {2 * i}"]) for i in range(64)]
    t0 = time.perf_counter()
    assert all(r.score == 1.0 for r in sandbox.run_batch(batch, dedupe=False))
    out["batch64_run_batch_s"] = round(time.perf_counter() - t0, 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
