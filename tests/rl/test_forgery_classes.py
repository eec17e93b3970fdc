"""Issue 40's classes of wrong programs, one test per class (not one per program): each wrong
program scored 1.0 (or part of it) on f173797, where the trusted judge split a test and sent a
name the program binds to the program. Now the test interpreter runs the test with Python's own
names; the program only answers calls, as data. Each class also keeps an honest program at 1.0,
so a fix that simply stopped deciding would fail here. Classes 4 and 6 (kernel channels, setuid)
are in test_sandbox_kernel.py; 7 in test_correct_programs.py; 8 in test_extract.py."""

import json
import resource

import pytest

from hpcrl.rewards import sandbox
from hpcrl.rewards import score as rewards

FAST = sandbox.Limits(timeout_s=10.0, cpu_s=4)


def _run(code: str, tests: list) -> sandbox.Result:
    return sandbox.run_tests(code, tests, FAST)


# ---------------------------------------------------------------- class 1: the program's names

MBPP = {  # MBPP's own shapes: the test's builtins and modules around the task's function
    "set": (["assert set(similar_elements((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))"],
            "def similar_elements(a, b):\n    return tuple(set(a) & set(b))"),
    "math": (["assert math.isclose(volume_sphere(10), 4188.790204786391, rel_tol=0.001)"],
             "import math\ndef volume_sphere(r):\n    return 4 / 3 * math.pi * r ** 3"),
    "import math": (["import math\nassert math.isclose(volume_sphere(10), 4188.790204786391, rel_tol=0.001)"],
                    "import math\ndef volume_sphere(r):\n    return 4 / 3 * math.pi * r ** 3"),
    "sorted": (["assert sorted(dups([1, 2, 2, 3, 3])) == [2, 3]"],
               "def dups(xs):\n    return [x for x in set(xs) if xs.count(x) > 1]"),
    "round": (["assert round(avg([1, 2, 4]), 2) == 2.33"], "def avg(xs):\n    return sum(xs) / len(xs)"),
    "list": (["assert list(evens(5)) == [0, 2, 4]"], "def evens(n):\n    return range(0, n, 2)"),
    "float": (["assert float(half(5)) == 2.5"], "def half(n):\n    return n / 2"),
    "isinstance": (["assert isinstance(count(3), int)", "assert count(3) == 3"],
                   "def count(n):\n    return n"),
}

REBIND = {  # the one line that scored 1.0: the program decides what the test's names mean
    "set": "def set(*a, **k):\n    return 0\ndef similar_elements(a, b):\n    return ()",
    "math": "class math:\n    def isclose(*a, **k):\n        return True\ndef volume_sphere(r):\n    return 0",
    "import math": "class math:\n    def isclose(*a, **k):\n        return True\ndef volume_sphere(r):\n    return 0",
    "sorted": "def sorted(*a, **k):\n    return [2, 3]\ndef dups(xs):\n    return []",
    "round": "def round(*a, **k):\n    return 2.33\ndef avg(xs):\n    return 0",
    "list": "def list(*a, **k):\n    return [0, 2, 4]\ndef evens(n):\n    return None",
    "float": "def float(*a, **k):\n    return 2.5\ndef half(n):\n    return 'x'",
    "isinstance": "def isinstance(*a):\n    return True\ndef count(n):\n    return 'three'",
}


@pytest.mark.parametrize("name", sorted(MBPP))
def test_a_rebound_builtin_or_module_changes_nothing_in_the_test(name):
    tests, honest = MBPP[name]
    good = _run(honest, tests)
    assert (good.score, good.inside) == (1.0, 0), good
    wrong = _run(REBIND[name], tests)
    assert wrong.score == 0.0 and wrong.inside == 0, wrong


def test_rebinding_builtins_module_wide_reaches_only_the_programs_process():
    # builtins.set = ... rebinds it for every module of the program's interpreter, and no further
    wrong = ("import builtins, math\nbuiltins.set = lambda *a: 0\nmath.isclose = lambda *a, **k: True\n"
             "builtins.isinstance = lambda *a: True\ndef volume_sphere(r):\n    return 0")
    tests = ["assert math.isclose(volume_sphere(10), 4188.79, rel_tol=0.001)",
             "assert set([volume_sphere(1)]) == set([4.18])", "assert isinstance(volume_sphere(1), float)"]
    assert _run(wrong, tests).score == 0.0


# ---------------------------------------------------------------- class 2: methods of a value

