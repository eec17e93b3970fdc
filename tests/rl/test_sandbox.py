"""The code sandbox against hostile programs: each scores 0 within a bounded time, the test process
(standing in for the trainer) keeps running, and nothing the program did outlives the sample; and
against forgeries (tests/rl/forgeries.py): no program scores without computing the answer.
Every test runs twice where the host has namespaces: samples forked by the fork server, and
samples spawned one interpreter each (the fallback)."""

import marshal
import os
import signal
import socket
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from hpcrl.rewards import sandbox
from hpcrl.rewards import score as rewards
from helpers import wait_until
from forgeries import ASSERTS, FORGERIES, HONEST, STDIO

LEVEL = sandbox.isolation()
ISOLATED = LEVEL in ("namespaces", "userns")
FAST = sandbox.Limits(timeout_s=3.0, cpu_s=2)
OK_TESTS = ["assert f() == 1"]
SERVED = LEVEL == "namespaces"  # the fork server serves this level only


@pytest.fixture(autouse=True, params=["fork", "spawn"] if SERVED else ["spawn"])
def mode(request, monkeypatch):
    monkeypatch.setattr(sandbox, "FORK_SERVER", request.param == "fork")
    return request.param


def _score(code, tests=OK_TESTS, limits=FAST):
    t0 = time.monotonic()
    res = sandbox.run_tests(code, tests, limits)
    took = time.monotonic() - t0
    assert took < limits.timeout_s + 2.0, f"{res} took {took:.1f} s"
    return res


def _procs_with(token: str) -> list:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if token.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def test_benign_code_scores_fraction_of_tests_passed():
    code = "```python\ndef f(a, b):\n    return a + b\n```"
    res = sandbox.run_tests(sandbox.extract_code(code), ["assert f(1, 2) == 3", "assert f(2, 2) == 5"])
    assert (res.score, res.passed, res.total, res.reason) == (0.5, 1, 2, "wrong_answer")
    stdio = sandbox.run_tests("print(int(input()) * 2)", [{"input": "3", "output": "6"}, {"input": "4", "output": "9"}])
    assert (stdio.passed, stdio.total) == (1, 2)
    assert sandbox.run_tests("def f(:", OK_TESTS).reason == "syntax_error"
    assert sandbox.run_tests("", OK_TESTS).reason == "no_code"


def test_infinite_loop_times_out():
    res = _score("while True:\n    pass\ndef f(): return 1")
    assert (res.score, res.reason) == (0.0, "timeout")


def test_fork_bomb_is_contained_and_gone():
    token = "forkbomb-7a1c"
    code = ("import os, time\n"
            "while True:\n"
            "    try:\n"
            "        os.fork()\n"
            "    except OSError:\n"
            f"        os.execv('/bin/sleep', ['/bin/sleep', '300', '{token}']) if os.getpid() % 3 == 0 else time.sleep(0.01)\n"
            "def f(): return 1")
    res = _score(code)
    assert res.score == 0.0
    wait_until(lambda: not _procs_with(token), 60, "fork bomb processes gone")


def test_memory_hog_fails():
    res = _score("x = bytearray(4 * 1024 ** 3)\ndef f(): return 1")
    assert (res.score, res.reason) == (0.0, "error") and "MemoryError" in res.detail


def test_gigabytes_of_output_stop_at_the_cap():
    res = _score("while True:\n    print('x' * 1_000_000)\ndef f(): return 1")
    assert (res.score, res.reason) == (0.0, "output_limit")
    res = _score("with open('big', 'wb') as f:\n    for _ in range(4000):\n        f.write(b'x' * 1_000_000)\n"
                 "def f(): return 1")
    assert (res.score, res.reason) == (0.0, "error") and "File too large" in res.detail  # RLIMIT_FSIZE, 8 MB


