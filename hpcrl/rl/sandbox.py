"""Run model-written Python against a row's tests, away from the trainer. Stdlib only (verl's reward
workers import it through hpcrl.rl.rewards).

One sample = one process tree, started as an argv list (no shell):

    [unshare --user --map-root-user --mount ... (userns only)]  python -I -S -c BOOT

BOOT reads the harness's code object (marshal) from stdin and runs it; the harness reads
{code, tests, limits} after it. As root it unshares mount, network, pid, ipc and uts namespaces
itself and forks: the child is pid 1 of them (util-linux's `unshare --fork --kill-child
--mount-proc` did this before at the cost of one more exec). The harness (pid 1) puts private tmpfs
mounts over /tmp, /var/tmp and /dev/shm, then forks a worker that switches to uid/gid `nobody`
(when the trainer runs as root), sets rlimits (CPU s, address space, file size, open files,
processes, no core), moves into a fresh directory that is its cwd, HOME and TMPDIR, clears the
environment, and runs the code and the tests. The result comes back on the harness's own pipe.

Isolation levels (`isolation()` finds the best this host allows, once per process):
- namespaces (root): all of the above. No network (a new network namespace has only a downed
  loopback), no view of the trainer's processes, files written anywhere vanish with the mount
  namespace, and every process the program started dies when the harness exits (the kernel kills
  a pid namespace with its init).
- userns (non-root, unprivileged user namespaces allowed): the same namespaces, but the program
  keeps your uid: files you own outside /tmp, /var/tmp, /dev/shm and HOME stay writable.
- plain (neither): a new session with rlimits, a fresh temp dir as cwd/HOME, an empty
  environment, and a sweep afterwards for processes carrying this sample's marker. The network
  is reachable, the program can signal your processes and write your files: run it in a
  container or as root for real isolation.

Reward hacking: the program runs in the harness's interpreter, so a program that inspects the
interpreter could forge its own result line. Stdin/stdout tests compare what it printed, which
is harder to fake than an assert it could monkeypatch; nothing here defends the reward from a
policy that attacks the harness itself.
"""

from __future__ import annotations

import functools
import json
import marshal
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

NOBODY = 65534
_FENCE_RE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.S | re.I)
MAX_CODE_CHARS = 100_000     # longer answers are not compiled in the trainer
_RESULT_CAP = 1 << 16  # bytes of result the trainer reads from one sample, at most
NS_FLAGS = ["--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "--uts"]
USERNS_FLAGS = ["--user", "--map-root-user", *NS_FLAGS]


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
    reason: str                 # ok | wrong_answer | error | syntax_error | timeout | crash | output_limit | no_code | no_tests
    seconds: float = 0.0
    detail: str = ""            # first failure's message, short
    per_test: list = field(default_factory=list)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("per_test")
        return d


# ------------------------------------------------------------------ extraction

def extract_code(solution_str: str) -> str:
    """The last fenced ```python block, else the whole answer (after a TinyZero 'Assistant:')."""
    if "Assistant:" in solution_str:
        solution_str = solution_str.split("Assistant:", 1)[1]
    blocks = _FENCE_RE.findall(solution_str)
    return blocks[-1] if blocks else solution_str.strip()


def has_fenced_block(solution_str: str) -> bool:
    return bool(_FENCE_RE.search(solution_str))


# ------------------------------------------------------------------ isolation

@functools.lru_cache(maxsize=None)
def isolation(python: str = sys.executable) -> str:
    """'namespaces', 'userns' or 'plain': the strongest this host allows (probed once, by
    scoring a trivial program through that level's own path)."""
    if not sys.platform.startswith("linux"):
        return "plain"
    for name in ("namespaces", "userns"):
        if name == "namespaces" and os.geteuid() != 0:
            continue
        if name == "userns" and shutil.which("unshare") is None:
            continue
        try:
            probe = run_tests("def f():\n    return 1", ["assert f() == 1"], Limits(timeout_s=20), name, python)
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
    """Run `code` against `tests` (assert strings and/or {"input", "output"} pairs) in a sandbox."""
    t0 = time.monotonic()
    if not tests:
        return Result(0.0, 0, 0, "no_tests")
    if not code.strip():
        return Result(0.0, 0, len(tests), "no_code")
    if len(code) > MAX_CODE_CHARS:
        return Result(0.0, 0, len(tests), "syntax_error", detail=f"code longer than {MAX_CODE_CHARS} characters")
    try:  # compiling runs nothing; a syntax error needs no process
        compile(code, "solution.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as e:
        return Result(0.0, 0, len(tests), "syntax_error", time.monotonic() - t0, f"{type(e).__name__}: {e}"[:200])
    level = level or isolation(python)
    marker = secrets.token_hex(8)
    work = None if level != "plain" else tempfile.mkdtemp(prefix="hpcrl-sandbox-")
    payload = {"code": code, "tests": [_norm_test(t) for t in tests], "nonce": marker,
               "limits": asdict(limits), "ns": level != "plain", "drop": level == "namespaces", "unshare": level == "namespaces",
               "work": work, "prefix": sys.base_prefix}
    env = {"HPCRL_SANDBOX": marker}  # nothing of the trainer's; the marker finds stragglers (plain)
    try:
        proc = subprocess.Popen(_argv(level, python), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env=env, close_fds=True, start_new_session=True,
                                cwd=work or "/")
    except OSError as e:
        return Result(0.0, 0, len(tests), "crash", detail=f"cannot start the sandbox: {e}")
    try:
        out, timed_out = _exchange(proc, _harness_blob(python) + marshal.dumps(payload), t0 + limits.timeout_s)
    finally:
        _kill_all(proc, marker if level == "plain" else None)
        if work:
            shutil.rmtree(work, ignore_errors=True)
    return _parse(out, marker, len(tests), timed_out, time.monotonic() - t0)


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
    fd, chunks, size = proc.stdout.fileno(), [], 0
    while size < _RESULT_CAP:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), True
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 8192)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), False


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


