"""Rule rewards: TinyZero's Countdown semantics evaluated safely, verl's GSM8K extraction."""

import time

import pytest

from hpcrl.rewards import score as rewards
from hpcrl.rewards.score import compute_score, countdown_score, extract_gsm8k_answer, gsm8k_score, safe_eval_equation

GT = {"target": 24, "numbers": [2, 3, 4]}


@pytest.mark.parametrize("response, expected", [
    ("<answer> 2 * 3 * 4 </answer>", 1.0),
    ("<answer>(4 - 2) * 3 * 4</answer>", 0.1),         # 4 used twice
    ("<answer> 4 * 3 * 2 </answer>", 1.0),             # any order
    ("<answer> 2 + 3 + 4 </answer>", 0.1),             # valid, wrong value
    ("<answer> 2 * 3 </answer>", 0.1),                 # a number unused
    ("no answer tags at all 2*3*4", 0.0),
    ("<answer> 1 </answer> then <answer> 2*3*4 </answer>", 1.0),  # the last answer counts
    ("<answer> 2*3*4 </answer> then <answer> 2+3+4 </answer>", 0.1),
    ("<answer>\n2*3*4\n</answer>", 0.0),               # TinyZero matches within one line
    ("<answer> 24 / (4 / (2 * 3)) </answer>", 0.1),    # 24 is not a given number
    ("<answer> 4 / (2 - 2) * 3 </answer>", 0.1),       # numbers wrong anyway
    ("Assistant: <answer> 2*3*4 </answer>", 1.0),
])
def test_countdown_table(response, expected):
    assert countdown_score(response, GT) == pytest.approx(expected)


def test_countdown_division_exactness():
    assert countdown_score("<answer> 6 / (1 - 3 / 4) </answer>", {"target": 24, "numbers": [1, 3, 4, 6]}) == 1.0
    assert countdown_score("<answer> 3 / (2 - 2) </answer>", {"target": 1, "numbers": [2, 2, 3]}) == 0.1


@pytest.mark.parametrize("payload", [
    "__import__('os').system('touch /tmp/hpcrl-pwned')",
    "2**3**4**5**6**7**8",
    "9**9**9**9",
    "(lambda: 2)()",
    "[2, 3, 4]",
    "2 if 3 else 4",
    "().__class__.__bases__[0]",
    "open('/etc/passwd')",
    "2; 3; 4",
    "9" * 400,
    "(" * 150 + "2" + ")" * 150,
    "99999999 * 99999999 * 99999999 * 99999999 * 99999999",
])
def test_hostile_equations_execute_nothing_and_score_at_most_format(payload, tmp_path):
    t0 = time.monotonic()
    score = countdown_score(f"<answer>{payload}</answer>", {"target": 5, "numbers": [2, 3]})
    assert score <= rewards.COUNTDOWN_FORMAT_SCORE
    assert time.monotonic() - t0 < 0.5
    with pytest.raises(ValueError):
        safe_eval_equation(payload)


def test_safe_eval_values():
    assert safe_eval_equation("(1 + 2) / 3") == 1.0
    assert safe_eval_equation("-3 + 10") == 7.0
    assert safe_eval_equation("7 - 2 * 3") == 1.0
    with pytest.raises(ValueError):
        safe_eval_equation("1 / 0")


# verl's gsm8k extraction (verl/utils/reward_score/gsm8k.py), case by case
@pytest.mark.parametrize("text, strict, flexible", [
    ("so the answer is #### 72", "72", "72"),
    ("#### 1,234", "1234", "1,234"),                       # strict strips commas, flexible does not
    ("#### -5", "-5", "-5"),
    ("#### 3.50", "3.50", "3.50"),
    ("#### 10 and later #### 12", "12", "12"),              # the last match
    ("the answer is 42.", None, "42."),
    ("####72", None, "72"),                                # strict needs the space
    ("no numbers", None, None),
    ("x" * 400 + "#### 7", "7", "7"),
    ("#### 9 " + "y" * 400, None, None),                    # outside the 300-char tail
    ("a . b", None, None),
    ("$#### 5$", "5", "5"),
])
def test_gsm8k_extraction_matches_verl(text, strict, flexible):
    assert extract_gsm8k_answer(text, "strict") == strict
    assert extract_gsm8k_answer(text, "flexible") == flexible


def test_gsm8k_score_and_dispatch():
    assert gsm8k_score("#### 1,234", "1234") == 1.0
    assert gsm8k_score("#### 1235", "1234") == 0.0
    assert compute_score("openai/gsm8k", "ok #### 18", "18") == 1.0
    assert compute_score("countdown", "<answer>2*3*4</answer>", GT) == 1.0
    with pytest.raises(NotImplementedError):
        compute_score("unknown_source", "x", "y")