def test_file_written_outside_its_directory_is_absent_afterwards():
    outside = Path("/tmp") / f"hpcrl-escape-{os.getpid()}"
    mine = Path(__file__).resolve().parent / f".hpcrl-escape-{os.getpid()}"  # the trainer's own tree
    code = (f"for p in ({str(outside)!r}, '/var/tmp/hpcrl-escape', {str(mine)!r}):\n"
            "    open(p, 'w').write('pwned')\n"
            "def f(): return 1")
    res = _score(code)
    assert not outside.exists() and not mine.exists()
    if LEVEL == "namespaces":
        # nobody cannot write the trainer's files; a checkout under /tmp is not even visible (the
        # sandbox's /tmp is its own tmpfs), so the open fails either way
        assert res.score == 0.0 and ("Permission" in res.detail or "No such file" in res.detail), res.detail
    Path("/var/tmp/hpcrl-escape").unlink(missing_ok=True)  # where the host allowed it (plain)


def test_secret_environment_is_not_there(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value_123")
    monkeypatch.setenv("WANDB_API_KEY", "wandb_secret_value_456")
    code = ("import os\n"
            "found = ''.join(os.environ.values())\n"
            "for pid in os.listdir('/proc'):\n"
            "    try:\n"
            "        found += open('/proc/%s/environ' % pid, 'rb').read().decode('latin1')\n"
            "    except (OSError, ValueError):\n"
            "        pass\n"
            "def f(): return 1 if 'secret_value' in found else 0")
    res = _score(code)
    assert res.score == 0.0 and res.reason == "wrong_answer"


def test_environment_is_exactly_home_tmpdir_path_lang_for_the_program_and_its_children():
    # the harness sets it through posix (it never imports os): os.environ, built later by the
    # program's own import, and the C environment a child inherits must agree
    code = ("import os, subprocess\n"
            "def mine(): return sorted(os.environ)\n"
            "def childs(): return sorted(l.split('=')[0] for l in subprocess.run(['env'], capture_output=True, text=True).stdout.split())\n"
            "def home(): return os.environ['HOME'] == os.environ['TMPDIR'] == os.getcwd()")
    want = "['HOME', 'LANG', 'PATH', 'TMPDIR']"
    res = _score(code, [f"assert mine() == {want}, mine()", f"assert childs() == {want}, childs()", "assert home()"])
    assert res.score == 1.0, res


def test_another_interpreter_gets_the_harness_as_source(tmp_path, monkeypatch):
    # marshal's code format is per version: the same interpreter under another path must still work
    link = tmp_path / "python-elsewhere"
    link.symlink_to(os.path.realpath(sys.executable))
    # the same code (marshal's bytes may differ: its reference flags follow refcounts at dump time)
    same = marshal.loads(sandbox._harness_blob(str(link)))
    assert isinstance(same, types.CodeType) and same == marshal.loads(sandbox._harness_blob(sys.executable))
    other = "/nonexistent/python9"
    assert marshal.loads(sandbox._harness_blob(other)) == sandbox.HARNESS
    source = marshal.dumps(sandbox.HARNESS, 2)  # and the harness runs from source too
    monkeypatch.setattr(sandbox, "_harness_blob", lambda python: source)
    assert _score("def f(): return 1").score == 1.0


@pytest.mark.skipif(not ISOLATED, reason=f"isolation {LEVEL!r}: the network is reachable without namespaces")
def test_network_connection_fails():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        code = ("import socket\n"
                f"socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
                "def f(): return 1")
        res = _score(code)
        # for the right reason (issue 28): no route, not `LookupError: unknown encoding: idna`
        # raised before any connection was tried
        assert res.score == 0.0 and res.reason == "error" and "Network is unreachable" in res.detail, res
        code2 = "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\ndef f(): return 1"
        res2 = _score(code2)
        assert res2.score == 0.0 and "Network is unreachable" in res2.detail, res2
    finally:
        server.close()


def test_killing_its_parent_leaves_the_trainer_running():
    me = os.getpid()
    code = (f"import os, signal\n"
            f"for pid in (os.getppid(), {me}):\n"
            "    if pid > 1:\n"
            "        os.kill(pid, signal.SIGKILL)\n"
            "def f(): return 1")
    res = _score(code)
    assert res.score == 0.0
    os.kill(me, 0)  # still here


def test_child_left_running_is_gone_afterwards():
    token = "leftover-3f9e"
    code = ("import subprocess, os\n"
            f"subprocess.Popen(['/bin/sleep', '300', '{token}'], start_new_session=True)\n"
            f"if os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', ['/bin/sleep', '301', '{token}'])\n"
            "def f(): return 2")
    res = _score(code)
    assert res.score == 0.0
    wait_until(lambda: not _procs_with(token), 60, "children of the sample gone")


def test_segfault_is_a_crash():
    res = _score("import ctypes\nctypes.string_at(0)\ndef f(): return 1")
    assert (res.score, res.reason) == (0.0, "crash")


def test_benign_batch_of_64_is_scored_in_parallel():
    items = [(f"def f(x):\n    return x * {i}", [f"assert f(2) == {2 * i}", f"assert f(3) == {3 * i + (i % 2)}"])
             for i in range(64)]
    t0 = time.monotonic()
    results = sandbox.run_batch(items, workers=4, dedupe=False)
    took = time.monotonic() - t0
    assert [r.passed for r in results] == [1 if i % 2 else 2 for i in range(64)]
    assert took < 30


def test_compute_score_code_for_verl_and_batch():
    gt = {"tests": ["assert f(2, 3) == 6"]}
    assert rewards.compute_score("code", "```python\ndef f(a, b):\n    return a * b\n```", gt)["score"] == 1.0
    out = rewards.compute_score_batch(["code"] * 2, ["def f(a, b): return a * b", "def f(a, b): return a"],
                                      [gt, gt], [{}, {}])
    assert [o["score"] for o in out] == [1.0, 0.0] and out[1]["reason"] == "wrong_answer"
    prefix = {"tests": ["assert f(2, 3) == 5"], "prefix": "def f(a, b):\n    return "}
    assert rewards.code_score("a + b", prefix)["score"] == 1.0


# The fork server's own tests run forked only (not once more spawned, as the autouse `mode` would)
fork_only = pytest.mark.parametrize("mode", ["fork"], indirect=True)


def _server_pid(mode):
    if not SERVED:
        pytest.skip(f"the fork server serves the 'namespaces' level (root) only; here: {LEVEL}")
    assert _score("def f(): return 1").score == 1.0  # started, if it was not
    return sandbox._SERVER.proc.pid


def _alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@fork_only
def test_fork_server_killed_between_calls_is_restarted(mode):
    pid = _server_pid(mode)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not _alive(pid), 60, "fork server dead")
    assert _score("def f(): return 1").score == 1.0
    assert sandbox._SERVER.proc.pid != pid and _alive(sandbox._SERVER.proc.pid)


