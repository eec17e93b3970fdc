"""Run model-written Python against a row's tests, away from the trainer. Stdlib only (verl's reward
workers import it through hpcrl/rewards/score.py).

One sample = one process tree. As root (namespaces) it is forked by the trainer's fork server
(_ForkServer: one pre-started interpreter per trainer process, the harness already loaded) and
runs the harness's main() below, no exec. Otherwise, and when the server cannot serve, it is
started as an argv list (no shell):

    [unshare --user --map-root-user --mount ... (userns only)]  python -I -S -c BOOT

BOOT reads the harness's code object (marshal) from stdin and runs it; the harness reads
{code, tests, limits} after it. As root it joins the sample's cgroups (cgroups.py), unshares
mount, network, pid, ipc and uts namespaces itself and forks: the child is pid 1 of them. pid 1
builds the sample's own root (private_mounts: /usr and the interpreter's prefix read-only, a few
device nodes, its own /proc, scratch tmpfs /tmp and /dev/shm; pivot_root, the old root detached),
then forks a worker that switches to a uid of its own (2^30 + the harness's host pid, when the
trainer runs as root), sets rlimits, moves into /tmp/work (its cwd, HOME and TMPDIR), clears the
environment, and runs the code and the tests' calls. Their values come back on the harness's own
pipe.

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

Reward hacking: the sandbox never says whether a test passed. The trainer splits each assert test
into the call (sent to the sandbox) and the expected value and comparison (kept here: _plan), the
worker sends back the calls' values as JSON data and stdin/stdout tests' printed text, and _judge
compares them here after decode() made them plain built-in values (judge.py: the split and the
trusted evaluation). The program may do anything to its interpreter, the harness or its pipe: it
only ever holds calls and inputs, never an expected value, so what it can send is claims of
values, and a claim scores only if it is the answer. Tests that cannot be split run inside, each
in a sandbox of its own, and are counted (Result.inside). docs/adapt.md states the
guarantee; tests/rl/forgeries.py is the table of forgeries it stops.
"""

from __future__ import annotations

import array
import ast
import functools
import json
import marshal
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


_judge_mod = _sibling("judge")
_cgroups = _sibling("cgroups")
_extract_mod = _sibling("extract")

