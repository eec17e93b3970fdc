"""Run model-written Python against a row's tests, away from the trainer. Stdlib only (verl's reward
workers import it through hpcrl/rewards/score.py).

One sample = one process tree. As root (namespaces) it is forked by the trainer's fork server
(_ForkServer: one pre-started interpreter per trainer process, the harness already loaded) and
runs the harness's main() below, no exec. Otherwise, and when the server cannot serve, it is
started as an argv list (no shell):

    [unshare --user --map-root-user --mount ... (userns only)]  python -I -S -c BOOT

BOOT reads the harness's code object (marshal) from stdin and runs it; the harness reads the
payload after it, in two parts. As root it joins the sample's cgroups (cgroups.py), unshares
mount, network, pid, ipc and uts namespaces itself and forks: the child is pid 1 of them. pid 1
builds the sample's own root (private_mounts: /usr and the interpreter's prefix read-only, a few
device nodes, its own /proc, scratch tmpfs /tmp and /dev/shm; pivot_root, the old root detached).
From the first part alone (the code, the limits) it forks the program's process
(sandbox_program.py); only then does it read the second part, the tests, and fork the test
interpreter (sandbox_tester.py) with them. Each switches to a uid of its own (as root: 2^30 + the
harness's host pid for the program, 2^23 above that for the interpreter), sets rlimits, closes
the kernel's doors a sample has no use for (sandbox_seccomp.py), clears the environment; the
program works in /tmp/work (its cwd, HOME and TMPDIR).

Isolation levels (`isolation()` finds the best this host allows, once per process, and says it
on stderr):
- namespaces (root): all of the above.
- userns (non-root, unprivileged user namespaces allowed; never as root, where it would map the
  sample to uid 0 with every capability): the same namespaces and root, but the program keeps
  your uid, with per-process limits only.
- plain (neither): a new session with rlimits, a fresh temp dir as cwd/HOME, an empty
  environment, a uid of its own as root, and a sweep afterwards for processes carrying this
  sample's marker. It hides nothing else, so it refuses (reason `refused`) unless
  HPCRL_SANDBOX_PLAIN=1.

Reward hacking: the program's process never decides a verdict and never holds a test. The test
interpreter runs each test's text with the real builtins and the modules the test uses; the names
that cross to the program are only the task's (_test_plans: used by the test, defined by neither
the builtins, a module, nor the test), each a proxy whose calls go to the program as plain data
and come back as plain data (a subclass as its built-in content, any other object as a handle,
arguments changed in place copied back). A program that rebinds `set`, defines `class math` or
returns a str whose methods lie changes nothing on the interpreter's side, and the trainer does
no work on a program's values at all: it reads one verdict per test. What cannot cross (a
function of the test's passed to the program, `is` between two objects) runs alone beside the
program in a sandbox of its own, counted (Result.inside, reward/judged_inside). docs/adapt.md
states the guarantee; tests/rl/forgeries.py and tests/rl/test_forgery_classes.py are the forgeries it stops.
"""

from __future__ import annotations

import array
import ast
import builtins
import functools
import json
import marshal
import math
import os
import re
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field


def _sibling(module: str):
    """hpcrl.rewards.<module>, or where verl loaded this file by path (a module without a package:
    `from . import judge` fails there), the <module>.py shipped beside it (RUN/verl/)."""
    if __package__:
        import importlib

        return importlib.import_module(f"{__package__}.{module}")
    import importlib.util

    name = f"hpcrl_verl_{module}"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), module + ".py")
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or not os.path.isfile(path):
            raise ImportError(f"code reward: {path} is missing (it ships beside sandbox.py)")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # registered first: its dataclasses look their module up by name
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


_cgroups = _sibling("cgroups")
_extract_mod = _sibling("extract")