def _descendants(pid: int) -> list:
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def _freeze(pid: int) -> list:
    """SIGSTOP every process below pid, top down, until a walk finds no new one: a frozen sample
    cannot finish, however long this thread stalls before the kill."""
    frozen = []
    while new := [p for p in _descendants(pid) if p not in frozen]:
        for p in new:
            try:
                os.kill(p, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        frozen += new
    return frozen


@fork_only
def test_fork_server_killed_during_a_sample_falls_back_to_a_spawn(mode, monkeypatch):
    pid = _server_pid(mode)
    spawned, popen = [], sandbox.subprocess.Popen
    def spy(argv, *a, **kw):
        spawned.append(sandbox.BOOT in argv)
        return popen(argv, *a, **kw)
    monkeypatch.setattr(sandbox.subprocess, "Popen", spy)
    # the sample sleeps 8 s, and it is frozen (SIGSTOP, its whole tree) once the server has forked
    # it: under CI's load this thread once stalled past the sample's end before its kill (the
    # sample finished in the server, nothing to fall back from); the rerun shares the deadline
    code = "import time\ntime.sleep(8)\ndef f(): return 1"
    slow = sandbox.Limits(timeout_s=40.0, cpu_s=2)
    results = []
    children = Path(f"/proc/{pid}/task/{pid}/children")
    # the warm-up sample's child can linger a moment after its result (the server reaps it
    # later); a kill then would land before this sample was sent, and the call would just
    # restart the server (seen under load in CI)
    wait_until(lambda: not children.read_text().split(), 60, "the warm-up sample reaped")
    t = threading.Thread(target=lambda: results.append(_score(code, limits=slow)))
    t.start()
    wait_until(lambda: children.read_text().split(), 60, "the server forked the sample")
    sample = _freeze(pid)
    assert sample and not results, "the sample was frozen while it ran"
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not _alive(pid), 60, "the fork server dead")
    # a child frozen before its prctl (under load: right after the fork) has no PDEATHSIG: woken,
    # it finds the server gone and exits, as designed (sandbox_server.child)
    for p in sample:
        try:
            os.kill(p, signal.SIGCONT)
        except ProcessLookupError:
            pass
    # the forked sample dies with the server (PDEATHSIG, down to its pid 1 and namespace)...
    wait_until(lambda: not any(map(_alive, sample)), 60, "the forked sample gone with the server")
    t.join(60)
    # ...and the call reran it through the spawn path instead of scoring a crash
    assert results and results[0].score == 1.0, results
    assert spawned == [True]
    assert _score("def f(): return 1").score == 1.0 and sandbox._SERVER.proc.pid != pid


