#!/usr/bin/env python3
"""Where a suite run's time went, from the per-test records tests/conftest.py writes when
HPCRL_TEST_TIMES is set (scripts/bench_suite.py --times DIR sets it).

    scripts/suite_times.py DIR [--top N] [--write-seconds tests/file_seconds.txt]

For each phase file in DIR (light.tsv, tiers.tsv): the phase's wall time, each worker's busy time
and files in the order it ran them, and the N files with the longest wall time (first test's
start to last test's stop). A file's wall time is what xdist's loadfile scheduling packs, so it is
the figure the files' order and the QUICK list are judged by. --write-seconds writes each file's
wall time as tests/conftest.py reads it to hand the longest files to the workers first.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path


def phase_files(d: Path) -> list[Path]:
    """The phases' timeline files in `d` (not the CPU records beside them)."""
    return sorted(p for p in d.glob("*.tsv") if not p.stem.endswith("-cpu") and p.stem != "sampled")


def load(path: Path) -> list[tuple[str, float, float, str, str, str]]:
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = line.split("\t")
        if len(parts) == 6:
            rows.append((parts[0], float(parts[1]), float(parts[2]), parts[3], parts[4], parts[5]))
    return rows


def report(name: str, rows: list, top: int) -> None:
    t0 = min(r[1] for r in rows)
    t1 = max(r[2] for r in rows)
    files: dict[str, list[float]] = {}
    owner: dict[str, str] = {}
    busy: dict[str, float] = defaultdict(float)
    for worker, start, stop, _outcome, _when, nodeid in rows:
        f = nodeid.split("::")[0]
        span = files.setdefault(f, [start, stop])
        span[0], span[1] = min(span[0], start), max(span[1], stop)
        owner[f] = worker
        busy[worker] += stop - start
    failed = sorted({r[5] for r in rows if r[3] == "failed"})
    print(f"== {name}: {t1 - t0:.0f} s wall, {len(files)} files, {len(failed)} failed")
    for worker in sorted(busy):
        mine = sorted((s[0], f) for f, s in files.items() if owner[f] == worker)
        # (a worker can own no file: another reported each file it ran a test of last)
        last = max((files[f][1] for _, f in mine), default=t0) - t0
        print(f"  {worker}: busy {busy[worker]:.0f} s, done at {last:.0f} s, {len(mine)} files")
    print(f"  longest files (wall s, start..stop from the phase's start, worker):")
    for f, (s, e) in sorted(files.items(), key=lambda kv: kv[1][0] - kv[1][1])[:top]:
        print(f"    {e - s:7.1f}  {s - t0:6.0f}..{e - t0:<6.0f} {owner[f]:5} {f}")
    for nodeid in failed:
        print(f"  FAILED {nodeid}")


def cpu_by_file(d: Path, top: int) -> None:
    """Each file's CPU: the pytest process's own, plus the larger of its waited-for children's and
    what scripts/cpu_sampler.py charged to its tests (the two overlap: a waited-for child is in
    both; a segment or a Slurm job left running is only in the sampler's)."""
    own: dict[str, float] = defaultdict(float)
    kids: dict[str, float] = defaultdict(float)
    sampled: dict[str, float] = defaultdict(float)
    for path in d.glob("*-cpu.tsv"):
        for line in path.read_text(encoding="utf-8").splitlines():
            nodeid, o, k = line.split("\t")
            own[nodeid] += float(o)
            kids[nodeid] += float(k)
    machine = ""
    if (d / "sampled.tsv").exists():
        for line in (d / "sampled.tsv").read_text(encoding="utf-8").splitlines():
            if line.startswith("#"):
                machine = line.lstrip("# ")
            elif "\t" in line:
                nodeid, c = line.rsplit("\t", 1)
                sampled[nodeid] += float(c)
    files: dict[str, list[float]] = {}
    for nodeid in set(own) | set(sampled):
        f = files.setdefault(nodeid.split("::")[0], [0.0, 0.0, 0.0])
        f[0] += own[nodeid]
        f[1] += max(kids[nodeid], sampled[nodeid])
    total = sum(o + c for o, c, _ in files.values())
    print(f"== CPU by file: {total:.0f} s in all ({machine or 'no sampler record'})")
    print("     CPU s   pytest  children  file")
    for f, (o, c, _) in sorted(files.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:top]:
        print(f"    {o + c:7.0f}  {o:7.0f}  {c:8.0f}  {f}")


def file_seconds(d: Path) -> dict[str, float]:
    """Each file's wall time (first start to last stop) across the phase files in `d`."""
    spans: dict[str, list[float]] = {}
    for path in phase_files(d):
        for _w, start, stop, _o, _when, nodeid in load(path):
            span = spans.setdefault(nodeid.split("::")[0], [start, stop])
            span[0], span[1] = min(span[0], start), max(span[1], stop)
    return {f: e - s for f, (s, e) in spans.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--write-seconds", type=Path, help="write each file's wall seconds there (tests/file_seconds.txt)")
    a = ap.parse_args()
    tsvs = phase_files(a.dir)
    if not tsvs:
        print(f"suite_times: no *.tsv in {a.dir} (run the suite with HPCRL_TEST_TIMES={a.dir})", file=sys.stderr)
        return 2
    for path in tsvs:
        rows = load(path)
        if rows:
            report(path.stem, rows, a.top)
    if any(a.dir.glob("*-cpu.tsv")):
        cpu_by_file(a.dir, a.top)
    if a.write_seconds:
        head = ("# Each test file's wall time in one full suite run (scripts/suite_times.py --write-seconds):\n"
                "# tests/conftest.py hands the longest files to the workers first. Relative figures only.\n")
        rows = sorted(file_seconds(a.dir).items(), key=lambda kv: (-kv[1], kv[0]))
        a.write_seconds.write_text(head + "".join(f"{sec:.0f} {f.removeprefix('tests/')}\n" for f, sec in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