NOBODY = 65534
MAX_CODE_CHARS = 100_000     # longer answers are not compiled in the trainer
_RESULT_CAP = 1 << 23  # bytes of values and outputs the trainer reads from one sample, at most
NS_FLAGS = ["--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "--uts"]
USERNS_FLAGS = ["--user", "--map-root-user", *NS_FLAGS]
# With namespaces (root) or userns (a user), samples fork from one pre-started server instead of
# exec'ing an interpreter each (see _ForkServer, _served); HPCRL_SANDBOX_FORK_SERVER=0 keeps one
# exec per sample.
FORK_SERVER = os.environ.get("HPCRL_SANDBOX_FORK_SERVER", "1") != "0"


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0      # wall clock for the whole sample, startup included
    cpu_s: int = 4              # RLIMIT_CPU of each of the sample's processes
    memory_mb: int = 512        # RLIMIT_AS of the worker
    file_mb: int = 8            # RLIMIT_FSIZE: largest file it may write
    open_files: int = 64        # RLIMIT_NOFILE
    processes: int = 32         # RLIMIT_NPROC of uid nobody (shared by the samples running at once)
    output_kb: int = 1024       # what print() may produce per test before it fails
    tmp_mb: int = 64            # size of each private tmpfs


# A spec's code_timeout_s is CPU time, not wall time: a sample's outcome must not depend on how
# loaded the machine is (on a shared node, under the full suite here, correct samples stalled past
# a 5 s wall clock and scored `timeout`), and a resumed run must score as the first did. The wall
# clock stays a backstop, several times longer, for a program that sleeps or blocks instead.
WALL_FACTOR, WALL_SLACK_S = 3.0, 5.0


def cpu_limits(code_timeout_s: float, memory_mb: int = 512) -> Limits:
    """Limits whose timeout is code_timeout_s of CPU (RLIMIT_CPU, whole seconds, of each process
    of the sample), with a wall-clock backstop of WALL_FACTOR x that + WALL_SLACK_S."""
    cpu = max(1, math.ceil(code_timeout_s))
    return Limits(timeout_s=WALL_FACTOR * cpu + WALL_SLACK_S, cpu_s=cpu, memory_mb=memory_mb)


@dataclass
class Result:
    score: float                # fraction of tests passed (plus format score, see score_code)
    passed: int
    total: int
    reason: str                 # ok | wrong_answer | not_data | error | syntax_error | timeout | crash | output_limit | no_code | no_tests
    seconds: float = 0.0
    detail: str = ""            # first failure's message, short
    per_test: list = field(default_factory=list)
    inside: int = 0             # tests whose verdict came from the program's side (not split: see docs/adapt.md)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("per_test")
        return d


# ------------------------------------------------------------------ extraction

# extract.py reads the answer's fences line by line (the shapes real models write); kept here
# under these names because reward files call sandbox.extract_code (docs/adapt.md)
extract = _extract_mod.extract
extract_code = _extract_mod.extract_code
has_fenced_block = _extract_mod.has_fenced_block


# ------------------------------------------------------------------ isolation

_LEVELS = {
    "namespaces": "own root (interpreter and /usr read-only, scratch tmpfs), no network, own pid/ipc/uts, "
                  "a uid of its own, cgroup limits where one can be made",
    "userns": "own root, no network, own pid/ipc/uts, your uid mapped (no uid of its own, no cgroup)",
    "plain": "NO isolation: it reads your files and environment and reaches the network",
}


def isolation(python: str = sys.executable) -> str:
    """'namespaces', 'userns' or 'plain': the strongest this host allows (probed once, by
    scoring a trivial program through that level's own path), said once on stderr. As root,
    userns is never used: it maps the sample to uid 0 with every capability (root without
    CAP_SYS_ADMIN, as in many containers): plain then drops to a uid of its own instead."""
    level = _probe(os.path.realpath(python))
    if level not in _SAID:
        _SAID.add(level)
        allowed = "" if level != "plain" or plain_allowed() else \
            " - refused: every sample scores 0 (reason 'refused'); set HPCRL_SANDBOX_PLAIN=1 to allow it"
        sys.stderr.write(f"hpcrl sandbox: isolation level {level} ({_LEVELS[level]}){allowed}\n")
    return level


_SAID: set = set()


def plain_allowed() -> bool:
    return os.environ.get("HPCRL_SANDBOX_PLAIN", "0") == "1"


@functools.lru_cache(maxsize=None)
def _probe(python: str) -> str:
    if not sys.platform.startswith("linux"):
        return "plain"
    for name in ("namespaces", "userns"):
        if name == "namespaces" and os.geteuid() != 0:
            continue
        if name == "userns" and (shutil.which("unshare") is None or os.geteuid() == 0):
            continue
        try:
            probe = _run("def f():\n    return 1", ["assert f() == 1"], Limits(timeout_s=20), name, python,
                         time.monotonic(), server=False)
        except OSError:
            continue
        if probe.score == 1.0:
            return name
    return "plain"


def _argv(level: str, python: str) -> list:
    # as root the harness makes its namespaces itself (enter_namespaces); a user's spawned sample
    # leaves its user namespace's id maps to util-linux's unshare (forked: enter_namespaces too)
    prefix = [shutil.which("unshare") or "unshare", *USERNS_FLAGS] if level == "userns" else []
    return [*prefix, python, "-I", "-S", "-c", BOOT]


# The harness comes on stdin ahead of the payload, as marshal data: compiled once here, so a
# sample does not recompile ~200 lines of source (~2 ms, a third of a bare start), and not in
# argv, which the interpreter decodes and copies several times (~0.5 ms for 24 KB of hex).
# Read unbuffered (os.read of exact lengths): a buffered stdin would read ahead into the tests'
# part, and the program, forked before that part is read, would hold it in its memory.
BOOT = ("import marshal,posix as o\n"
        "def r(n):\n b=[]\n while n>0:\n  c=o.read(0,n)\n  if not c:break\n  b.append(c);n-=len(c)\n return b''.join(b)\n"
        "exec(marshal.loads(r(int.from_bytes(r(8),'little'))))")


SERVER_BOOT = ("import marshal,sys;g={'__name__':'hpcrl-fork-server','__builtins__':__builtins__};"
               "exec(marshal.load(sys.stdin.buffer),g);exec(marshal.load(sys.stdin.buffer),g);g['serve'](%d)")


@functools.lru_cache(maxsize=None)
def _server_blob() -> bytes:
    return marshal.dumps(compile(SERVER, "<hpcrl-sandbox-fork-server>", "exec", dont_inherit=True))


@functools.lru_cache(maxsize=None)
def _harness_blob(python: str) -> bytes:
    """marshal of the harness's code object; for another interpreter than this one (marshal's
    code format is version-specific) the source as a marshal string, which exec compiles."""
    if os.path.realpath(python) != os.path.realpath(sys.executable):
        return marshal.dumps(HARNESS, 2)
    return marshal.dumps(compile(HARNESS, "<hpcrl-sandbox-harness>", "exec", dont_inherit=True))


# ------------------------------------------------------------------ one sample

def run_tests(code: str, tests: list, limits: Limits = Limits(), level: str | None = None,
              python: str = sys.executable) -> Result:
    """Run `code` against `tests` (assert strings and/or {"input", "output"} pairs) in a sandbox:
    the program in one process, the tests in another (the test interpreter), which sends back
    only verdicts (see the module's docstring)."""
    t0 = time.monotonic()
    if not tests:
        return Result(0.0, 0, 0, "no_tests")
    tests = [_norm_test(t) for t in tests]
    if not code.strip():
        return Result(0.0, 0, len(tests), "no_code")
    if len(code) > MAX_CODE_CHARS:
        return Result(0.0, 0, len(tests), "syntax_error", detail=f"code longer than {MAX_CODE_CHARS} characters")
    try:  # compiling runs nothing; a syntax error needs no process
        compile(code, "solution.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as e:
        return Result(0.0, 0, len(tests), "syntax_error", time.monotonic() - t0, f"{type(e).__name__}: {e}"[:200])
    level = level or isolation(python)
    if level == "plain" and not plain_allowed():
        return Result(0.0, 0, len(tests), "refused", time.monotonic() - t0,
                      "isolation level plain hides nothing from the program: set HPCRL_SANDBOX_PLAIN=1 to allow it")
    return _run(code, tests, limits, level, python, t0, FORK_SERVER)


def _run(code: str, tests: list, limits: Limits, level: str, python: str, t0: float, server: bool) -> Result:
    """One sample: the program and the test interpreter in one sandbox; then each test that could
    not be run from outside the program alone beside it (judged inside, counted)."""
    tests = [_norm_test(t) for t in tests]
    try:
        out, marker, timed_out = _exchange_payload(code, "serve", _test_plans(tests), limits, level, python, t0,
                                                   server, load=any(isinstance(t, str) for t in tests))
    except _CannotStart as e:
        return Result(0.0, 0, len(tests), "crash", time.monotonic() - t0, str(e)[:200])
    verdicts = _read_verdicts(out, marker, timed_out, len(tests))
    if isinstance(verdicts, str):  # the sample as a whole timed out or crashed
        return Result(0.0, 0, len(tests), verdicts, time.monotonic() - t0)
    if _out_of_time(verdicts):
        return Result(0.0, 0, len(tests), "timeout", time.monotonic() - t0)
    inside = [i for i, v in enumerate(verdicts) if v[0] == "inside"]
    for i in inside:
        verdicts[i] = _inside_verdict(code, tests[i], limits, level, python, server)
    if _out_of_time(verdicts):
        return Result(0.0, 0, len(tests), "timeout", time.monotonic() - t0, inside=len(inside))
    per_test, reason, detail = [], "ok", ""
    for ok, kind, what in verdicts:
        per_test.append(ok)
        if not ok and reason == "ok":
            reason, detail = kind, what
    passed = sum(per_test)
    return Result(passed / len(tests), passed, len(tests), reason, time.monotonic() - t0, detail[:200], per_test,
                  len(inside))


_KINDS = ("error", "wrong_answer", "output_limit", "not_data", "timeout", "crash")


def _out_of_time(verdicts: list) -> bool:
    """Whether a process of the sample reached its CPU limit (a test's verdict `timeout`). The
    sample is then a timeout as a whole, 0 passed and no detail, as when the wall clock ends it
    (its verdicts unread): which of the two ends a program first depends on the machine's load,
    and the score and the code-repair feedback must not (a resumed run scores as the first did)."""
    return any(v[0] is False and v[1] == "timeout" for v in verdicts)


def _read_verdicts(out: bytes, marker: str, timed_out: bool, n: int):
    """[(passed, reason, detail), ...] for the n tests, or the reason the sample as a whole failed."""
    doc = "timeout" if timed_out else _doc(out, marker)
    if isinstance(doc, dict) and len(doc["tests"]) != n:
        doc = "crash"
    return doc if isinstance(doc, str) else [_verdict(v) for v in doc["tests"]]


def _verdict(v) -> tuple:
    """(passed, reason, detail) from the test interpreter's ["pass"] | ["fail", kind, text] | ["inside"]."""
    if v == ["pass"]:
        return True, "", ""
    if v == ["inside"]:
        return "inside", "", ""
    if isinstance(v, list) and len(v) == 3 and v[0] == "fail" and all(isinstance(x, str) for x in v):
        kind = "crash" if v[1] == "gone" else v[1]
        return False, kind if kind in _KINDS else "error", v[2]
    return False, "crash", ""


def _inside_verdict(code: str, test: str, limits: Limits, level: str, python: str, server: bool) -> tuple:
    """A test run beside the program in one process (a function of the test's passed to the
    program, an `is` between two of its values): the verdict is the program's process's, so the
    test runs alone, in a sandbox of its own that no other test's text reaches."""
    try:
        out, marker, timed_out = _exchange_payload(code, "inside", [[["exec", test]]], limits, level, python,
                                                   time.monotonic(), server)
    except _CannotStart as e:
        return False, "crash", str(e)[:200]
    doc = "timeout" if timed_out else _doc(out, marker)
    if isinstance(doc, str) or len(doc["tests"]) != 1 or not isinstance(doc["tests"][0], dict):
        return False, doc if isinstance(doc, str) else "crash", ""
    error = doc["tests"][0].get("error")
    if error is None:
        return True, "", ""
    kind, what = (list(error) + ["", ""])[:2] if isinstance(error, list) else ("error", "")
    return False, kind if kind in _KINDS else "error", str(what)


# ------------------------------------------------------------------ which names cross

_BUILTINS = frozenset(dir(builtins))
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ())) - {"__future__"}


