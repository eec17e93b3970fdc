"""Issue 28, class "files": a sample sees the interpreter and its standard library, read-only, and
a private scratch that dies with it; nothing of the checkout, the data, the run directory, $HOME
or /run, and no on-disk directory it can write (which would carry answers from one sample to the
next). Needs a level with namespaces (root here and in CI; userns where unprivileged)."""

import os
import secrets
import sys
from pathlib import Path

import pytest

from hpcrl.rewards import sandbox

LEVEL = sandbox.isolation()
pytestmark = pytest.mark.skipif(LEVEL == "plain", reason="the plain level has no mount namespace: it refuses "
                                                           "unless the spec allows it, and hides no file")
FAST = sandbox.Limits(timeout_s=5.0, cpu_s=3)
TESTS = ["assert f(2) == 1234", "assert f(3) == 98765"]


def _looker(path: str) -> str:
    """A wrong program that answers from a file of answers, if it can read one."""
    return ("import json\n"
            "def f(x):\n"
            f"    return json.load(open({path!r}))[str(x)]\n")


def test_answers_in_a_readable_file_are_not_there(tmp_path):
    # where a run keeps its data and checkouts: world-readable files in world-traversable dirs
    here = Path(__file__).resolve().parent / f".answers-{os.getpid()}.json"
    root = Path(__file__).resolve().parents[2]  # the checkout (a data set or run dir alike)
    spots = [here, root / f".answers-{os.getpid()}.json", Path.home() / f".answers-{os.getpid()}.json"]
    try:
        for spot in spots:
            spot.write_text('{"2": 1234, "3": 98765}')
            spot.chmod(0o644)
            res = sandbox.run_tests(_looker(str(spot)), TESTS, FAST)
            assert res.score == 0.0, (spot, res)
    finally:
        for spot in spots:
            spot.unlink(missing_ok=True)


def test_nothing_on_disk_carries_from_one_sample_to_the_next():
    token = secrets.token_hex(6)
    # every directory world-writable on this host's disk (/run/lock, /var/tmp, ...), and /tmp
    writer = ("import os, json\n"
              "done = []\n"
              "for d in ('/run/lock', '/var/tmp', '/tmp', '/dev/shm', '/var/lock', '/run/shm', os.getcwd()):\n"
              "    try:\n"
              f"        open(os.path.join(d, 'hpcrl-{token}'), 'w').write(json.dumps({{'2': 1234, '3': 98765}}))\n"
              "        done.append(d)\n"
              "    except OSError:\n"
              "        pass\n"
              "def f(x):\n    return len(done)\n")
    wrote = sandbox.evaluate(writer, ["f(0)"], FAST)
    assert wrote[0][0], wrote
    reader = ("import os, json\n"
              "def f(x):\n"
              "    for d in ('/run/lock', '/var/tmp', '/tmp', '/dev/shm', '/var/lock', '/run/shm'):\n"
              "        try:\n"
              f"            return json.load(open(os.path.join(d, 'hpcrl-{token}')))[str(x)]\n"
              "        except OSError:\n"
              "            pass\n")
    try:
        res = sandbox.run_tests(reader, TESTS, FAST)
        assert res.score == 0.0, res
    finally:
        for d in ("/run/lock", "/var/tmp", "/tmp", "/dev/shm"):
            Path(d, f"hpcrl-{token}").unlink(missing_ok=True)


def test_the_sample_sees_only_the_interpreter_and_scratch():
    code = ("import os\n"
            "def top():\n"
            "    return sorted(os.listdir('/'))\n"
            "def writable():\n"
            "    out = []\n"
            "    for d in ('/', '/usr', '/etc', os.path.dirname(os.__file__), '/proc/sys'):\n"
            "        try:\n"
            "            open(os.path.join(d, 'x'), 'w').close()\n"
            "            out.append(d)\n"
            "        except OSError:\n"
            "            pass\n"
            "    return out\n"
            "def reads(p):\n"
            "    return os.path.exists(p)\n")
    here = str(Path(__file__).resolve())
    got = sandbox.evaluate(code, ["top()", "writable()", f"reads({here!r})", "reads('/run')",
                                  f"reads({str(Path.home())!r} + '/.bashrc')", "'x'.encode('idna')",
                                  "'é'.encode('cp1252')"], FAST)
    assert all(ok for ok, _ in got), got
    top, writable, checkout, run, home, idna, cp = (v for _, v in got)
    assert not (set(top) - {"usr", "bin", "lib", "lib64", "sbin", "dev", "proc", "tmp", "etc", "root", "opt"}), top
    assert writable == [] and not checkout and not run and not home, got
    assert idna == b"x" and cp == b"\xe9"


def test_a_correct_program_still_imports_the_standard_library():
    code = ("import json, collections, decimal, fractions, heapq, itertools, re, datetime, sqlite3, hashlib\n"
            "def f(x):\n"
            "    return [json.dumps(x), hashlib.sha1(b'a').hexdigest()[:4], str(decimal.Decimal(x) / 4)]\n")
    res = sandbox.run_tests(code, ["assert f(2) == ['2', '86f7', '0.5']"], FAST)
    assert res.score == 1.0, res
