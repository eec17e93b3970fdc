"""A spec's code_timeout_s is CPU time, not wall time (issue 42: "Sandbox limits are CPU time, not
wall time, so an episode's outcome does not depend on the machine's load and a resume is exact").
Under the full suite, correct samples stalled past a 5 s wall clock and scored `timeout` (2 of
16,000 in one CI run; a correct `add` through verl's loader in another). A sample kept off the CPU
is what load does to it; a `time.sleep` here stands in for that stall, since it uses no CPU. Through
the trainer's reward (mix.Reward from the spec's keys) and the code-repair environment's limits."""

import json

from hpcrl.rewards import mix, sandbox

TESTS = json.dumps({"tests": ["assert add(2, 3) == 5", "assert add(-4, 4) == 0"]})
ADD = "def add(a, b):\n    return a + b"


def _scores(answers, timeout_s=1.0):
    rows = [{"data_source": "code", "ground_truth": TESTS, "extra_info": {}, "messages": []}] * len(answers)
    cfg = {"reward": "code", "code_timeout_s": timeout_s, "code_memory_mb": 512, "code_format_score": 0.0,
           "code_workers": 2, "code_dedupe": False, "length_norm_chars": 1000}
    return mix.Reward(cfg)(rows, ["```python\n" + a + "\n```" for a in answers])


def test_a_correct_program_kept_off_the_cpu_past_the_limit_scores_one_and_a_busy_loop_times_out():
    stalled = "import time\ntime.sleep(2.5)\n" + ADD  # 2.5 s of wall, ~0 of CPU, against a 1 s limit
    busy = "while True:\n    pass\n" + ADD
    asleep = "import time\ntime.sleep(1000)\n" + ADD  # ended by the wall-clock backstop
    scores, metrics = _scores([stalled, busy, asleep])
    assert scores == [1.0, 0.0, 0.0], (scores, metrics)
    assert abs(metrics["reward/reason/timeout"] - 2 / 3) < 1e-5, metrics


def test_the_limits_from_a_spec_are_cpu_seconds_with_a_longer_wall_backstop():
    lim = sandbox.cpu_limits(5.0, 256)
    assert (lim.cpu_s, lim.memory_mb) == (5, 256) and lim.timeout_s == 3 * 5 + 5
    assert sandbox.cpu_limits(0.4).cpu_s == 1 and sandbox.cpu_limits(2.5).cpu_s == 3  # RLIMIT_CPU: whole seconds
    # the code-repair environment's visible tests run under the same limits as the reward's
    from hpcrl.envs import code_repair

    assert "sandbox.cpu_limits(" in open(code_repair.__file__, encoding="utf-8").read()


def test_the_default_limits_of_the_code_score_verl_loads_are_cpu_seconds_too():
    # rewards.code_score / code_score_batch without limits (verl's reward loader calls them so):
    # 5 s of CPU, the spec's default; a correct answer stalled 6 s still scores
    from hpcrl.rewards import score as rewards

    stalled = "```python\nimport time\ntime.sleep(6)\n" + ADD + "\n```"
    assert rewards.code_score(stalled, TESTS)["score"] == 1.0
    assert [r["reason"] for r in rewards.code_score_batch(["```python\nwhile True:\n    pass\n```", stalled],
                                                           [TESTS, TESTS])] == ["timeout", "ok"]


LOOPS_ON_TWO = "def f(x):\n    while x == 2:\n        pass\n    return x\ndef g(fn):\n    while True:\n        pass"


def test_a_sample_ended_by_its_cpu_limit_scores_as_one_ended_by_the_wall_clock():
    # Which limit ends a looping program first depends on the machine's load (the wall clock is a
    # backstop several times the CPU limit). A resumed code-repair run once differed from the
    # first here: the CPU limit ended a sample in one ("the program's process ended", the tests
    # before the loop counted) and the wall clock in the other. Both are now one result.
    from hpcrl.envs import code_repair

    cases = {"split": ["assert f(1) == 1", "assert f(2) == 2", "assert f(3) == 3"],
             "inside": ["assert f(1) == 1", "assert g(lambda: 1) == 1"]}  # a lambda: judged beside the program
    for name, tests in cases.items():
        by_cpu = sandbox.run_tests(LOOPS_ON_TWO, tests, sandbox.Limits(timeout_s=120.0, cpu_s=1))
        by_wall = sandbox.run_tests(LOOPS_ON_TWO, tests, sandbox.Limits(timeout_s=2.0, cpu_s=120))
        shown = [(r.score, r.passed, r.total, r.reason, r.detail, r.per_test, r.inside) for r in (by_cpu, by_wall)]
        assert shown[0] == shown[1] and shown[0][:5] == (0.0, 0, len(tests), "timeout", ""), (name, shown)
        assert code_repair.feedback(by_cpu, tests) == code_repair.feedback(by_wall, tests)
