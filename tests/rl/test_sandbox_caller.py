"""Issue 28, class "caller crashes": what a sample claims can cost the trainer nothing. A program
owns its result channel (it can write any bytes there and leave), so every claim it can make is
tried here as the trainer reads it: through a real sandboxed program, through the batch (a sibling
keeps its score) and through the reward functions verl calls (no exception ever reaches them)."""

import tracemalloc

import pytest

from hpcrl.rewards import sandbox
from hpcrl.rewards import score as rewards

FAST = sandbox.Limits(timeout_s=5.0, cpu_s=3)
GOOD = "def f(a, b):\n    return a + b"
TESTS = ["assert f(1, 2) == 3"]


def _claim(body: str) -> str:
    """A wrong program that writes `body` (a bytes expression) as its whole result line on its
    own channel and leaves."""
    return ("import os\n"
            f"BODY = {body}\n"
            "for fd in os.listdir('/proc/self/fd'):\n"
            "    try:\n"
            "        if os.readlink('/proc/self/fd/' + fd).startswith('pipe:'):\n"
            "            view = memoryview(BODY)\n"
            "            while view:\n"
            "                view = view[os.write(int(fd), view):]\n"
            "    except OSError:\n"
            "        pass\n"
            "os._exit(0)\n"
            "def f(a, b):\n    return 0\n")


OVERFLOW = """b'{"tests": [{"values": [{"c": [1' + b"0" * 400 + b', 0]}]}]}\\n'"""
# 8 MiB of empty lists: ~2.8 million list objects if the trainer decoded it whole
NESTED = """b'{"tests": [{"values": [[' + b"[]," * ((8 << 20) // 3 - 20) + b'[]]]}]}\\n'"""


@pytest.mark.parametrize("body", [OVERFLOW, NESTED], ids=["overflowing_complex", "nested_empty_lists_8mib"])
def test_a_hostile_claim_scores_zero_and_the_batch_keeps_its_sibling(body):
    wrong = _claim(body)
    res = sandbox.run_tests(wrong, TESTS, FAST)
    assert (res.score, res.passed) == (0.0, 0) and res.reason in ("not_data", "output_limit"), res
    got = rewards.compute_score_batch(["code", "code"], [wrong, GOOD], [{"tests": TESTS}] * 2)
    assert [g["score"] for g in got] == [0.0, 1.0], got
    one = rewards.compute_score("code", wrong, {"tests": TESTS})
    assert one["score"] == 0.0 and one["reason"] in ("not_data", "output_limit"), one
    (ok, why), = sandbox.evaluate(wrong, ["f(1, 2)"], FAST)
    assert not ok and isinstance(why, str), why


def test_the_trainer_reads_only_verdicts_within_a_memory_bound():
    # the largest value a program can return goes to the test interpreter, never to the trainer:
    # what the trainer allocates while the sample is scored stays small
    big = "def f(a, b):\n    return [[] for _ in range(2_000_000)]"
    tracemalloc.start()
    try:
        res = sandbox.run_tests(big, TESTS, FAST)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert res.score == 0.0 and res.reason in ("output_limit", "timeout"), res
    assert peak < 16 << 20, f"scoring one sample took {peak >> 20} MiB of the trainer's memory"


def test_a_reward_never_raises_into_the_trainer():
    # a malformed row or any error inside the judge scores that sample 0 with a reason
    for gt in ("not json", {"tests": "x"}, {"tests": [{"input": 1}]}, None):
        out = rewards.compute_score("code", GOOD, gt)
        assert out["score"] == 0.0 and out["reason"] == "bad_tests", (gt, out)
    got = rewards.compute_score_batch(["code", "code"], [GOOD, GOOD], [None, {"tests": TESTS}])
    assert [g["score"] for g in got] == [0.0, 1.0] and got[0]["reason"] == "bad_tests", got
