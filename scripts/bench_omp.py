#!/usr/bin/env python3
"""OpenMP's wait policy for torch on a shared machine: spinning vs sleeping threads.

    scripts/bench_omp.py [--hog N] [--rounds R] [--steps S] [--threads T]

Runs the same small training loop (an MLP, AdamW, batch 32: the size of op a tiny model's step is
made of) in a fresh interpreter with torch.set_num_threads(T) (default 2, as the tiny recipes set),
once with OMP_WAIT_POLICY unset (libgomp's default: a waiting thread spins first) and once with
PASSIVE (it sleeps), alternating, R rounds, beside N busy processes (default 2). Prints each
run's wall and CPU seconds and the median ratio default / PASSIVE of each: a ratio, because the
machine is shared and its speed varies between rounds, not within one pair.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

LOOP = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
opt = torch.optim.AdamW(m.parameters())
x = torch.randn(32, 64)
t, c = time.monotonic(), time.process_time()
for _ in range(int(sys.argv[2])):
    loss = m(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print(json.dumps({"wall": time.monotonic() - t, "cpu": time.process_time() - c}))
"""


def one(policy: str | None, threads: int, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", LOOP, str(threads), str(steps)], env=env, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hog", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.hog)]
    wall, cpu = [], []
    try:
        for r in range(1, a.rounds + 1):
            spin, sleep = one(None, a.threads, a.steps), one("PASSIVE", a.threads, a.steps)
            print(f"round {r}: default wall {spin['wall']:.2f} s cpu {spin['cpu']:.2f} s; "
                  f"PASSIVE wall {sleep['wall']:.2f} s cpu {sleep['cpu']:.2f} s", flush=True)
            wall.append(spin["wall"] / sleep["wall"])
            cpu.append(spin["cpu"] / sleep["cpu"])
    finally:
        for p in hogs:
            p.kill()
    print(f"{a.steps} steps, {a.threads} threads, hog {a.hog}: default / PASSIVE, median of {a.rounds}: "
          f"wall {statistics.median(wall):.1f}x, cpu {statistics.median(cpu):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