@fork_only
def test_infinite_loop_is_a_timeout_when_the_trainer_wakes_after_the_servers_kill(mode, monkeypatch):
    # Under load the worker may not reach its CPU limit within the wall clock, and the trainer's
    # thread may wake from select only after the fork server's own deadline kill: it then sees
    # EOF with no result line, not its deadline. That is still the wall-clock timeout.
    _server_pid(mode)
    real = sandbox.select.select
    def late(r, w, x, t):
        time.sleep(t + 0.5)  # descheduled across the deadline
        return real(r, w, x, 0)
    monkeypatch.setattr(sandbox, "select", type("Late", (), {"select": staticmethod(late)}))
    res = sandbox.run_tests("while True:\n    pass\ndef f(): return 1", OK_TESTS,
                            sandbox.Limits(timeout_s=2.0, cpu_s=30))
    assert (res.score, res.reason) == (0.0, "timeout")


@fork_only
def test_program_killing_the_servers_process_group_or_everything(mode):
    pid = _server_pid(mode)
    code = ("import os, signal\n"
            "for kill in (lambda: os.killpg(os.getpgid(os.getppid()), 9), lambda: os.killpg(os.getpgid(1), 9),\n"
            f"             lambda: os.killpg({pid}, 9), lambda: os.kill({pid}, 9), lambda: os.kill(-1, 9)):\n"
            "    try:\n"
            "        kill()\n"
            "    except OSError:\n"
            "        pass\n"
            "def f(): return 1")
    assert _score(code).score == 0.0
    os.kill(os.getpid(), 0)
    # nothing of it reaches the server (another pid namespace, uid nobody): the same one serves on
    assert _alive(pid) and _score("def f(): return 1").score == 1.0 and sandbox._SERVER.proc.pid == pid