NOBODY = 65534
MAX_CODE_CHARS = 100_000     # longer answers are not compiled in the trainer
_RESULT_CAP = 1 << 23  # bytes of values and outputs the trainer reads from one sample, at most
NS_FLAGS = ["--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "--uts"]
USERNS_FLAGS = ["--user", "--map-root-user", *NS_FLAGS]
# With namespaces (root), samples fork from one pre-started server instead of exec'ing an
# interpreter each (see _ForkServer); HPCRL_SANDBOX_FORK_SERVER=0 keeps one exec per sample.
FORK_SERVER = os.environ.get("HPCRL_SANDBOX_FORK_SERVER", "1") != "0"


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0      # wall clock for the whole sample, startup included
    cpu_s: int = 4              # RLIMIT_CPU of the worker
    memory_mb: int = 512        # RLIMIT_AS of the worker
    file_mb: int = 8            # RLIMIT_FSIZE: largest file it may write
    open_files: int = 64        # RLIMIT_NOFILE
    processes: int = 32         # RLIMIT_NPROC of uid nobody (shared by the samples running at once)
    output_kb: int = 1024       # what print() may produce per test before it fails
    tmp_mb: int = 64            # size of each private tmpfs


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
    # as root the harness makes its namespaces itself (enter_namespaces); without root, the
    # user namespace's id maps are left to util-linux's unshare
    prefix = [shutil.which("unshare") or "unshare", *USERNS_FLAGS] if level == "userns" else []
    return [*prefix, python, "-I", "-S", "-c", BOOT]


# The harness comes on stdin ahead of the payload, as marshal data: compiled once here, so a
# sample does not recompile ~200 lines of source (~2 ms, a third of a bare start), and not in
# argv, which the interpreter decodes and copies several times (~0.5 ms for 24 KB of hex).
BOOT = "import marshal,sys;exec(marshal.load(sys.stdin.buffer))"


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
    """Run `code` against `tests` (assert strings and/or {"input", "output"} pairs) in a sandbox;
    the verdicts are reached here, from the values and outputs it sends back (see _judge)."""
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
    names = _judge_mod.program_names(code)
    plans = [_plan(t, names) if isinstance(t, str) else None for t in tests]
    exprs = [e for p in plans if p is not None for e in p.clean]
    clean = _clean_values(exprs, _judge_mod.program_imports(code), limits, level, python) if exprs else {}
    return _run_groups(code, tests, plans, clean, limits, level, python, t0, FORK_SERVER)


def _run(code: str, tests: list, limits: Limits, level: str, python: str, t0: float, server: bool) -> Result:
    """run_tests through one given path (isolation's probe: no fork server, a fixed level)."""
    tests = [_norm_test(t) for t in tests]
    names = _judge_mod.program_names(code)
    plans = [_plan(t, names) if isinstance(t, str) else None for t in tests]
    return _run_groups(code, tests, plans, {}, limits, level, python, t0, server)


def _run_groups(code, tests, plans, clean, limits, level, python, t0, server) -> Result:
    """One sandbox for the tests whose text holds no decision, and one more for each test that
    decides inside (a loop of asserts): no test's text reaches another test's program."""
    shared = [i for i, p in enumerate(plans) if p is None or not p.alone]
    groups = ([shared] if shared else []) + [[i] for i, p in enumerate(plans) if p is not None and p.alone]
    entries, reason = [None] * len(tests), None
    for group in groups:
        sent = [list(map(list, plans[i].steps)) if plans[i] is not None else {"input": tests[i]["input"]}
                for i in group]
        try:
            out, marker, timed_out = _exchange_payload(code, sent, limits, level, python, t0, server)
        except _CannotStart as e:
            return Result(0.0, 0, len(tests), "crash", time.monotonic() - t0, str(e)[:200])
        doc = "timeout" if timed_out else _doc(out, marker)
        if isinstance(doc, dict) and len(doc["tests"]) != len(group):
            doc = "crash"
        for k, i in enumerate(group):
            entries[i] = {"error": [doc, ""]} if isinstance(doc, str) else doc["tests"][k]
        if isinstance(doc, str) and shared and group is groups[0] and reason is None:
            reason = doc
    seconds = time.monotonic() - t0
    if reason is not None:  # the shared sandbox timed out or crashed: so did the sample
        return Result(0.0, 0, len(tests), reason, seconds, inside=sum(1 for p in plans if p is not None and p.inside))
    return _judge_entries(entries, tests, plans, clean, seconds)


def _exchange_payload(code: str, sent: list, limits: Limits, level: str, python: str, t0: float,
                      server: bool) -> tuple[bytes, str, bool]:
    """(what the sandbox wrote, its marker, timed out): `sent` is what the program's side may see
    of the tests (steps to run, stdin), never an expected value or output."""
    marker = secrets.token_hex(8)
    work = None if level != "plain" else tempfile.mkdtemp(prefix="hpcrl-sandbox-")
    payload = {"code": code, "tests": sent, "nonce": marker, "cap": _RESULT_CAP,
               "limits": asdict(limits), "ns": level != "plain", "drop": level != "userns" and os.geteuid() == 0, "unshare": level == "namespaces",
               "work": work, "prefix": sys.base_prefix}
    # the whole tree: the worker and its children, and the harness (~30 MB, 3 processes) above them
    groups = payload["cgroups"] = (_cgroups.make(limits.memory_mb + 32, limits.processes + 3)
                                   if level == "namespaces" else [])
    try:
        return _exchange_in(payload, marker, work, limits, level, python, t0, server)
    finally:
        _cgroups.remove(groups)


def _exchange_in(payload, marker, work, limits, level, python, t0, server) -> tuple[bytes, str, bool]:
    if server and level == "namespaces" and os.path.realpath(python) == os.path.realpath(sys.executable):
        res = _SERVER.run(payload, t0 + limits.timeout_s)
        if res is not None:
            return res[0], marker, res[1]
        # the server could not be (re)started or died with the sample: this one execs instead
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
        out, timed_out = _exchange(proc, _harness_blob(python) + marshal.dumps(payload), t0 + limits.timeout_s)
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

    def run(self, payload: dict, deadline: float):
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
            out, timed_out = _exchange_fds(inp_w, out_r, marshal.dumps(payload), deadline)
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


def _doc(out: bytes, marker: str):
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
        return doc if isinstance(doc, dict) and isinstance(doc.get("tests"), list) else "crash"
    return "crash"


def _judge(out: bytes, marker: str, tests: list, plans: list, timed_out: bool, seconds: float,
           clean: dict | None = None) -> Result:
    """The Result, from the values one sandbox sent (or its silence). Everything in `out` came
    from the program's side and is only data: values and outputs, compared here."""
    doc = "timeout" if timed_out else _doc(out, marker)
    if isinstance(doc, str) or len(doc["tests"]) != len(tests):
        return Result(0.0, 0, len(tests), doc if isinstance(doc, str) else "crash", seconds,
                      inside=sum(1 for p in plans if p is not None and p.inside))
    return _judge_entries(doc["tests"], tests, plans, clean or {}, seconds)


def _judge_entries(entries: list, tests: list, plans: list, clean: dict, seconds: float) -> Result:
    """Nothing in a claim can raise out of here: the trainer only ever sees a score (issue 28)."""
    inside = sum(1 for p in plans if p is not None and p.inside)
    per_test, reason, detail = [], "ok", ""
    for test, plan, entry in zip(tests, plans, entries):
        try:
            ok, why, what = _judge_one(test, plan, entry, clean)
        except Exception as e:  # a claim this judge failed to read scores 0, never stops the caller
            ok, why, what = False, "not_data", f"unreadable claim: {type(e).__name__}"
        per_test.append(ok)
        if not ok and reason == "ok":
            reason, detail = why, what
    passed = sum(per_test)
    return Result(passed / len(tests), passed, len(tests), reason, seconds, detail[:200], per_test, inside)


_KINDS = ("error", "wrong_answer", "output_limit", "not_data", "timeout", "crash")


def _judge_one(test, plan, entry, clean) -> tuple[bool, str, str]:
    if not isinstance(entry, dict):
        return False, "crash", ""
    error = entry.get("error")
    if error is not None:  # the program raised (or says so: it can only lose by it)
        kind, what = (list(error) + ["", ""])[:2] if isinstance(error, list) else ("error", "")
        return False, kind if kind in _KINDS else "error", str(what)
    if plan is None:  # stdin/stdout: only the output crossed back
        got = entry.get("stdout")
        if not isinstance(got, str):
            return False, "crash", ""
        return (True, "", "") if _same(got, test["output"]) else (False, "wrong_answer", "stdout differs")
    values = entry.get("values")
    if not isinstance(values, list) or len(values) != sum(1 for kind, _ in plan.steps if kind == "eval"):
        return False, "crash", ""
    ok, why = _judge_mod.judge(plan, values, [clean.get(e, (False, "no value")) for e in plan.clean])
    if ok:
        return True, "", ""
    if why.startswith("clean:"):
        return False, "error", "the test's expected side could not be evaluated: " + why[6:]
    return False, why, "a value is not data" if why == "not_data" else "a value differs from the expected one"


def _same(got: str, want: str) -> bool:
    norm = lambda s: [line.rstrip() for line in s.strip().splitlines()]
    return norm(got) == norm(want)


def evaluate(code: str, exprs: list, limits: Limits = Limits(), level: str | None = None,
             python: str = sys.executable) -> list:
    """[(True, value) | (False, "why"), ...]: each expression evaluated in the sandbox after
    `code`, its value sent back as data and decoded here into plain built-in values."""
    level = level or isolation(python)
    try:
        out, marker, timed_out = _exchange_payload(code, [[["eval", e]] for e in exprs], limits, level, python,
                                                   time.monotonic(), FORK_SERVER)
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


# ------------------------------------------------------------------ the trusted side's judgment
#
# The program's process is never asked whether a test passed: it is asked for values. judge.py
# splits each assert test, here in the trainer, into holes (what only the program can compute:
# its calls, sent to the sandbox) and everything else (comparisons, math.isclose, str methods,
# the expected side), evaluated here on the holes' values once decoded into plain built-in values.


_CLEAN: dict = {}   # (prelude, expected-side source) -> (True, value) | (False, error it raised)
_CLEAN_MAX = 4096
_TRANSIENT = ("timeout", "crash", "output_limit")  # a clean sandbox's failure that says nothing of the test


def _plan(test: str, names=frozenset()):
    return _judge_mod.plan(test, frozenset(names))


def _prelude(imports: tuple, exprs) -> str:
    """The clean sandbox's code: the program's plain imports, and an import of each name the
    expected sides use that no import binds (`collections.Counter(...)` in a test)."""
    lines = [f"try:\n    {imp}\nexcept BaseException:\n    pass" for imp in imports]
    names = set()
    for e in exprs:
        try:
            names |= {n.id for n in ast.walk(ast.parse(e, mode="eval")) if isinstance(n, ast.Name)}
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            pass
    lines += [f"try:\n    import {n}\nexcept BaseException:\n    pass" for n in sorted(names) if n.isidentifier()]
    return "\n".join(lines)


def _clean_values(exprs: list, imports: tuple, limits: Limits, level: str, python: str) -> dict:
    """The values of expected-side expressions, each evaluated in a sandbox without any program
    (test data and the program's plain imports only), remembered for later samples. A failure
    that says nothing of the expression (a timeout, a crash: a loaded machine) is retried once and
    never remembered; a test whose expected side still has no value fails (judge.judge)."""
    prelude = _prelude(imports, exprs)
    todo = sorted({e for e in exprs if (prelude, e) not in _CLEAN})
    got = {}
    for _ in range(2):
        if not todo:
            break
        for expr, res in zip(todo, evaluate(prelude, todo, limits, level, python)):
            got[expr] = res
        todo = [e for e in todo if not got[e][0] and got[e][1] in _TRANSIENT]
    if len(_CLEAN) + len(got) > _CLEAN_MAX:
        _CLEAN.clear()
    for expr, res in got.items():
        if res[0] or res[1] not in _TRANSIENT:
            _CLEAN[(prelude, expr)] = res
    return {e: _CLEAN.get((prelude, e)) or got.get(e, (False, "no value")) for e in exprs}


decode = _judge_mod.decode


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


HARNESS = _source("sandbox_harness.py")
SERVER = _source("sandbox_server.py")