LIARS = ["assert digits('12').isnumeric()", "assert title('a b').istitle()", "assert ascii_of('é').isascii()",
         "assert digits('12').isdigit() and digits('12').isdecimal()", "assert title('ab').upper() == 'AB'"]


def test_a_lying_string_method_runs_on_the_plain_string():
    liar = ("class S(str):\n"
            "    def __getattribute__(self, name):\n        return lambda *a, **k: True\n"
            "    def upper(self):\n        return 'AB'\n"
            "def digits(s):\n    return S('no')\n"
            "def title(s):\n    return S('no')\n"
            "def ascii_of(s):\n    return S('é')\n")
    res = _run(liar, LIARS)
    assert res.score == 0.0, res
    honest = "def digits(s):\n    return s\ndef title(s):\n    return s.title()\ndef ascii_of(s):\n    return 'e'\n"
    assert _run(honest, LIARS).score == 1.0


# ---------------------------------------------------------------- class 3: a check run inside

STEAL = ("import gc, re, sys\n"
         "def look():\n"
         "    found = set()\n"
         "    for o in gc.get_objects():\n"
         "        for v in (o if type(o) in (list, tuple) else ()):\n"
         "            if type(v) is str:\n"
         "                found |= {int(n) for n in re.findall(r'\\b9\\d\\d\\d\\d\\b', v)}\n"
         "        if type(o) in (list, tuple, dict):\n"
         "            for v in (o.values() if type(o) is dict else o):\n"
         "                if type(v) is int and v > 90000:\n"
         "                    found.add(v)\n"
         "    fr = sys._getframe()\n"
         "    while fr is not None:\n"
         "        found |= {v for v in fr.f_locals.values() if type(v) is int and v > 90000}\n"
         "        fr = fr.f_back\n"
         "    return found\n"
         "def f(x):\n"
         "    hits = sorted(v for v in look() if v % 1000 == x)\n"
         "    return hits[0] if hits else -1\n"
         "def apply(g, x):\n"
         "    return g(f(x))\n")


def test_a_check_judged_inside_runs_alone_and_no_other_tests_answer_reaches_the_program():
    # on f173797 the comprehension (expected values in its text) was judged inside, in the same
    # process as the split calls f(1), f(2): the program read the answers there, 2 of 3 passed
    tests = ["assert [f(x) == y for x, y in ((1, 91001), (2, 92002))] == [True, True]",
             "assert f(1) == 91001", "assert f(2) == 92002",
             "assert apply(lambda v: v, 4) == 94004"]    # a lambda: beside the program, alone, counted
    res = _run(STEAL, tests)
    assert res.inside == 1 and res.per_test[:3] == [False, False, False], res
    honest = "def f(x):\n    return 90000 + 1001 * x\ndef apply(g, x):\n    return g(f(x))\n"
    good = _run(honest, tests)
    assert (good.score, good.inside) == (1.0, 1), good


# ---------------------------------------------------------------- class 5: work on a program's values

COLLIDE = ("M = (1 << 61) - 1\n"  # CPython's int hash is x mod 2**61-1: every multiple hashes to 0
           "def f(n):\n    return [i * M for i in range(1, 3_000)] if n == 3 else 1_000_000\n")


def test_colliding_values_and_big_numbers_cost_the_sandbox_not_the_trainer():
    # the trainer decodes no value of a program's any more: the set of colliding ints, the
    # factorial and the product are computed, if at all, in the test interpreter (its CPU limit);
    # the trainer's own CPU time for the batch stays that of reading verdicts (on f173797 these
    # ran in the trainer: 5-39 s of its CPU per sample), and an honest sibling of the batch scores
    tests = ["assert set(f(3)) == {1, 2}", "assert len({k: 0 for k in f(3)}) == 2",
             "assert math.factorial(f(1)) == 6", "assert math.prod(range(1, f(1))) == 2"]
    before = resource.getrusage(resource.RUSAGE_SELF)
    got = rewards.compute_score_batch(["code", "code"], ["```python\n" + COLLIDE + "```",
                                                         "```python\ndef f(n):\n    return [1, 2]\n```"],
                                      [json.dumps({"tests": tests})] * 2)
    after = resource.getrusage(resource.RUSAGE_SELF)
    assert got[0]["score"] == 0.0 and got[0]["reason"] in ("wrong_answer", "timeout"), got[0]
    assert got[1]["score"] == 0.5, got[1]  # [1, 2] passes the first two; f(1) is no number
    # a resource bound, not a timing: CPU seconds of this process, whatever the machine's load
    used = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert used < 3.0, f"the trainer spent {used:.1f} CPU-s scoring two samples"
