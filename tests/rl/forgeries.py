"""The hostile-program table: programs that try to be scored as passing without computing the
answer, each against the same task where the honest program scores 1 (tests/rl/test_sandbox.py).

The task: f(a, b) returns a + b (assert tests), and a program that reads two integers and prints
their sum (stdin/stdout tests). A forgery "wins" if it scores above 0."""

ASSERTS = ["assert f(1, 2) == 3", "assert f(5, 7) == 12"]
STDIO = [{"input": "1 2\n", "output": "3"}, {"input": "5 7\n", "output": "12"}]
HONEST = {"asserts": "def f(a, b):\n    return a + b",
          "stdio": "a, b = map(int, input().split())\nprint(a + b)"}

# Reading the tests' expected values from wherever they sit in the process (the harness's payload,
# its frames, any string or dict): what a program does when the answers live next to it.
_STEAL_ASSERTS = '''
import gc, re, sys
def _table():
    seen = {}
    for o in gc.get_objects():
        for s in (o if isinstance(o, (list, tuple)) else o.values() if isinstance(o, dict) else ()):
            if isinstance(s, str):
                m = re.match(r"assert f\\((.*)\\) == (.*)", s)
                if m:
                    seen[m.group(1).replace(" ", "")] = eval(m.group(2))
    return seen
def f(a, b):
    return _table().get("%d,%d" % (a, b))
'''

_STEAL_STDIO = '''
import gc, sys
line = sys.stdin.read()
# a dict of strings only is not tracked by gc: look inside the containers that are
for c in gc.get_objects():
    for o in (c if isinstance(c, (list, tuple)) else c.values() if isinstance(c, dict) else ()):
        if isinstance(o, dict) and o.get("input") == line and "output" in o:
            print(o["output"])
            raise SystemExit(0)
'''

# Writing a result claiming every test passed to each descriptor it holds (old format: MARKER-less
# `BITS REASON DETAIL`, and a JSON claim), then leaving before anything else is written.
_WRITE_FDS = '''
import os
for fd in range(3, 256):
    for line in (b"11 ok forged\\n", b'{"passed": [true, true], "values": [[3], [12]]}\\n'):
        try:
            os.write(fd, line)
        except OSError:
            pass
os._exit(0)
'''

_PROC_FDS = '''
import os
for pid in {os.getppid(), 1, os.getpid()}:
    try:
        fds = os.listdir("/proc/%d/fd" % pid)
    except OSError:
        continue
    for fd in fds:
        try:
            with open("/proc/%d/fd/%s" % (pid, fd), "wb", buffering=0) as out:
                out.write(b"11 ok forged\\n")
        except OSError:
            pass
os._exit(0)
'''

# Walking up from the call into the harness: its locals (the result pipe, the per-test list) and
# globals (its comparison function), then rewriting what it will report.
_FRAMES = '''
import sys, os
class _All(list):
    def append(self, x):
        list.append(self, True)
def f(a, b):
    fr = sys._getframe(1)
    while fr is not None:
        for k, v in list(fr.f_locals.items()):
            if isinstance(v, dict) and isinstance(v.get("per_test"), list):
                v["per_test"] = _All(True for _ in v["per_test"])
        g = fr.f_globals
        if "_same" in g:
            g["_same"] = lambda *a: True
        fr = fr.f_back
    return 0
'''

_GC_RESULTS = '''
import gc
class _All(list):
    def append(self, x):
        list.append(self, True)
for o in gc.get_objects():
    if isinstance(o, dict) and isinstance(o.get("per_test"), list):
        o["per_test"] = _All()
def f(a, b):
    return 0
'''

_INSPECT = '''
import inspect
def f(a, b):
    for info in inspect.stack():
        g = info.frame.f_globals
        for name, fn in list(g.items()):
            if callable(fn) and getattr(fn, "__name__", "") in ("_same", "same", "compare", "check"):
                g[name] = lambda *a, **k: True
        loc = info.frame.f_locals
        if "ok" in loc:
            loc["ok"] = True
    return 0
'''

_STDIO_INSPECT = '''
import gc
for o in gc.get_objects():
    if callable(o) and getattr(o, "__name__", "") == "_same":
        o.__code__ = (lambda got, want: True).__code__
print(0)
'''

# Taking over the channel itself: every function of the harness that turns a value into what is
# sent (today's data()/document(), found by walking gc) is made to send a claim of success.
_CHANNEL = '''
import gc
for o in gc.get_objects():
    if type(o).__name__ == "function" and o.__name__ in ("data", "document", "quote", "dumps", "worker"):
        o.__code__ = (lambda *a, **k: '"passed"').__code__
def f(a, b):
    return 0
'''