def _test_plans(tests: list) -> list:
    """What the test interpreter runs: ("io", stdin, stdout) or ("t", source, crossing names,
    stdlib modules to import, judged inside). A name crosses to the program when the test uses it
    and neither the builtins, a module, nor the test itself (or an earlier test) define it."""
    plans, bound = [], set()
    for t in tests:
        if isinstance(t, dict):
            plans.append(("io", t["input"], t["output"]))
            continue
        used, binds, modules, imported, inside = _names(t)
        crossing = sorted(used - bound - _BUILTINS - modules)
        # modules: those used without an import (MBPP's math); imported: preloaded (the tester)
        plans.append(("t", t, crossing, sorted(modules - bound), inside, sorted(imported)))
        bound |= binds
    return plans


@functools.lru_cache(maxsize=4096)
def _names(test: str) -> tuple:
    """(names used, names bound, stdlib modules used as modules, needs the inside path) of one
    test's text. Parsing runs nothing. A stdlib module's name counts as the module only where the
    test uses it as one (`math.isclose`): a program's function `array(...)` is the program's."""
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return frozenset(), frozenset(), frozenset(), frozenset(), False  # the interpreter reports the error
    used, binds, as_attr, other, imported = set(), set(), set(), set(), set()
    inside = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else binds).add(node.id)
        elif isinstance(node, ast.alias):
            binds.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imported |= {(a.name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
                         for a in node.names} & _STDLIB
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            binds.add(node.name)
        elif isinstance(node, ast.arg):
            binds.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            binds.add(node.name)
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            sides = [node.left, *node.comparators]
            for k, op in enumerate(node.ops):
                if isinstance(op, (ast.Is, ast.IsNot)) and not any(
                        isinstance(x, ast.Constant) and x.value in (None, True, False, Ellipsis)
                        for x in (sides[k], sides[k + 1])):
                    inside = True  # identity of two objects: only the program's process has both
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            as_attr.add(node.value.id)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in _STDLIB:
            other.add(node.id)
    attr_values = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    plain_uses = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
                  and id(n) not in attr_values}
    modules = {n for n in other if n in as_attr and n not in plain_uses}
    return frozenset(used - binds), frozenset(binds), frozenset(modules), frozenset(imported), inside