def test_user_reward_from_file_and_module(tmp_path):
    f = tmp_path / "myreward.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return float(len(solution_str))\n"
                 "def other(ds, s, gt, extra_info=None):\n    return -1.0\n")
    assert rewards.load_reward(str(f))("x", "abc", None) == 3.0
    assert rewards.load_reward(f"{f}:other")("x", "abc", None) == -1.0
    assert rewards.load_reward("hpcrl.rewards.score:compute_score") is compute_score
    assert rewards.load_reward("hpcrl.rl.rewards:compute_score") is compute_score  # the name before issue 40
    with pytest.raises(ValueError):
        rewards.load_reward(f"{f}:missing")
    with pytest.raises(ValueError):
        rewards.load_reward(str(tmp_path / "absent.py"))


def test_reward_model_batch_normalisation_is_global_and_truncates_from_the_left(tmp_path):
    """reward_model_normalize: batch (issue 19, item 7) z-scores over the global batch: two ranks
    (threads sharing one gather, as dist.Dist.sum adds over processes) get exactly the 1-rank
    values of their rows. A reward-model input longer than the model's length loses its
    beginning, not the response's end."""
    from hpcrl.rewards.mix import ModelReward
    from hpcrl.rl.tiny import build_tiny_model

    from rl_helpers import as_two_ranks

    rm = build_tiny_model(tmp_path / "rm", hidden_size=32, layers=1, heads=2, max_int=60, reward_head=True)
    reward = ModelReward(str(rm), None, batch_size=3, normalize="batch")
    examples = [{"messages": [{"role": "user", "content": f"numbers {i} and {2 * i}"}]} for i in range(6)]
    texts = [f"<answer> {i} + {3 * i} </answer>" for i in range(6)]
    one = reward(examples, texts)
    assert abs(sum(one)) < 1e-4 and len(set(round(v, 4) for v in one)) > 1

    class Sum:  # dist.Dist's sum over the two thread-ranks
        def __init__(self, gather):
            self.gather = gather

        def sum(self, values):
            return [float(sum(col)) for col in zip(*self.gather(list(values)))]

    halves = as_two_ranks(lambda rank, gather: reward(examples[3 * rank:3 * rank + 3], texts[3 * rank:3 * rank + 3],
                                                      dist=Sum(gather)))
    assert max(abs(a - b) for a, b in zip(halves[0] + halves[1], one)) < 1e-5, (halves, one)
    # alone, each half would be normalised over itself: not the global values
    assert max(abs(a - b) for a, b in zip(reward(examples[:3], texts[:3]), one[:3])) > 1e-3

    reward.max_len = 8
    long = reward._text({"messages": [{"role": "user", "content": " ".join(["numbers"] * 40)}]}, "<answer> 7 </answer>")
    ids = reward.encode([long]).input_ids[0].tolist()
    assert len(ids) == 8 and ids[-3:] == reward.tok("<answer> 7 </answer>", add_special_tokens=False).input_ids[-3:]


def test_reward_figures_of_parts_combine_into_those_of_the_whole_batch():
    """Each rank logs its share's reward/* figures, a multi-turn step one set a reward call: the
    whole batch's are made of them (mix.combine), exactly: a mean key only some samples had (its
    own count), a reason absent from one part (a share of 0 there, not a missing figure), a
    sample whose value is a bare float (no dict: no reason), a part without any key."""
    import random

    from hpcrl.rewards.mix import Figures, _extras, combine

    rng = random.Random(7)
    for trial in range(200):
        n = rng.randint(2, 12)
        values = []
        for _ in range(n):
            d = {"score": rng.random()}
            if rng.random() < 0.9:
                d["reason"] = rng.choice(["ok", "wrong_answer", "timeout"])
            if rng.random() < 0.5:
                d["pass_rate"] = rng.random()
            values.append(d if rng.random() < 0.9 else rng.random())
        scores = [v["score"] if isinstance(v, dict) else v for v in values]
        whole = _extras(values, scores, "code")
        cuts = [0, *sorted(rng.sample(range(1, n), rng.randint(1, min(3, n - 1)))), n]
        parts = [(_extras(values[a:b], scores[a:b], "code"), b - a) for a, b in zip(cuts, cuts[1:])]
        got = combine(parts)
        assert got.keys() == whole.keys(), trial
        assert all(got[k] == pytest.approx(whole[k], abs=2e-6) for k in whole), (trial, dict(got), dict(whole))
    # rank 0 alone (what was logged before) is not the whole: one rank all ok, the other all timeouts
    a = _extras([{"score": 1.0, "reason": "ok"}] * 4, [1.0] * 4, None)
    b = _extras([{"score": 0.0, "reason": "timeout"}] * 4, [0.0] * 4, None)
    assert dict(combine([(a, 4), (b, 4)])) == {"reward/reason/ok": 0.5, "reward/reason/timeout": 0.5}
    # a plain dict (a user's environment's figures) weighs by its samples; one part is itself
    assert combine([({"reward/x": 1.0}, 1), ({"reward/x": 0.0}, 3)])["reward/x"] == 0.25
    one = Figures({"reward/y": 0.3}, {"reward/y": 3})
    assert combine([(one, 3)]) is one
