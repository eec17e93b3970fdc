"""Rule rewards with verl's custom-reward signature, plus loading a user's reward function.

`compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float` is what verl
calls for `reward.custom_reward_function`, so the same file serves the built-in trainer and verl:

    reward.custom_reward_function.path=<site-packages>/hpcrl/rl/rewards.py
    reward.custom_reward_function.name=compute_score

This module is stdlib only on purpose: verl imports it inside its reward workers.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import math
import operator
import re
from pathlib import Path

# ------------------------------------------------------------------ Countdown (TinyZero)

COUNTDOWN_FORMAT_SCORE = 0.1
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>")  # one line, as TinyZero matches it
_EQUATION_CHARS_RE = re.compile(r"^[\d+\-*/().\s]+$")
# Bounds that keep a hostile equation cheap: no power operator exists, so with 200 characters
# and |intermediate| <= 1e15 every evaluation is a few hundred float operations.
MAX_EQUATION_CHARS = 200
MAX_MAGNITUDE = 1e15
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def extract_countdown_equation(solution_str: str) -> str | None:
    """The text of the last <answer>...</answer> on one line, or None."""
    if "Assistant:" in solution_str:  # a TinyZero-style prompt+response string
        solution_str = solution_str.split("Assistant:", 1)[1]
    matches = _ANSWER_RE.findall(solution_str)
    return matches[-1].strip() if matches else None


def safe_eval_equation(expr: str) -> float:
    """Evaluate + - * / ( ) over numbers by walking the AST; ValueError for anything else.

    Never calls eval/exec: names, calls, attributes, powers, strings... are all rejected
    before anything is computed.
    """
    if len(expr) > MAX_EQUATION_CHARS or not _EQUATION_CHARS_RE.match(expr):
        raise ValueError("equation has characters other than digits, + - * / ( ) . and spaces")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, RecursionError, MemoryError) as e:
        raise ValueError(f"not an arithmetic expression: {e}") from None
    return _eval_node(tree.body)


def _eval_node(node) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = float(node.value)
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        value = _BINOPS[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_eval_node(node.operand))
    else:
        raise ValueError(f"disallowed syntax: {type(node).__name__}")
    if not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise ValueError("value out of range")
    return value


def _uses_numbers_exactly(equation: str, numbers) -> bool:
    used = sorted(int(n) for n in re.findall(r"\d+", equation))
    return used == sorted(int(n) for n in numbers)


def countdown_score(solution_str: str, ground_truth, format_score: float = COUNTDOWN_FORMAT_SCORE,
                    score: float = 1.0) -> float:
    """TinyZero's Countdown score: 0 without an answer, format_score for a wrong or invalid
    equation (or one not using each given number exactly once), `score` when it hits the target."""
    equation = extract_countdown_equation(solution_str)
    if equation is None:
        return 0.0
    if not _uses_numbers_exactly(equation, ground_truth["numbers"]):
        return format_score
    try:
        result = safe_eval_equation(equation)
    except ValueError:
        return format_score
    return score if abs(result - float(ground_truth["target"])) < 1e-5 else format_score


# ------------------------------------------------------------------ GSM8K (verl's scorer)

_GSM8K_CLIP_CHARS = 300  # verl matches only the tail: long strings make the regex slow


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The final answer as verl extracts it: strict `#### N` (last), or flexible last number."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', not {method!r}")
    solution_str = solution_str[-_GSM8K_CLIP_CHARS:]
    if method == "strict":
        found = re.findall(r"#### (\-?[0-9\.\,]+)", solution_str)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(re.findall(r"(\-?[0-9\.\,]+)", solution_str)):
        if candidate not in ("", "."):
            return candidate
    return None


def gsm8k_score(solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.0,
                score: float = 1.0) -> float:
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == str(ground_truth) else format_score


# ------------------------------------------------------------------ dispatch

def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """verl's custom-reward entry point for the rule rewards hpcrl knows."""
    if data_source == "countdown" or str(data_source).startswith("countdown"):
        return countdown_score(solution_str, ground_truth)
    if data_source in ("openai/gsm8k", "gsm8k"):
        return gsm8k_score(solution_str, ground_truth)
    raise NotImplementedError(f"no built-in reward for data_source {data_source!r}; "
                              f"set args.reward to module:function or /path/file.py:function")


def gsm8k_flexible(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return gsm8k_score(solution_str, ground_truth, method="flexible")


BUILTIN = {
    "auto": compute_score,
    "countdown": lambda ds, s, gt, extra_info=None: countdown_score(s, gt),
    "gsm8k": lambda ds, s, gt, extra_info=None: gsm8k_score(s, gt),
    "gsm8k_flexible": gsm8k_flexible,
}


def load_reward(spec: str):
    """A reward callable from 'auto' | 'countdown' | 'gsm8k' | 'gsm8k_flexible' |
    'package.module:function' | '/path/to/file.py[:function]' (function defaults to compute_score)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    target, _, func = spec.partition(":") if not spec.endswith(".py") else (spec, "", "")
    func = func or "compute_score"
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise ValueError(f"reward file {path} does not exist")
        mod_spec = importlib.util.spec_from_file_location(f"hpcrl_user_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn = getattr(module, func, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {target} has no function {func!r}")
    return fn
