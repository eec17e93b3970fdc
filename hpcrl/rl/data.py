"""Datasets in TinyZero/verl's parquet schema: Countdown and arithmetic generation, GSM8K conversion.

A row: {data_source, prompt: [{role, content}], ability, reward_model: {style, ground_truth},
extra_info: {split, index, ...}} - the files load in verl unchanged.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

TEMPLATES = ("base", "tiny")
_OPS = "+-*/"


def countdown_prompt(numbers, target, template: str = "base") -> str:
    """TinyZero's base-model prompt, or a compact one a tiny word-level model can read."""
    if template == "tiny":
        return f"numbers {' '.join(str(n) for n in numbers)} target {target} answer"
    if template != "base":
        raise ValueError(f"template must be one of {TEMPLATES}, not {template!r}")
    return (
        "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
        "The assistant first thinks about the reasoning process in the mind and then provides the user with the answer.\n"
        f"User: Using the numbers {list(numbers)}, create an equation that equals {target}. You can use basic "
        "arithmetic operations (+, -, *, /) and each number can only be used once. Show your work in <think> "
        "</think> tags. And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 "
        "</answer>.\nAssistant: Let me solve this step by step.\n<think>"
    )


def _apply(op: str, a: int, b: int) -> int | None:
    """Integer results only, and no negatives or zero, so targets look like TinyZero's."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b if a > b else None
    if op == "*":
        return a * b
    return a // b if b > 1 and a % b == 0 else None


def countdown_problem(rng: random.Random, min_count: int, max_count: int, max_number: int,
                      max_target: int, ops: str = _OPS):
    """(numbers, target, equation), solvable by construction: numbers are combined left to right,
    each step's operator drawn uniformly first and then a next number that makes it valid (whole,
    positive). Drawing the operator first keeps - and / as common as + and *; rejecting whole
    problems instead would make them rare, and a policy could ignore them."""
    while True:
        count = rng.randint(min_count, max_count)
        value = rng.randint(1, max_number)
        numbers, eq = [value], str(value)
        for _ in range(count - 1):
            op = rng.choice(ops)
            choices = [n for n in range(1, max_number + 1) if _apply(op, value, n) is not None]
            if not choices:
                break
            n = rng.choice(choices)
            value = _apply(op, value, n)
            eq = f"({eq}) {op} {n}" if op in "*/" and len(numbers) > 1 else f"{eq} {op} {n}"
            numbers.append(n)
        if len(numbers) == count and 1 <= value <= max_target:
            rng.shuffle(numbers)
            return numbers, value, eq


def countdown_rows(n_train: int, n_test: int, seed: int = 0, min_count: int = 3, max_count: int = 4,
                   max_number: int = 99, max_target: int = 999, template: str = "base", ops: str = _OPS, disjoint: bool = True):
    """(train_rows, test_rows). With `disjoint`, test problems (numbers + target) are distinct and
    never occur in train, so the evaluation is held out; train rows may repeat each other when the
    space is small. Without it both splits are independent draws, as TinyZero's are."""
    rng = random.Random(seed)
    test_keys: set = set()
    rows = {"train": [], "test": []}
    for split, want in (("test", n_test), ("train", n_train)):
        misses = 0
        while len(rows[split]) < want:
            numbers, target, eq = countdown_problem(rng, min_count, max_count, max_number, max_target, ops)
            key = (tuple(sorted(numbers)), target)
            if disjoint and key in test_keys:
                misses += 1
                if misses > 10_000:
                    raise ValueError(f"countdown: the problem space is too small for {n_test} distinct test "
                                     f"problems plus training ones; raise max_number or lower the test size")
                continue
            if split == "test":
                test_keys.add(key)
            misses = 0
            rows[split].append(_countdown_row(numbers, target, eq, split, len(rows[split]), template))
    return rows["train"], rows["test"]