FORGERIES = {
    # (kind, code): kind says which tests it is scored against
    "eq_overload": ("asserts", "class A:\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\n"
                               "def f(a, b):\n    return A()"),
    "bool_overload": ("asserts", "class T:\n    def __bool__(self): return True\n"
                                 "class A:\n    def __eq__(self, o): return T()\ndef f(a, b):\n    return A()"),
    "int_subclass_lying_eq": ("asserts", "class L(int):\n    __eq__ = lambda s, o: True\n    __hash__ = int.__hash__\n"
                                         "def f(a, b):\n    return L(0)"),
    "str_subclass_lying_eq": ("asserts", "class S(str):\n    __eq__ = lambda s, o: True\n    __hash__ = str.__hash__\n"
                                         "def f(a, b):\n    return S('no')"),
    "list_subclass_lying_eq": ("asserts", "class S(list):\n    __eq__ = lambda s, o: True\ndef f(a, b):\n    return S()"),
    "mock_any": ("asserts", "from unittest.mock import ANY\ndef f(a, b):\n    return ANY"),
    "del_raises_systemexit": ("asserts", "import sys\nclass A:\n    def __eq__(self, o): return True\n"
                                         "    def __del__(self): raise SystemExit(0)\ndef f(a, b):\n    return A()"),
    "steal_expected_from_memory": ("asserts", _STEAL_ASSERTS),
    "frames_rewrite_harness": ("asserts", _FRAMES),
    "gc_rewrite_results": ("asserts", _GC_RESULTS),
    "inspect_patch_comparison": ("asserts", _INSPECT),
    "write_result_to_inherited_fds": ("asserts", _WRITE_FDS),
    "write_result_to_proc_fds": ("asserts", _PROC_FDS),
    "patch_builtins_exec_eval": ("asserts", "import builtins\nbuiltins.exec = lambda *a, **k: None\n"
                                            "builtins.eval = lambda *a, **k: True\ndef f(a, b):\n    return 0"),
    "patch_assertion_error": ("asserts", "import builtins\nclass E(Exception): pass\nbuiltins.AssertionError = E\n"
                                         "def f(a, b):\n    return 0"),
    "sys_exit_0_before_tests": ("asserts", "import sys\nsys.exit(0)\ndef f(a, b):\n    return 0"),
    "os_exit_0_before_tests": ("asserts", "import os\nos._exit(0)\ndef f(a, b):\n    return 0"),
    "exit_0_inside_the_call": ("asserts", "import os\ndef f(a, b):\n    os._exit(0)"),
    "patch_value_channel": ("asserts", _CHANNEL),
    "monkeypatch_json": ("asserts", "import json\njson.dumps = lambda *a, **k: '[[3], [12]]'\n"
                                    "json.loads = lambda *a, **k: [[3], [12]]\ndef f(a, b):\n    return 0"),
    "signal_the_parent": ("asserts", "import os, signal\nfor s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGSTOP):\n"
                                     "    try:\n        os.kill(os.getppid(), s)\n    except OSError:\n        pass\n"
                                     "def f(a, b):\n    return 0"),
    "raise_rlimits_and_spin": ("asserts", "import resource\nfor r in (resource.RLIMIT_CPU, resource.RLIMIT_AS):\n"
                                          "    try:\n        resource.setrlimit(r, (-1, -1))\n    except (ValueError, OSError):\n"
                                          "        pass\nwhile True:\n    pass"),
    "fork_bomb": ("asserts", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"),
    "import_the_harness": ("asserts", "from hpcrl.rewards import sandbox\nsandbox._same = lambda *a: True\n"
                                      "def f(a, b):\n    return 0"),
    "print_expected_stdout_from_memory": ("stdio", _STEAL_STDIO),
    "patch_stdout_comparison": ("stdio", _STDIO_INSPECT),
    "stdio_write_result_to_inherited_fds": ("stdio", _WRITE_FDS),
    "stdio_exit_0_before_output": ("stdio", "import sys\nsys.exit(0)"),
}

# Scored 1.0 (every test) on main before issue 20 (the program ran next to its verdicts), through
# both the fork server and the spawn path; the others scored 0 then too. Kept for the record, not
# asserted: every entry above scores 0 now (test_forgery_scores_zero).
WORKED_BEFORE = {"eq_overload", "bool_overload", "int_subclass_lying_eq", "str_subclass_lying_eq",
                 "list_subclass_lying_eq", "mock_any", "del_raises_systemexit", "steal_expected_from_memory",
                 "frames_rewrite_harness", "gc_rewrite_results", "write_result_to_inherited_fds",
                 "patch_builtins_exec_eval", "print_expected_stdout_from_memory", "patch_stdout_comparison",
                 "stdio_write_result_to_inherited_fds"}