def _exchange_payload(code: str, mode: str, sent: list, limits: Limits, level: str, python: str, t0: float,
                      server: bool, load: bool = True) -> tuple[bytes, str, bool]:
    """(what the sandbox wrote, its marker, timed out). Two parts, read one at a time by the
    sample's pid 1: the program's (code, limits; mode `serve` forks the program on it alone) and
    `sent`: the tests (serve: for the test interpreter) or the steps the program runs itself."""
    marker = secrets.token_hex(8)
    work = None if level != "plain" else tempfile.mkdtemp(prefix="hpcrl-sandbox-")
    # load: the row has assert tests, so the program runs as a module at once (a row of stdin
    # tests only never runs it that way: one bit of the tests the program may know)
    head = {"code": code, "mode": mode, "load": load, "nonce": marker, "cap": _RESULT_CAP,
            "limits": asdict(limits), "ns": level != "plain", "drop": level != "userns" and os.geteuid() == 0,
            "unshare": level == "namespaces", "userns": False, "work": work, "prefix": sys.base_prefix}
    # the whole tree: the program and its children, the test interpreter (~20 MB), and the
    # harness (~30 MB, 3 processes) above them
    groups = head["cgroups"] = (_cgroups.make(limits.memory_mb + 96, limits.processes + 4)
                                if level == "namespaces" else [])
    try:
        if _served(level, python, server):
            # through the fork server, a userns sample makes its user namespace itself (the id
            # maps util-linux's unshare writes on the spawn path); the rest as with namespaces
            res = _SERVER.run(_frame(dict(head, unshare=True, userns=level == "userns")) + _frame(sent),
                              t0 + limits.timeout_s)
            if res is None and server == _PROBE:
                res = (b"", False)  # the probe is of the server's path: no spawn stands in for it
            if res is not None:
                return res[0], marker, res[1]
        # no server, or it could not be (re)started or died with the sample: this one execs instead
        return _exchange_in(_frame(head) + _frame(sent), marker, work, limits, level, python, t0)
    finally:
        _cgroups.remove(groups)


