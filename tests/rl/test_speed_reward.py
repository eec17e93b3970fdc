"""Issue 42, item 4: the code-optimisation reward (hpcrl/rewards/speed.py). A correct program
scores by its CPU time against the row's reference, measured from outside the program by the
sandbox's pid 1 (wait4), with repeats and a noise bound stated in the row before measuring; a
wrong program scores 0 however fast. The figures are CPU seconds, not wall time, and compared as
ratios within one call, so the test holds on a loaded machine and beside a CPU hog."""

import subprocess
import sys

import pytest

from hpcrl.rewards import speed

REF = ("def total(n):\n    s = 0\n    for _ in range(2):\n        for i in range(n):\n"
       "            s += i * i\n    return s // 2\n")
FAST = "def total(n):\n    s = 0\n    for i in range(n):\n        s += i * i\n    return s\n"   # half the work
WRONG_FAST = "def total(n):\n    return 0\n"
AT_IMPORT = ("TABLE = {}\ns = 0\nfor i in range(800_000):\n    s += i * i\nTABLE[800_000] = s\n"
             "def total(n):\n    if n in TABLE:\n        return TABLE[n]\n" + FAST.split("\n", 1)[1])
FORKER = ("import os\ndef total(n):\n    if os.fork() == 0:\n        os._exit(0)\n    s = 0\n"
          "    for i in range(n):\n        s += i * i\n    return s\n")
# The row's stated bound on the spread (the median absolute deviation over the median) of the
# answer's repeats, and on how far the reference as the answer may stray from a speedup of 1:
# what this shared 2-core machine keeps beside the whole suite and two hogs. A 2x answer clears 1 + NOISE.
NOISE = 0.3
ROW = {"tests": ["assert total(10) == 285", "assert total(0) == 0", "assert total(3) == 5"],
       "reference": REF, "bench": "total(800_000)", "repeats": 7, "noise": NOISE, "max_speedup": 4.0}


def _score(code: str) -> dict:
    return speed.compute_score("code", "```python\n" + code + "```", ROW)


def _check(ref: dict, fast: dict) -> None:
    assert ref["reason"] == "ok" and abs(ref["speedup"] - 1.0) <= NOISE, ref
    assert fast["reason"] == "ok" and fast["score"] > ref["score"] and fast["speedup"] > 1.0 + NOISE, fast
    for got in (ref, fast):
        assert got["spread"] <= NOISE and got["noisy"] == 0.0, got


def test_a_faster_correct_program_scores_above_the_reference_and_a_wrong_fast_one_zero():
    ref, fast = _score(REF), _score(FAST)
    _check(ref, fast)
    assert ref["score"] == pytest.approx(1 / 4, abs=NOISE / 4)  # the reference itself: 1 / max_speedup
    wrong = _score(WRONG_FAST)
    assert (wrong["score"], wrong["reason"]) == (0.0, "wrong_answer"), wrong
    # work moved to import time is inside the figure: the table costs what the loop cost
    table = _score(AT_IMPORT)
    assert table["reason"] == "ok" and table["speedup"] < fast["speedup"], (table, fast)
    # a process started to work off the books is refused (RLIMIT_NPROC 1): the run fails
    forker = _score(FORKER)
    assert forker["score"] == 0.0 and forker["reason"] == "error", forker


def test_beside_a_cpu_hog_the_ratio_and_the_spread_hold():
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        ref, fast = _score(REF), _score(FAST)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    _check(ref, fast)


def test_a_row_without_a_reference_is_one_line_not_a_crash():
    got = speed.compute_score("code", "```python\n" + FAST + "```", {"tests": ROW["tests"]})
    assert got["score"] == 0.0 and got["reason"] == "bad_tests" and "reference" in got["detail"], got