@fork_only
def test_fork_server_outlives_the_pool_threads_and_leaves_with_the_trainer(mode, tmp_path):
    pid = _server_pid(mode)
    items = [("def f(): return 1", OK_TESTS)] * 4
    for _ in range(2):  # PDEATHSIG would have fired when the first batch's threads ended
        assert [r.score for r in sandbox.run_batch(items, workers=2, dedupe=False)] == [1.0] * 4
        assert sandbox._SERVER.proc.pid == pid and _alive(pid)
    # a trainer killed outright: its server sees EOF on its socket and exits
    script = ("import sys, time; from hpcrl.rewards import sandbox\n"
              "assert sandbox.run_tests('def f(): return 1', ['assert f() == 1']).score == 1.0\n"
              "print(sandbox._SERVER.proc.pid, flush=True); time.sleep(60)")
    trainer = sandbox.subprocess.Popen([sys.executable, "-c", script], stdout=sandbox.subprocess.PIPE, text=True,
                                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    server = int(trainer.stdout.readline())
    assert _alive(server)
    trainer.kill()
    trainer.wait()
    wait_until(lambda: not _alive(server), 60, "the fork server gone with its trainer")


@fork_only
def test_a_forked_trainer_starts_its_own_fork_server(mode):
    pid = _server_pid(mode)
    with sandbox._SERVER.lock:  # held by this thread at the fork: the child must not wait on it
        child = os.fork()
    if child == 0:
        ok = sandbox.run_tests("def f(): return 1", OK_TESTS).score == 1.0 and sandbox._SERVER.proc.pid != pid
        os._exit(0 if ok else 1)
    assert os.waitpid(child, 0)[1] == 0
    assert _alive(pid) and _score("def f(): return 1").score == 1.0 and sandbox._SERVER.proc.pid == pid


# ------------------------------------------------------------------ forgeries: the trainer judges

def test_honest_programs_score_one():
    assert _score(HONEST["asserts"], ASSERTS).score == 1.0
    assert _score(HONEST["stdio"], STDIO).score == 1.0


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forgery_scores_zero(name):
    kind, code = FORGERIES[name]
    res = _score(code, ASSERTS if kind == "asserts" else STDIO)
    assert (res.score, res.passed) == (0.0, 0), res
    assert res.inside == 0  # every verdict was reached in this process


def test_program_holds_no_descriptor_of_the_trainer_and_cannot_import_the_harness(monkeypatch):
    # every pipe this process makes during the call (the fork server's, or Popen's), by inode
    mine, pipe = set(), os.pipe
    def spy():
        r, w = pipe()
        mine.add(os.fstat(r).st_ino)
        return r, w
    monkeypatch.setattr(os, "pipe", spy)
    code = ("import os\n"
            "def fds():\n"
            "    out = {}\n"
            "    for fd in os.listdir('/proc/self/fd'):\n"
            "        try:\n"
            "            out[int(fd)] = os.readlink('/proc/self/fd/' + fd)\n"
            "        except OSError:\n"
            "            pass  # the listing's own descriptor, closed by now\n"
            "    return out\n")
    (ok, fds), (ok2, spec) = sandbox.evaluate(code, ["fds()", "__import__('importlib.util').util.find_spec('hpcrl')"],
                                              FAST)
    assert ok and ok2 and spec is None, (fds, spec)
    assert mine, "the call made no pipe: the spy saw nothing"
    assert [fds[fd] for fd in (0, 1, 2)] == ["/dev/null"] * 3, fds
    rest = [fds[fd] for fd in fds if fd > 2]
    # one pipe, its result channel, whose other end the sandbox's own pid 1 holds
    assert len(rest) == 1 and rest[0].startswith("pipe:["), fds
    assert int(rest[0][6:-1]) not in mine, (fds, mine)


def test_asserts_are_split_and_judged_here():
    code = "def f(a, b):\n    return a + b\ndef g():\n    return {1: (2, b'x')}, {3}, [None, 1.5]"
    tests = ["assert f(1, 2) == 3",                     # literal expected
             "assert 3 == f(1, 2)",                     # literal on the left
             "x = f(2, 2)\nassert x == 4, 'msg'",       # setup statements run in the sandbox
             "assert f(1, 1) == sorted([2, 1])[-1]",    # expected evaluated in a sandbox without the program
             "assert g() == ({1: (2, b'x')}, {3}, [None, 1.5])",
             "assert f(-1, 2)",                         # a bare truth value
             "assert not f(0, 0)",
             "assert f(0, 0) is not None",
             "assert f(1, 2) < 4"]
    res = _score(code, tests)
    assert (res.score, res.inside) == (1.0, 0), res
    wrong = ["assert f(1, 2) == 4", "assert (f(1, 2),) == [3]",  # a tuple is not a list, here as in Python
             "assert f(1, 1) == sorted([3, 1])[-1]", "assert f(1, 2) is None", "assert f(1, 2) > 4"]
    res = _score(code, wrong)
    assert (res.passed, res.reason, res.inside) == (0, "wrong_answer", 0), res


def test_only_what_cannot_cross_runs_inside_and_is_counted():
    code = "def f(a, b):\n    return a + b\ndef g(h, x):\n    return h(x)\ndef same(a):\n    return a"
    # a loop of asserts, a bare call, chained comparisons, `or`: the test interpreter runs them all
    here = ["for i in range(3):\n    assert f(i, 0) == i", "f(1, 2)", "assert f(1, 2) == f(2, 1)",
            "assert 0 < f(1, 2) < 4", "assert abs(f(1, 2) - 3.0) < 1e-9", "assert f(1, 2) == 3 or f(1, 2) == 4"]
    # a function of the test's passed to the program, and `is` between two objects: beside the program
    inside = ["assert g(lambda y: y + 1, 1) == 2", "x = [1]\nassert same(x) is x"]
    res = _score(code, here + inside)
    assert (res.score, res.inside) == (1.0, 2), res
    assert _score("def f(a, b):\n    return 0", here).per_test == [False, True, True, False, False, False]
    # a lying operator passed the last two when they ran in the program's process; not now
    liar = "class A:\n    __sub__ = __eq__ = lambda s, o: 0 if isinstance(o, float) else True\n    __abs__ = lambda s: 0\ndef f(a, b):\n    return A()"
    assert _score(liar, here[-2:]).score == 0.0


def test_objects_that_are_not_data_stay_in_the_program_and_equal_no_value():
    for value in ("object()", "iter([3])", "lambda: 3", "type('X', (), {})()"):
        res = _score(f"def f(a, b):\n    return {value}", ["assert f(1, 2) == 3", "assert f(1, 2)"])
        # a handle is never equal to a plain value; its truth is the object's own, as in Python
        assert res.per_test == [False, True] and res.reason == "wrong_answer", (value, res)
    # subclasses go as the built-in value they hold: an honest one passes, a lying one is judged on its value
    res = _score("import collections\ndef f(a, b):\n    return collections.Counter('aab')", ["assert f(1, 2) == {'a': 2, 'b': 1}"])
    assert res.score == 1.0, res
    res = _score("def f(a, b):\n    return 7 ** 9000", ["assert f(1, 2) == 7 ** 9000", "assert f(1, 2) == 7 ** 9000 + 1"])
    assert res.per_test == [True, False], res


def test_decode_takes_plain_data_only():
    assert sandbox.decode({"t": [1, {"s": ["a"]}, {"d": [[{"t": [1]}, None]]}, {"b": "\xff"}]}) == \
        (1, frozenset({"a"}), {(1,): None}, b"\xff")
    for bad in ({"x": 1}, {"t": 1}, {"d": [[1]]}, {"t": [], "s": []}, {"d": [[[1], 2]]}):
        with pytest.raises((ValueError, TypeError)):
            sandbox.decode(bad)
    # int hashes are not randomised: a set of colliding keys would make decoding quadratic
    mod = (1 << 61) - 1
    with pytest.raises(ValueError):
        sandbox.decode({"s": [i * mod for i in range(1, 1000)]})
    deep = [0]
    for _ in range(200):
        deep = [deep]
    with pytest.raises(ValueError):
        sandbox.decode(deep)


def test_an_interpreter_that_cannot_start_is_a_crash_with_the_reason():
    before = set(Path(sandbox.tempfile.gettempdir()).glob("hpcrl-sandbox-*"))
    res = sandbox._run("def f(): return 1", OK_TESTS, FAST, "plain", "/nonexistent/python9", time.monotonic(), False)
    assert (res.score, res.reason) == (0.0, "crash") and "cannot start the sandbox" in res.detail, res
    assert set(Path(sandbox.tempfile.gettempdir()).glob("hpcrl-sandbox-*")) <= before  # its work dir is gone


def test_hostile_result_documents_score_zero():
    # what the trainer reads from a sample's pipe (the test interpreter's verdicts), read defensively
    m = "ab12"
    for body in (b"", b"[" * 100_000, b'{"tests": []}', b'{"tests": [["pass"], ["pass"]]}', b'{"tests": [7]}',
                 b'{"tests": [["pass", 1]]}', b'{"tests": [["fail"]]}', b"9" * 10_000, b'{"died": 11}',
                 b'{"tests": [{"values": [3]}]}', b'{"tests": [["fail", "wrong_answer", 3]]}'):
        got = sandbox._read_verdicts(m.encode() + b" " + body + b"\n", m, False, 1)
        assert isinstance(got, str) or got[0][0] is False, (body[:40], got)
    assert sandbox._read_verdicts(b'ab12 {"tests": [["pass"]]}\n', m, False, 1) == [(True, "", "")]