def _served(level: str, python: str, server) -> bool:
    """Whether a sample goes through the fork server: as root (namespaces), or as a user where
    the server's own user namespaces passed their probe (userns), for the trainer's interpreter."""
    if not server or os.path.realpath(python) != os.path.realpath(sys.executable):
        return False
    return level == "namespaces" or server == _PROBE or (level == "userns" and _userns_served(os.path.realpath(python)))


_PROBE = "probe"  # `server` of the probe below: the server's path only, no fallback to a spawn


@functools.lru_cache(maxsize=None)
def _userns_served(python: str) -> bool:
    """A user's samples may fork from the server only if a probe sample scores there: a host
    that lets util-linux's unshare map a user namespace but not a forked child (another LSM
    rule, say) keeps the spawn path."""
    try:
        probe = _run("def f():\n    return 1", ["assert f() == 1"], Limits(timeout_s=20), "userns", python,
                     time.monotonic(), server=_PROBE)
    except OSError:
        return False
    return probe.score == 1.0


def _frame(obj) -> bytes:
    return _frame_bytes(marshal.dumps(obj))


def _frame_bytes(blob: bytes) -> bytes:
    return len(blob).to_bytes(8, "little") + blob


def _exchange_in(payload: bytes, marker, work, limits, level, python, t0) -> tuple[bytes, str, bool]:
    env = {"HPCRL_SANDBOX": marker}  # nothing of the trainer's; the marker finds stragglers (plain)
    try:
        proc = subprocess.Popen(_argv(level, python), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env=env, close_fds=True, start_new_session=True,
                                cwd=work or "/")
    except OSError as e:
        if work:
            shutil.rmtree(work, ignore_errors=True)
        raise _CannotStart(f"cannot start the sandbox: {e}") from None
    try:
        out, timed_out = _exchange(proc, _frame_bytes(_harness_blob(python)) + payload, t0 + limits.timeout_s)
    finally:
        _kill_all(proc, marker if level == "plain" else None)
        if work:
            shutil.rmtree(work, ignore_errors=True)
    return out, marker, timed_out


class _CannotStart(Exception):
    """The sandbox's interpreter could not be started: the sample scores a crash with this detail."""


def _norm_test(test):
    if isinstance(test, str):
        return test
    if isinstance(test, dict) and "input" in test and "output" in test:
        return {"input": str(test["input"]), "output": str(test["output"])}
    raise ValueError(f"a test is an assert string or an {{'input', 'output'}} object, not {test!r:.80}")


def _exchange(proc, data: bytes, deadline: float) -> tuple[bytes, bool]:
    """Write the payload, read at most _RESULT_CAP bytes of result until EOF or the deadline."""
    try:
        proc.stdin.write(data)
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    return _read_result(proc.stdout.fileno(), deadline)