def _countdown_row(numbers, target, eq, split, index, template):
    return {
        "data_source": "countdown",
        "prompt": [{"role": "user", "content": countdown_prompt(numbers, target, template)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": {"target": int(target), "numbers": [int(n) for n in numbers]}},
        "extra_info": {"split": split, "index": index, "solution": eq},
    }


# ------------------------------------------------------------------ arithmetic

# A system message replaces the chat template's default one (SmolLM2's is ~20 tokens longer)
ARITHMETIC_SYSTEM = "Reply with just the number."


def arithmetic_rows(n_train: int, n_test: int, seed: int = 0, max_number: int = 9):
    """(train, test) rows 'What is a + b?' with a, b in 1..max_number, scored by the last number
    of the response (data_source 'arithmetic'). For a small pretrained instruct model: it knows
    these sums but often talks around them, so under a short response budget RL has room to make
    it answer directly. The splits are independent draws (the space is small)."""
    rng = random.Random(seed)
    rows = {"train": [], "test": []}
    for split, want in (("test", n_test), ("train", n_train)):
        for i in range(want):
            a, b = rng.randint(1, max_number), rng.randint(1, max_number)
            rows[split].append({
                "data_source": "arithmetic",
                "prompt": _messages(f"What is {a} + {b}?", ARITHMETIC_SYSTEM),
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": i},
            })
    return rows["train"], rows["test"]


# ------------------------------------------------------------------ GSM8K

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_GSM8K_ANSWER_RE = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_rows(records, split: str):
    """verl's preprocessing: question + instruction; ground truth from '#### N' without commas."""
    rows = []
    for i, rec in enumerate(records):
        if "question" not in rec or "answer" not in rec:
            raise ValueError(f"record {i} lacks 'question' or 'answer' (has {sorted(rec)})")
        m = _GSM8K_ANSWER_RE.search(str(rec["answer"]))
        if not m:
            raise ValueError(f"record {i}: answer has no '#### N' final answer")
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{rec['question']} {GSM8K_INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": m.group(1).replace(",", "")},
            "extra_info": {"split": split, "index": i, "answer": rec["answer"], "question": rec["question"]},
        })
    return rows


def read_records(path) -> list[dict]:
    """Rows of a .jsonl/.json/.parquet file as dicts."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    if path.suffix == ".parquet":
        import pandas as pd

        return pd.read_parquet(path).to_dict("records")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return json.loads(text)
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError:
                raise ValueError(f"{path}:{n}: not a JSON line") from None
    return records


def write_parquet(rows, path) -> None:
    """Write atomically (temporary name, then rename) so a killed writer leaves no half file."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pd.DataFrame(rows).to_parquet(tmp, index=False)
    tmp.replace(path)


# ------------------------------------------------------------------ loading for training


def _plain(value):
    """numpy arrays / scalars from parquet -> plain Python (rewards and JSON expect those)."""
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def load_examples(path) -> list[dict]:
    """Training examples: {messages, data_source, ground_truth, extra_info} per row."""
    out = []
    for rec in read_records(path):
        rec = _plain(rec)
        prompt = rec["prompt"]
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        out.append({
            "messages": messages,
            "data_source": rec.get("data_source", ""),
            "ground_truth": (rec.get("reward_model") or {}).get("ground_truth"),
            "extra_info": rec.get("extra_info") or {},
        })
    if not out:
        raise ValueError(f"{path} has no rows")
    return out


# ------------------------------------------------------------------ code-tiny (the CPU demo of the code reward)

CODE_TINY_PREFIX = "def f(a, b):\n    return "
# description -> the expression it asks for; the answer space is every `x op y` over a, b, + - *
# (the word comes last in the prompt, next to the answer, so a 1-2 layer model reads it easily)
CODE_TINY_TASKS = {"sum": "a + b", "product": "a * b", "difference": "a - b", "double": "a + a", "square": "a * a"}
CODE_TINY_ANSWERS = [f"{x} {op} {y}" for x in "ab" for op in "+-*" for y in "ab"]
_CODE_TINY_INPUTS = ((3, 5), (7, 2), (4, 4))  # distinguish every pair of distinct answers


def code_tiny_rows(n_train: int, n_test: int, seed: int = 0):
    """(train, test) rows: 'def f ( a , b ) : return # product' -> 'a * b', scored by
    running f against assert tests in the sandbox. The test split holds each task once per row
    drawn, so evaluation covers every task."""
    rng = random.Random(seed)
    tasks = list(CODE_TINY_TASKS)
    train = [_code_tiny_row(rng.choice(tasks), "train", i) for i in range(n_train)]
    test = [_code_tiny_row(tasks[i % len(tasks)], "test", i) for i in range(n_test)]
    return train, test


def _code_tiny_row(task: str, split: str, index: int) -> dict:
    expr = CODE_TINY_TASKS[task]
    tests = [f"assert f({a}, {b}) == {eval(expr, {'a': a, 'b': b})}" for a, b in _CODE_TINY_INPUTS]  # our own expr
    return code_row(f"def f ( a , b ) : return # {task}", tests, split, index, prefix=CODE_TINY_PREFIX,
                    extra={"task": task, "format_targets": CODE_TINY_ANSWERS})


def code_row(prompt: str, tests: list, split: str, index: int, prefix: str = "", system: str | None = None,
             extra: dict | None = None) -> dict:
    """A row for the code reward. ground_truth is a JSON string ({"tests": [...], "prefix": ...}) so
    assert strings and stdin/stdout pairs can mix in one parquet column; the reward decodes it."""
    gt = {"tests": tests, **({"prefix": prefix} if prefix else {})}
    return {"data_source": "code", "prompt": _messages(prompt, system), "ability": "code",
            "reward_model": {"style": "rule", "ground_truth": json.dumps(gt)},
            "extra_info": {"split": split, "index": index, **(extra or {})}}


def _messages(prompt: str, system: str | None) -> list:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
