"""A cgroup per sample, where this process may make one (issue 28, neighbours): the sample's whole
process tree shares one memory limit and one process limit, so a sample cannot hold memory across
its children or starve a neighbour's fork. Stdlib only, no relative imports (verl loads it by path
beside sandbox.py).

cgroup v2 (a writable cgroup of ours whose subtree has memory and pids) or v1 (the memory and pids
hierarchies, each at this process's own group). Root here and in CI; Perlmutter users normally
cannot write either, and samples then have per-process limits only (the level says so)."""

from __future__ import annotations

import atexit
import functools
import os
import secrets
import threading
import time

ROOT = "/sys/fs/cgroup"


def _own(controller: str) -> str | None:
    """This process's group in a v1 hierarchy ("" for v2's unified line), from /proc/self/cgroup."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, names, path = line.rstrip("\n").split(":", 2)
                if controller in names.split(","):
                    return path
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=None)
def parents() -> tuple:
    """((kind, directory), ...): where a sample's groups go, or () when none can be made here."""
    v2 = os.path.join(ROOT, "cgroup.controllers")
    if os.path.isfile(v2):
        base = os.path.join(ROOT, (_own("") or "/").lstrip("/"))
        try:
            with open(os.path.join(base, "cgroup.subtree_control")) as f:
                enabled = f.read().split()
        except OSError:
            enabled = []
        if {"memory", "pids"} <= set(enabled) and _writable(base):
            return (("v2", base),)
        return ()
    found = []
    for ctl in ("memory", "pids"):
        own = _own(ctl)
        base = os.path.join(ROOT, ctl, (own or "/").lstrip("/"))
        if own is None or not _writable(base):
            return ()
        found.append((ctl, base))
    return tuple(found)


def _writable(base: str) -> bool:
    probe = os.path.join(base, f"hpcrl-probe-{os.getpid()}-{secrets.token_hex(3)}")
    try:
        os.mkdir(probe)
    except OSError:
        return False
    os.rmdir(probe)
    return True


def make(memory_mb: int, processes: int) -> list:
    """The files a sample's first process writes "0" (itself) to, one per group; [] where there
    are none. v1: the group's `tasks`, which moves the writing thread alone and so skips the
    kernel's global threadgroup lock, whose write side waits out an RCU grace period: ~10-20 ms a
    sample here through cgroup.procs, ~0.2 ms through tasks. The harness is one thread then, and
    its children are born in the group. v2 has no such file for a domain group: cgroup.procs."""
    global _SWEPT
    if not _SWEPT:
        _SWEPT = True
        with _LOCK:
            _PENDING.extend(_orphans())
    if _PENDING:
        sweep()
    name = f"hpcrl-sample-{os.getpid()}-{secrets.token_hex(4)}"
    made, procs = [], []
    try:
        for kind, base in parents():
            d = os.path.join(base, name)
            os.mkdir(d)
            made.append(d)
            limits = {"v2": {"memory.max": memory_mb << 20, "memory.swap.max": 0, "pids.max": processes},
                      "memory": {"memory.limit_in_bytes": memory_mb << 20},
                      "pids": {"pids.max": processes}}[kind]
            for key, value in limits.items():
                try:
                    with open(os.path.join(d, key), "w") as f:
                        f.write(str(value))
                except OSError:
                    if key != "memory.swap.max":  # absent without swap accounting
                        raise
            procs.append(os.path.join(d, "cgroup.procs" if kind == "v2" else "tasks"))
    except OSError:
        for d in made:
            try:
                os.rmdir(d)
            except OSError:
                pass
        return []
    return procs


_SWEPT = False       # orphans of dead trainers removed once per process
_PENDING: list = []  # sample groups whose processes were still dying when their sample ended
_LOCK = threading.Lock()


def _rmdir_or_kill(dirs: list) -> None:
    """rmdir each group; one whose processes are still going (the end of a pid namespace is
    asynchronous) is killed and left pending for the next call or exit, never waited on here."""
    left = []
    for d in dirs:
        try:
            os.rmdir(d)
        except FileNotFoundError:
            pass
        except OSError:
            _kill_in(d)
            left.append(d)
    with _LOCK:
        _PENDING.extend(left)


def remove(procs: list) -> None:
    """Remove each sample's group (procs: the files make() returned)."""
    _rmdir_or_kill([os.path.dirname(p) for p in procs])


def _orphans() -> list:
    """Sample groups of trainer processes that are gone (killed before their exit's sweep)."""
    found = []
    for _, base in parents():
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            parts = name.split("-")
            if len(parts) == 4 and parts[:2] == ["hpcrl", "sample"] and parts[2].isdigit() \
                    and not os.path.exists(f"/proc/{parts[2]}"):
                found.append(os.path.join(base, name))
    return found


def sweep(wait: float = 0.0) -> None:
    """Remove the groups left behind, retrying for up to `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        with _LOCK:
            todo, _PENDING[:] = list(_PENDING), []
        _rmdir_or_kill(todo)
        with _LOCK:
            left = bool(_PENDING)
        if not left or time.monotonic() >= deadline:
            return
        time.sleep(0.01)


atexit.register(sweep, 2.0)


def _kill_in(d: str) -> None:
    try:
        with open(os.path.join(d, "cgroup.procs")) as f:
            pids = [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return
    for pid in pids:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