def _read_result(fd: int, deadline: float) -> tuple[bytes, bool]:
    """At most _RESULT_CAP bytes from fd until EOF or the deadline; (bytes, timed out)."""
    chunks, size = [], 0
    while size < _RESULT_CAP:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), True
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 8192)
        if chunk.endswith(b"\n"):
            # the harness's whole output is one line, written by pid 1 alone: done, without waiting
            # for the sample's processes to exit (~1 ms: their memory unmapped before the pipe closes)
            chunks.append(chunk)
            return b"".join(chunks), False
        if not chunk:
            # EOF. The harness's output is one line ending in a newline; EOF before that line
            # is complete, at or past the deadline, is the wall-clock kill cutting it off (the
            # fork server kills at its own copy of this deadline, never earlier): a timeout, not
            # a crash. A loaded trainer can wake from select only after that kill, and see the
            # EOF rather than the deadline.
            out = b"".join(chunks)
            return out, not out.endswith(b"\n") and time.monotonic() >= deadline
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), False


class _ForkServer:
    """One long-lived `python -I -S` per trainer process, past start-up and the harness's imports,
    that forks a child per sample; the child makes the sample's namespaces and runs the harness
    exactly as a spawned one does (enter_namespaces, private_mounts, worker). What a sample no
    longer pays: the exec and start-up of an interpreter, unmarshalling the harness, the imports.

    Requests are one SOCK_SEQPACKET message (the timeout) carrying two pipe ends (SCM_RIGHTS):
    the payload's read end and the result's write end; the trainer writes the payload and reads
    the result on its own ends, as with a spawned sample. The server never reads a payload (the
    child does), so no sample's code or tests sit in the memory the next sample forks from. The
    server enforces each deadline itself (SIGKILL to the child's session; the child's pid-1 dies
    with it by PDEATHSIG, and the pid namespace with its init) and reaps only after that kill, so
    a pid it signals is never a reused one. It runs in its own session, with an empty
    environment, cwd /; it leaves when the trainer does (EOF on its socket), and its children
    die with it (PDEATHSIG: it is single-threaded). A sample cannot see or signal it (other pid namespace, uid nobody); if
    it dies anyway, the next call starts a new one, and a call it dropped runs through the
    spawn path."""

    def __init__(self):
        self.lock = threading.Lock()
        self.proc = self.sock = None

    def _start(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", SERVER_BOOT % theirs.fileno()],
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    env={}, close_fds=True, pass_fds=(theirs.fileno(),), start_new_session=True, cwd="/")
        except OSError:
            mine.close()
            raise
        finally:
            theirs.close()
        try:
            proc.stdin.write(_harness_blob(sys.executable) + _server_blob())
            proc.stdin.close()
        except OSError:
            pass  # it died at start-up: the first send fails and the call falls back
        self.proc, self.sock = proc, mine

    def _stop(self) -> None:
        if self.sock is not None:
            self.sock.close()
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
        self.proc = self.sock = None

    def _submit(self, fds: list, timeout: float) -> bool:
        msg = [struct.pack("d", timeout)]
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        with self.lock:
            for _ in range(2):  # a dead server is restarted once per call
                if self.proc is None or self.proc.poll() is not None:
                    self._stop()
                    try:
                        self._start()
                    except OSError:
                        return False
                try:
                    self.sock.sendmsg(msg, rights)
                    return True
                except OSError:
                    self._stop()
            return False

    def forget(self) -> None:
        """In a forked trainer process: the server is the parent's, and the lock may have been
        held by a thread that does not exist here. Drop both (this copy of the socket closes, so
        the parent's server still sees EOF when the parent goes); a new server starts on demand."""
        self.lock = threading.Lock()
        self.proc = self.sock = None

    def alive(self, grace: float = 0.0) -> bool:
        with self.lock:
            if self.proc is None:
                return False
            try:
                self.proc.wait(grace)
                return False
            except subprocess.TimeoutExpired:
                return True

    def run(self, payload: bytes, deadline: float):
        """(output, timed_out), or None when the sample should go through the spawn path."""
        inp_r, inp_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            sent = self._submit([inp_r, out_w], max(0.05, deadline - time.monotonic()))
        finally:
            os.close(inp_r)
            os.close(out_w)
        if not sent:
            os.close(inp_w)
            os.close(out_r)
            return None
        # _exchange_fds closes inp_w (the child reads the payload to EOF); closing it again here
        # could close another thread's new fd of the same number
        try:
            out, timed_out = _exchange_fds(inp_w, out_r, payload, deadline)
        finally:
            os.close(out_r)
        # no result line at all: the server may have died with the sample in it. Its children
        # get PDEATHSIG before it becomes a zombie, so the pipe's EOF can arrive a moment before
        # it is seen dead; a sample whose harness died otherwise is rare enough to wait for.
        if not out and not timed_out and not self.alive(grace=0.1):
            return None
        return out, timed_out


