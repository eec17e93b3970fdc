"""Issue 28, classes "checks that are calls", "raise checks", "cross-test text" and "cached
failures": a test's decision is made in the trainer on the values the program returned, or the
test is counted in `inside` (reward/judged_inside). Each wrong program below scores 0, or its
score is counted as judged inside; an honest program scores 1 with nothing inside."""

import pytest

from hpcrl.rewards import sandbox
from hpcrl.rewards import score as rewards

FAST = sandbox.Limits(timeout_s=5.0, cpu_s=3)

# The program's own `math`, `str`, `bool` and `isinstance`, patched to pass whatever is asked
PATCH_MATH = ("import math, builtins\n"
              "math.isclose = lambda *a, **k: True\n"
              "builtins.isinstance = lambda *a: True\n"
              "def f(x):\n    return 0.0\n")
PATCH_STR = ("class S(str):\n"
             "    def startswith(self, *a): return True\n"
             "    def endswith(self, *a): return True\n"
             "    def __eq__(self, o): return True\n"
             "    __hash__ = str.__hash__\n"
             "def f(x):\n    return S('nope')\n")
CALL_CHECKS = ["assert math.isclose(f(1), 3.0)",
               "assert math.isclose(f(2), 6.0, rel_tol=1e-9) == True",
               "assert math.isclose(f(3), 9.0) is True",
               "assert abs(f(1) - 3.0) < 1e-9",
               "assert round(f(2), 6) == 6.0"]
STR_CHECKS = ["assert g('ab').startswith('ab!')", "assert g('ab').endswith('!')",
              "assert g('ab').upper() == 'AB!'", "assert len(g('ab')) == 3"]


@pytest.mark.parametrize("code", [PATCH_MATH, "def f(x):\n    return 0.0\nimport math\nmath.isclose = lambda *a, **k: True"])
def test_checks_that_are_calls_are_judged_here(code):
    res = sandbox.run_tests(code, CALL_CHECKS, FAST)
    assert (res.score, res.inside) == (0.0, 0), res
    honest = sandbox.run_tests("def f(x):\n    return 3.0 * x", CALL_CHECKS, FAST)
    assert (honest.score, honest.inside) == (1.0, 0), honest


def test_string_method_checks_are_judged_here():
    liar = PATCH_STR.replace("def f(x)", "def g(x)")
    res = sandbox.run_tests(liar, STR_CHECKS, FAST)
    assert (res.score, res.inside) == (0.0, 0), res
    honest = sandbox.run_tests("def g(s):\n    return s + '!'", STR_CHECKS, FAST)
    assert (honest.score, honest.inside) == (1.0, 0), honest


def test_mbpp_style_isclose_solution_scores_one():
    # MBPP task 17-like: float answers tested with math.isclose and a tolerance
    gt = {"tests": ["assert math.isclose(volume_sphere(10), 4188.790204786391, rel_tol=0.001)",
                    "assert math.isclose(volume_sphere(25), 65449.84694978735, rel_tol=0.001)",
                    "assert math.isclose(volume_sphere(20), 33510.32163829113, rel_tol=0.001)"]}
    good = "```python\nimport math\ndef volume_sphere(r):\n    return (4 / 3) * math.pi * r ** 3\n```"
    out = rewards.compute_score("code", good, gt)
    assert (out["score"], out["judged_inside"]) == (1.0, 0.0), out
    wrong = "import math\nmath.isclose = lambda *a, **k: True\ndef volume_sphere(r):\n    return 0"
    out = rewards.compute_score("code", wrong, gt)
    assert (out["score"], out["judged_inside"]) == (0.0, 0.0), out


def test_raise_checks_are_judged_here_or_counted():
    tests = ["r = f(2)\nif r != 6:\n    raise AssertionError('want 6')",
             "assert f(1) == 3",
             "for x in (1, 2):\n    if f(x) != 3 * x:\n        raise ValueError(x)"]
    liar = "import builtins\nclass E(BaseException): pass\nbuiltins.AssertionError = builtins.ValueError = E\ndef f(x):\n    return 0"
    res = sandbox.run_tests(liar, tests, FAST)
    assert res.score == 0.0 and res.per_test[0] is False, res
    honest = sandbox.run_tests("def f(x):\n    return 3 * x", tests, FAST)
    # all three run in the test interpreter, the loop too: nothing is judged inside
    assert (honest.score, honest.inside) == (1.0, 0), honest
    # a program that swallows the loop's raise passes the loop only, and it is counted
    swallow = ("import sys\n"
               "def f(x):\n"
               "    sys.settrace(None)\n"
               "    return 0\n"
               "class Quiet(BaseException): pass\n"
               "__builtins__['ValueError'] = Quiet if isinstance(__builtins__, dict) else Quiet\n")
    res = sandbox.run_tests(swallow, tests[:2], FAST)
    assert (res.passed, res.inside) == (0, 0), res


def test_one_tests_text_never_reaches_another_tests_program():
    # an unsplittable test (a loop over expected values) would sit in the payload of every test
    # of the row: a program reading it passes the split test
    secret_loop = "for x, want in ((1, 3), (2, 6), (7, 777)):\n    assert f(x) == want"
    steal = ("import re, sys\n"
             "def strings(v, depth=0):\n"
             "    if isinstance(v, str):\n"
             "        yield v\n"
             "    elif isinstance(v, (list, tuple)) and depth < 6:\n"
             "        for x in v:\n"
             "            yield from strings(x, depth + 1)\n"
             "def f(x):\n"
             "    fr = sys._getframe(1)\n"
             "    while fr is not None:\n"
             "        for s in strings(list(fr.f_locals.values())):\n"
             "            m = re.search(r'\\(%d, (\\d+)\\)' % x, s)\n"
             "            if m:\n"
             "                return int(m.group(1))\n"
             "        fr = fr.f_back\n"
             "    return -1\n")
    res = sandbox.run_tests(steal, [secret_loop, "assert f(7) == 777"], FAST)
    # the loop runs in the test interpreter, whose frames the program's process never has
    assert res.per_test == [False, False] and res.inside == 0, res
