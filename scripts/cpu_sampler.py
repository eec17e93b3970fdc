#!/usr/bin/env python3
"""Which test the machine's CPU went to, sampled from /proc while a suite runs.

    scripts/cpu_sampler.py OUT.tsv [--interval S]     (runs until SIGTERM or ^C, then writes OUT)

Every S seconds (default 0.5) it reads each process's CPU time (utime + stime) and charges what it
used since the last sample to the test named by PYTEST_CURRENT_TEST in the process's environment
(pytest sets it for each test, and every process a test starts inherits it: CLI calls, segments,
torchrun ranks, Slurm jobs, Ray workers). A process's CPU before its first sample counts; what it
uses after its last one (at most S seconds of it) is lost, and so is a process shorter than S, so
the figures are a floor. The pytest workers' own CPU is not charged here (their environment does
not change per test): tests/conftest.py's timeline gives that. OUT: test id, CPU seconds, most
first; the last line, the machine's whole CPU time over the sampling and how much was charged.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu_of(pid: str) -> float | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14, 15)


def test_of(pid: str) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for item in env.split(b"\0"):
        if item.startswith(b"PYTEST_CURRENT_TEST="):
            return item.split(b"=", 1)[1].decode(errors="replace").rsplit(" (", 1)[0]
    return None


def machine_cpu() -> float:
    parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system = (int(x) for x in parts[:3])
    return (user + nice + system) / TICK


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--interval", type=float, default=0.5)
    a = ap.parse_args()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    seen: dict[str, tuple[str | None, float]] = {}  # pid -> (test, CPU at the last sample)
    charged: dict[str, float] = defaultdict(float)
    start = machine_cpu()
    try:
        while not stop:
            alive = set()
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                cpu = cpu_of(pid)
                if cpu is None:
                    continue
                alive.add(pid)
                test, last = seen.get(pid, (None, None))
                if last is None or cpu < last:  # new (or a reused pid)
                    test, last = test_of(pid), 0.0
                if test:
                    charged[test] += cpu - last
                seen[pid] = (test, cpu)
            for pid in set(seen) - alive:
                del seen[pid]
            time.sleep(a.interval)
    except KeyboardInterrupt:
        pass
    total = machine_cpu() - start
    lines = [f"{t}\t{c:.1f}" for t, c in sorted(charged.items(), key=lambda kv: -kv[1])]
    lines.append(f"# machine CPU {total:.0f} s, charged to tests {sum(charged.values()):.0f} s")
    a.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