def _exchange_fds(wfd: int, rfd: int, data: bytes, deadline: float) -> tuple[bytes, bool]:
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(wfd, view):]
    except OSError:
        pass
    finally:
        os.close(wfd)
    return _read_result(rfd, deadline)


_SERVER = _ForkServer()
os.register_at_fork(after_in_child=_SERVER.forget)


def _kill_all(proc, marker: str | None) -> None:
    """SIGKILL the sample's session; with namespaces that ends its pid namespace and everything
    in it. Without, sweep /proc for processes that left the group but kept the marker."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.stdout.close()
    proc.wait()
    if marker:
        for _ in range(3):
            if not _sweep(marker):
                break


def _sweep(marker: str) -> int:
    needle, killed = f"HPCRL_SANDBOX={marker}".encode(), 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    os.kill(int(pid), signal.SIGKILL)
                    killed += 1
        except OSError:
            continue
    return killed


_MAX_VALUES = 200_000  # JSON values one sample's claim may hold (each a Python object here)
_STRING_RE = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _too_many_values(body: bytes) -> bool:
    """True if the document holds more than _MAX_VALUES values: 8 MiB of `[],` is 2.8 million
    lists (~400 MB, seconds of this process's CPU) that json.loads would build. Every value after
    the first follows a `[`, `{`, `,` or `:`; those inside strings do not count."""
    def count(b):
        return sum(b.count(c) for c in (b"[", b"{", b",", b":"))
    return count(body) > _MAX_VALUES and count(_STRING_RE.sub(b'""', body)) > _MAX_VALUES


def _doc(out: bytes, marker: str, key: str = "tests"):
    """The sandbox's JSON document after its marker, or a reason string (timeout, crash, output_limit)."""
    for line in out.split(b"\n"):
        head, _, body = line.partition(b" ")
        if head != marker.encode():
            continue
        if _too_many_values(body):
            return "output_limit"
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError, MemoryError):
            return "output_limit" if len(out) >= _RESULT_CAP else "crash"
        if isinstance(doc, dict) and "died" in doc:  # the harness saw the worker die of a signal
            return "timeout" if doc["died"] in (9, 24) else "crash"  # SIGKILL/SIGXCPU: the CPU limit
        return doc if isinstance(doc, dict) and isinstance(doc.get(key), list if key == "tests" else dict) else "crash"
    return "crash"


def evaluate(code: str, exprs: list, limits: Limits = Limits(), level: str | None = None,
             python: str = sys.executable) -> list:
    """[(True, value) | (False, "why"), ...]: each expression evaluated in the program's own
    process after `code` (a probe of what a program sees there: its uid, files, limits), its
    value sent back as data and decoded here into plain built-in values. Never a verdict."""
    level = level or isolation(python)
    try:
        out, marker, timed_out = _exchange_payload(code, "values", [[["eval", e]] for e in exprs], limits, level,
                                                   python, time.monotonic(), FORK_SERVER)
    except _CannotStart as e:
        return [(False, str(e))] * len(exprs)
    doc = "timeout" if timed_out else _doc(out, marker)
    if isinstance(doc, str) or len(doc["tests"]) != len(exprs):
        return [(False, doc if isinstance(doc, str) else "crash")] * len(exprs)
    results = []
    for entry in doc["tests"]:
        try:
            error = entry.get("error")
            if error is not None:
                results.append((False, str(error[-1] if isinstance(error, list) and error else error)[:200]))
            else:
                results.append((True, decode(entry["values"][0])))
        except Exception:  # any claim it cannot read (an overflowing complex, ...) is not data
            results.append((False, "not_data"))
    return results


def cpu_times(programs: dict, repeats: int, limits: Limits = Limits(), level: str | None = None,
              python: str = sys.executable):
    """{name: [CPU seconds, ...]} of each program (name -> (code, statement)) run as a module then its statement, each
    repeat a fresh process, rounds interleaved, measured by the sandbox's pid 1 (wait4), and
    {name: why} for those that raised, crashed or ran out of time; or a reason string for the
    whole call. The sandbox's deadline covers every run: limits.timeout_s per run."""
    level = level or isolation(python)
    if level == "plain" and not plain_allowed():
        return "refused"
    sent = {"programs": [[n, c, stmt] for n, (c, stmt) in programs.items()], "repeats": int(repeats)}
    total = Limits(**{**asdict(limits), "timeout_s": limits.timeout_s * max(1, len(programs) * int(repeats))})
    try:
        out, marker, timed_out = _exchange_payload("", "time", sent, total, level, python, time.monotonic(),
                                                   FORK_SERVER)
    except _CannotStart:
        return "crash"
    doc = "timeout" if timed_out else _doc(out, marker, key="cpu")
    if isinstance(doc, str):
        return doc
    cpu, errors = doc.get("cpu"), doc.get("errors")
    if not isinstance(cpu, dict) or not isinstance(errors, dict) or set(cpu) != set(programs):
        return "crash"
    return ({n: [float(t) for t in ts] for n, ts in cpu.items()}, {n: str(e) for n, e in errors.items()})