def _parse(out: bytes, marker: str, total: int, timed_out: bool, seconds: float) -> Result:
    if timed_out:
        return Result(0.0, 0, total, "timeout", seconds)
    # the line is `MARKER BITS REASON DETAIL` (BITS: one 1/0 per test), parsed as text only: the
    # program may have written it, and nothing it writes is decoded by anything richer
    for line in out.decode("utf-8", "replace").splitlines():
        parts = line.split(" ", 3)
        if len(parts) >= 3 and parts[0] == marker and set(parts[1]) <= {"0", "1", "-"}:
            per_test = [b == "1" for b in parts[1].strip("-")][:total]
            passed = sum(per_test)
            return Result(passed / total, passed, total, "ok" if passed == total else parts[2][:40],
                          seconds, (parts[3] if len(parts) > 3 else "")[:200], per_test)
    return Result(0.0, 0, total, "crash", seconds)


# ------------------------------------------------------------------ batches

def run_batch(items: list, limits: Limits = Limits(), workers: int = 0, dedupe: bool = True) -> list:
    """Results for [(code, tests), ...] in order, at most `workers` samples at once (0: one per
    CPU). With `dedupe`, identical (code, tests) pairs of the batch run once and share the result."""
    keys = [json.dumps([c, t], sort_keys=True) for c, t in items]
    todo = {}
    for key, item in zip(keys, items):
        if not dedupe or key not in todo:
            todo.setdefault(key if dedupe else len(todo), item)
    workers = workers or os.cpu_count() or 1
    level = isolation()
    with ThreadPoolExecutor(max_workers=min(workers, max(1, len(todo)))) as pool:
        futures = {k: pool.submit(run_tests, c, t, limits, level) for k, (c, t) in todo.items()}
        done = {k: f.result() for k, f in futures.items()}
    return [done[k] for k in keys] if dedupe else [done[i] for i in range(len(items))]


# ------------------------------------------------------------------ the harness (runs as pid 1)

