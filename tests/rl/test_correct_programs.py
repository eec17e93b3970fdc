"""Correct programs score 1 (issue 40, item 7): three right answers scored 0 on main, each a shape
of program or test that MBPP-style rows hold. Each runs through the code reward as the trainer
calls it (score.code_score -> sandbox.run_tests: the real sandbox and the trusted judge), and a
wrong program beside it still scores 0, so the fix did not just stop deciding."""

import json

import pytest

from hpcrl.rewards import score as rewards


def _score(code: str, tests: list) -> dict:
    return rewards.code_score("```python\n" + code + "\n```", json.dumps({"tests": tests}))


FUTURE = "from __future__ import annotations\nfrom collections import Counter\n\n"


def test_a_program_starting_with_a_future_import_scores_one():
    # the expected side Counter('abca') is evaluated in a clean sandbox that replays the program's
    # imports: `from __future__` replayed after other lines was a SyntaxError there, reason `error`
    tests = ["assert char_counts('abca') == Counter('abca')", "assert char_counts('') == Counter()"]
    good = _score(FUTURE + "def char_counts(s: str) -> Counter[str]:\n    return Counter(s)", tests)
    assert (good["score"], good["reason"]) == (1.0, "ok"), good
    wrong = _score(FUTURE + "def char_counts(s: str) -> Counter[str]:\n    return Counter(s[1:])", tests)
    assert wrong["score"] == 0.5 and wrong["reason"] == "wrong_answer", wrong


def test_a_test_checking_an_argument_mutated_in_place_scores_one():
    # `xs = [...]` is the test's data, bound in the trainer; the call runs in the program's process
    # and mutates its copy there: the assert must read that copy (it read the trainer's, unmutated,
    # and the call itself failed on a name never sent: reason `error`)
    tests = ["xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]",
             "ys = [5, -1]\nsort_in_place(ys)\nassert ys[0] == -1 and len(ys) == 2",
             "want = [0, 9]\nzs = [9, 0]\nsort_in_place(zs)\nassert zs == want"]
    good = _score("def sort_in_place(xs):\n    xs.sort()", tests)
    assert (good["score"], good["reason"], good["judged_inside"]) == (1.0, "ok", 0.0), good
    for wrong in ("def sort_in_place(xs):\n    return sorted(xs)",          # sorts a copy, leaves xs
                  "def sort_in_place(xs):\n    xs[:] = [1, 2, 3]"):        # forces one answer
        out = _score(wrong, tests)
        assert out["score"] < 1.0 and out["reason"] == "wrong_answer", (wrong, out)
    # the expected value stays in the test interpreter: a program that searches every object of
    # its process for it (to copy it into the argument) never finds it
    seeker = ("import gc\ndef sort_in_place(xs):\n    for o in gc.get_objects():\n"
              "        if type(o) is list and o is not xs and o == sorted(xs):\n            xs[:] = o\n            return\n")
    assert _score(seeker, tests[2:])["score"] == 0.0


@pytest.mark.parametrize("test, good, wrong", [
    ("assert all(double(x) == 2 * x for x in range(5))",
     "def double(x):\n    return 2 * x", "def double(x):\n    return x + 2"),
    ("assert not any(is_odd(n) for n in [2, 4, 6])",
     "def is_odd(n):\n    return n % 2 == 1", "def is_odd(n):\n    return n > 3"),
    ("assert sum(sq(i) for i in range(4)) == 14",
     "def sq(i):\n    return i * i", "def sq(i):\n    return i + i"),
])
def test_all_over_a_generator_in_a_test_scores_one(test, good, wrong):
    # the generator crossed as a generator (not data: reason `not_data`); it now crosses as the list
    # it yields and all()/any()/sum() run in the trainer on that list
    out = _score(good, [test])
    assert (out["score"], out["reason"]) == (1.0, "ok"), out
    bad = _score(wrong, [test])
    assert (bad["score"], bad["reason"]) == (0.0, "wrong_answer"), bad