MAX_DEPTH = 100      # nesting of a value (both sides agree on it)
MAX_ITEMS = 1 << 24  # the longest sequence decode() builds


def decode(value, depth: int = 0):
    """Plain built-in values from the sandbox's JSON (tagged: {"t": [...]} tuple, {"s": [...]}
    set, {"d": [[k, v], ...]} dict, {"b": "latin-1"} bytes, {"c": [re, im]} complex, {"x": hex} a
    long int); ValueError for anything else. What it returns is made here, of built-in types only,
    so no comparison with it runs code the program chose."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [decode(v, depth + 1) for v in value]
    if kind is dict and len(value) == 1:
        (tag, body), = value.items()
        if tag == "t" and type(body) is list:
            return tuple(decode(v, depth + 1) for v in body)
        if tag == "s" and type(body) is list:
            return frozenset(_hashable(decode(v, depth + 1) for v in body))
        if tag == "d" and type(body) is list and all(type(kv) is list and len(kv) == 2 for kv in body):
            keys = _hashable(decode(kv[0], depth + 1) for kv in body)
            return dict(zip(keys, (decode(kv[1], depth + 1) for kv in body)))
        if tag == "x" and type(body) is str and len(body) <= MAX_ITEMS:  # an int too long for decimal JSON
            return int(body, 16)
        if tag == "b" and type(body) is str:
            return body.encode("latin-1")
        if tag == "c" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
            return complex(*body)
    raise ValueError("not data")


def _hashable(items) -> list:
    """Set elements or dict keys, refused (ValueError) when many share a hash: int and tuple hashes
    are not randomised, so a program could send 100k colliding keys and make building the set
    here quadratic."""
    items = list(items)
    if len(items) - len({hash(x) for x in items}) > 64:  # TypeError for an unhashable one
        raise ValueError("colliding hashes")
    return items


# ------------------------------------------------------------------ batches

def run_batch(items: list, limits: Limits = Limits(), workers: int = 0, dedupe: bool = True) -> list:
    """Results for [(code, tests), ...] in order, at most `workers` samples at once (0: one per
    CPU). With `dedupe`, identical (code, tests) pairs of the batch run once and share the result."""
    keys = [json.dumps([c, t], sort_keys=True) for c, t in items]
    todo = {}
    for key, item in zip(keys, items):
        if not dedupe or key not in todo:
            todo.setdefault(key if dedupe else len(todo), item)
    # the affinity mask, shared by the node's ranks (issue 19); by path under verl, cpus.py beside
    workers = workers or _sibling("cpus").workers_per_rank()
    level = isolation()
    with ThreadPoolExecutor(max_workers=min(workers, max(1, len(todo)))) as pool:
        futures = {k: pool.submit(_run_tests_safe, c, t, limits, level) for k, (c, t) in todo.items()}
        done = {k: f.result() for k, f in futures.items()}
    return [done[k] for k in keys] if dedupe else [done[i] for i in range(len(items))]


def _run_tests_safe(code, tests, limits, level) -> Result:
    """run_tests that cannot lose a batch: an error scoring one sample scores it 0 with a reason."""
    try:
        return run_tests(code, tests, limits, level)
    except ValueError as e:  # a malformed test of the row (_norm_test)
        return Result(0.0, 0, len(tests) if isinstance(tests, list) else 0, "bad_tests", 0.0, str(e)[:200])
    except Exception as e:
        return Result(0.0, 0, len(tests) if isinstance(tests, list) else 0, "crash", 0.0,
                      f"{type(e).__name__}: {e}"[:200])


# ------------------------------------------------------------------ the harness (runs as pid 1)
#
# Real files beside this one (linters, coverage and reviewers see them), read and compiled here as
# before: sandbox_harness.py runs in the sample, sandbox_server.py is the fork server's loop,
# exec'd in the harness's globals (so main() and libc() are its own). Under verl they ship beside
# this file too.

def _source(name: str) -> str:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), name), encoding="utf-8") as f:
        return f.read()


# the harness's parts in one code object; the spawned one runs main() as its last statement
HARNESS = "\n".join(_source(name) for name in ("sandbox_harness.py", "sandbox_program.py", "sandbox_tester.py",
                                                 "sandbox_seccomp.py")) + '\nif __name__ == "__main__":\n    main()\n'
SERVER = _source("sandbox_server.py")