HARNESS = r'''
# posix, not os: os's module body costs ~1 ms per sample, and these are its functions anyway
import posix as os, sys, marshal
def main():
    p = marshal.loads(sys.stdin.buffer.read())
    out = os.dup(1)
    nul = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(nul, fd)
    lim = p["limits"]
    if p["unshare"]:
        enter_namespaces(out)
    if p["ns"]:
        private_mounts(p, lim)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.close(out)
        try:
            worker(p, lim, w)
        finally:
            os._exit(0)
    os.close(w)
    data, chunk = b"", b"x"
    while chunk and len(data) < 65536:
        chunk = os.read(r, 65536)
        data += chunk
    _, status = os.waitpid(pid, 0)
    if not data and os.WIFSIGNALED(status):  # CPU limit (SIGXCPU, then SIGKILL) is a timeout
        sig = os.WTERMSIG(status)
        data = ("- %s signal %d" % ("timeout" if sig in (9, 24) else "crash", sig)).encode()
    os.write(out, p["nonce"].encode() + b" " + data.split(b"\n")[0] + b"\n")
    os._exit(0)  # everything went out through os.write: skip ~2 ms of interpreter teardown

def isdir(d):
    try:
        return os.stat(d).st_mode & 0o170000 == 0o040000
    except OSError:
        return False

def libc(name):
    # libc through _ctypes itself: the ctypes package costs ~3 ms of imports per sample, a
    # third of a bare interpreter start; these few lines are all of it that is needed here
    import _ctypes
    class Int(_ctypes._SimpleCData):
        _type_ = "i"
    class Fn(_ctypes.CFuncPtr):
        _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
        _restype_ = Int
    class Libc:
        _handle = _ctypes.dlopen(None, os.RTLD_NOW)
    fn = Fn((name, Libc))
    def call(*args, what=name):
        if fn(*args) == -1:
            raise OSError(_ctypes.get_errno(), what)
    return call

def mount(src, dst, kind, flags, data):
    libc("mount")(src and src.encode(), dst.encode(), kind and kind.encode(), flags, data and data.encode(), what="mount " + dst)

def enter_namespaces(out):
    # what `unshare --mount --net --pid --fork --kill-child --mount-proc --ipc --uts` did, without
    # exec'ing it first (~1.5 ms a sample): new mount, network, pid, ipc and uts namespaces, then a
    # fork, as only a child enters the new pid namespace. This process stays outside and waits;
    # the child (pid 1 inside) returns and runs the sample. Both are in the trainer's process
    # group for the sample, which kills them together; pid 1 also dies with this process
    # (PDEATHSIG), and the kernel kills everything in the namespace when pid 1 dies.
    libc("unshare")(0x00020000 | 0x40000000 | 0x20000000 | 0x08000000 | 0x04000000)
    pid = os.fork()
    if pid:
        os.close(out)
        os.waitpid(pid, 0)
        os._exit(0)
    libc("prctl")(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    mount("none", "/", None, 16384 | 262144, None)  # MS_REC | MS_PRIVATE: nothing leaks back out
    mount("proc", "/proc", "proc", 2 | 4 | 8, None)  # this namespace's processes only

def private_mounts(p, lim):
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        if isdir(d):
            mount("tmpfs", d, "tmpfs", 2 | 4, "size=%dm,mode=1777" % lim["tmp_mb"])
    if p["drop"]:  # nobody may not traverse the interpreter's home (e.g. /root/.pyenv): bind it read-only
        prefix, view = p["prefix"], "/tmp/.python"
        os.mkdir(view, 0o755)
        mount(prefix, view, None, 4096 | 16384, None)
        mount(None, view, None, 4096 | 32 | 1 | 16384, None)
        sys.path[:] = [view + s[len(prefix):] if s.startswith(prefix) else s for s in sys.path]
    work = "/tmp/work"
    os.mkdir(work, 0o700)
    if p["drop"]:
        os.chown(work, 65534, 65534)
    p["work"] = work

def worker(p, lim, w):
    import io, resource
    os.setsid()
    if p["drop"]:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    mb = 1024 * 1024
    for name, value in (("RLIMIT_CPU", lim["cpu_s"]), ("RLIMIT_AS", lim["memory_mb"] * mb),
                        ("RLIMIT_FSIZE", lim["file_mb"] * mb), ("RLIMIT_NOFILE", lim["open_files"]),
                        ("RLIMIT_NPROC", lim["processes"]), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    os.chdir(p["work"])
    # both the C environment (what a child process inherits) and posix.environ (what the
    # program's `import os` builds os.environ from)
    for k in list(os.environ):
        os.unsetenv(k)
    os.environ.clear()
    for k, v in (("HOME", p["work"]), ("TMPDIR", p["work"]), ("PATH", "/usr/bin:/bin"), ("LANG", "C.UTF-8")):
        os.putenv(k, v)
        os.environ[k.encode()] = v.encode()
    cap = lim["output_kb"] * 1024
    class Full(BaseException):
        pass
    class Capped(io.StringIO):
        def write(self, s):
            if self.tell() + len(s) > cap:
                raise Full("output limit")
            return super().write(s)
    code, tests = p["code"], p["tests"]
    del p["nonce"]
    res = {"per_test": [], "reason": "ok", "detail": ""}
    def fail(reason, e):
        if res["reason"] == "ok":
            res["reason"], res["detail"] = reason, (type(e).__name__ + ": " + str(e))[:200]
    try:
        prog = compile(code, "solution.py", "exec")
    except BaseException as e:
        fail("syntax_error", e)
        prog = None
    asserts = [t for t in tests if isinstance(t, str)]
    ns = None
    if prog is not None and asserts:
        ns = {"__name__": "solution"}
        sys.stdout = sys.stderr = Capped()
        try:
            exec(prog, ns)
        except Full as e:
            fail("output_limit", e); ns = None
        except BaseException as e:
            fail("error", e); ns = None
    for t in tests:
        ok = False
        if prog is not None and isinstance(t, str) and ns is not None:
            sys.stdout = sys.stderr = Capped()
            try:
                exec(t, ns)
                ok = True
            except AssertionError as e:
                fail("wrong_answer", e)
            except Full as e:
                fail("output_limit", e)
            except BaseException as e:
                fail("error", e)
        elif prog is not None and not isinstance(t, str):
            sys.stdin, sys.stdout = io.StringIO(t["input"]), Capped()
            sys.stderr = Capped()
            try:
                exec(prog, {"__name__": "__main__"})
                ok = _same(sys.stdout.getvalue(), t["output"])
                if not ok:
                    fail("wrong_answer", AssertionError("stdout differs"))
            except SystemExit as e:
                ok = e.code in (None, 0) and _same(sys.stdout.getvalue(), t["output"])
                if not ok:
                    fail("wrong_answer" if e.code in (None, 0) else "error", e)
            except Full as e:
                fail("output_limit", e)
            except BaseException as e:
                fail("error", e)
        res["per_test"].append(ok)
    bits = "".join("1" if ok else "0" for ok in res["per_test"]) or "-"
    detail = res["detail"].replace("\n", " ").replace("\r", " ")
    os.write(w, ("%s %s %s\n" % (bits, res["reason"], detail)).encode("utf-8", "replace"))

def _same(got, want):
    norm = lambda s: [line.rstrip() for line in s.strip().splitlines()]
    return norm(got) == norm(want)

main()
'''
