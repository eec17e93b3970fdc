"""The answer extractor on answers as models write them (issue 40, items 3 and 8).

tests/data/extract/smollm2.json holds answers SmolLM2-135M-Instruct really wrote to C-to-Python
and MBPP-style prompts (scripts/smollm2_code_answers.py, HF generate on CPU, sampled), each with
the code a person reading it would run; tests/data/extract/shapes.json the shapes hand-made
(a lone or stray fence, prose before and after, several blocks, unfenced code). On main a lone
closing fence or a stray opening one made the prose the program: every sample `syntax_error`."""

import json
from pathlib import Path

import pytest

from hpcrl.rewards import extract, mix
from hpcrl.rewards import score as rewards

DATA = Path(__file__).resolve().parents[1] / "data" / "extract"
SHAPES = json.loads((DATA / "shapes.json").read_text())["cases"]
SMOLLM2 = json.loads((DATA / "smollm2.json").read_text())["answers"]
assert len(SMOLLM2) >= 8, "tests/data/extract/smollm2.json holds the recorded answers"


@pytest.mark.parametrize("case", SHAPES, ids=[c["id"] for c in SHAPES])
def test_each_shape_yields_its_code(case):
    code, shape = extract.extract(case["response"], case.get("prefix", ""))
    assert (shape, code) == (case["shape"], case["want"]), case["why"]


@pytest.mark.parametrize("case", SMOLLM2, ids=[c["id"] for c in SMOLLM2])
def test_what_smollm2_wrote_yields_the_code_it_meant(case):
    code, shape = extract.extract(case["response"])
    assert case["want"] is not None, "fill in `want` by reading the response (never from the extractor)"
    assert (shape, code) == (case["shape"], case["want"]), (case["why"], case["response"])


C2PY = json.dumps({"tests": ["assert add(2, 3) == 5", "assert add(-4, 4) == 0"]})
ADD = "def add(a, b):\n    return a + b"


def test_real_fence_shapes_score_through_the_sandbox_and_a_failure_names_its_shape():
    # the trainer's reward (mix.Reward -> code_score_batch -> the sandbox's pool), on the two shapes
    # that scored 0 in the run (the first as SmolLM2 wrote it), a clean block, and one
    # answer with no code that parses
    answers = [next(c["response"] for c in SMOLLM2 if c["id"] == "c2py-01"),
               "```\nHere is the Python version:\n```python\n" + ADD + "\n```\nDone.",
               "```python\n" + ADD + "\n```",
               "Sure! ```python def add(a, b) return a + b```"]
    rows = [{"data_source": "code", "ground_truth": C2PY, "extra_info": {}, "messages": []}] * len(answers)
    cfg = {"reward": "code", "code_timeout_s": 10, "code_memory_mb": 512, "code_format_score": 0.0,
           "code_workers": 2, "code_dedupe": True, "length_norm_chars": 1000}
    scores, metrics = mix.Reward(cfg)(rows, answers)
    assert scores == [1.0, 1.0, 1.0, 0.0], (scores, metrics)
    # per sample: which shape the program came from, so a syntax_error says which shape failed
    per = rewards.code_score_batch(answers, [C2PY] * len(answers))
    assert [p["extract"] for p in per] == ["lone_closing_fence", "fenced", "fenced", "unfenced"], per
    assert per[3]["reason"] == "syntax_error", per[3]
    assert metrics["reward/extract/lone_closing_fence"] == 0.25 and metrics["reward/reason/syntax_error"] == 0.25


def test_the_format_score_goes_to_a_closed_fenced_block_only():
    lone = rewards.code_score(ADD + "\n```\nprose", C2PY, format_score=0.1)
    fenced = rewards.code_score("```python\n" + ADD + "\n```", C2PY, format_score=0.1)
    assert (lone["score"], fenced["score"]) == (0.9, 1.0), (lone, fenced)


def test_parsing_is_bounded_however_many_fences(monkeypatch):
    # a hostile answer of thousands of blocks and code-looking lines costs at most MAX_PARSES parses
    calls = []
    real = extract.ast.parse
    monkeypatch.setattr(extract.ast, "parse", lambda src, *a, **k: calls.append(1) or real(src, *a, **k))
    answer = "```python\ndef f(:\n```\n" * 3000 + "x = (\n" * 2000
    code, shape = extract.extract(answer)
    assert shape == "fenced" and code == "def f(:" and 0 < len(calls) <= extract.MAX_PARSES
