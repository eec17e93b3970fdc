"""Rule rewards with verl's custom-reward signature, plus loading a user's reward function.

The reward interface (docs/adapt.md), the same for the built-in trainer and verl:

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

A dict has "score" (the reward) and any other keys: numbers are averaged per step into
metrics.jsonl as reward/<key>, strings (e.g. "reason") counted as reward/<key>/<value> shares.
A function whose parameters are the plural names (data_sources, solution_strs, ground_truths,
extra_infos) is a batch reward: called once per step with lists, it returns a list (verl's
`reward_model.reward_manager=batch` calls the same signature). verl reaches it as

    reward.custom_reward_function.path=<site-packages>/hpcrl/rewards/score.py
    reward.custom_reward_function.name=compute_score        (or compute_score_batch)

This module is stdlib only on purpose: verl imports it inside its reward workers.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
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


# ------------------------------------------------------------------ code (sandboxed tests)

CODE_FORMAT_SCORE = 0.0  # share of the score for a fenced ```python block (0: tests only)
SANDBOX_FILE = "sandbox.py"  # beside this file: in hpcrl/rewards, and in RUN/verl where verl loads both by path


def _sandbox():
    """hpcrl.rewards.sandbox, or, where verl loaded this file by path (import_utils.load_module: a
    module with no package, so `from . import sandbox` fails), the sandbox.py shipped beside it."""
    if __package__:
        from . import sandbox

        return sandbox
    import sys

    name = "hpcrl_verl_sandbox"  # registered: the sandbox's dataclasses look their module up by name
    if name not in sys.modules:
        path = Path(__file__).resolve().with_name(SANDBOX_FILE)
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or not path.is_file():
            raise ImportError(f"code reward: {path} is missing (it ships beside rewards.py)")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def _code_job(solution_str: str, ground_truth):
    """(program, tests, shape) of one sample: the extracted code after the row's optional `prefix`,
    and the shape of the answer it came from (extract.py)."""
    sandbox = _sandbox()
    if isinstance(ground_truth, str):
        ground_truth = json.loads(ground_truth)
    if not isinstance(ground_truth, dict) or not isinstance(ground_truth.get("tests"), list):
        raise ValueError("code reward: ground_truth must be {'tests': [...]} (assert strings or "
                         "{'input', 'output'} pairs), optionally with 'prefix'")
    prefix = ground_truth.get("prefix") or ""
    code, shape = sandbox.extract(solution_str, prefix)
    return prefix + code, list(ground_truth["tests"]), shape


def _code_result(res, shape: str, format_score: float) -> dict:
    fmt = format_score if format_score and shape == "fenced" else 0.0
    # judged_inside: share of the row's tests whose verdict came from the program's process (not
    # split into holes judged here, docs/adapt.md): 0 means every decision was made in this process
    return {"score": round(fmt + (1.0 - format_score) * res.score, 6), "pass_rate": res.score,
            "all_passed": float(res.passed == res.total), "reason": res.reason,
            "judged_inside": res.inside / res.total if res.total else 0.0,
            # where the program was found (extract.py): beside a syntax_error it says which shape failed
            "extract": shape}


# the spec's default code_timeout_s: CPU seconds (sandbox.cpu_limits), also through verl's loader
CODE_TIMEOUT_S = 5.0


def _unscored(reason: str, e: BaseException) -> dict:
    return {"score": 0.0, "pass_rate": 0.0, "all_passed": 0.0, "reason": reason, "judged_inside": 0.0,
            "detail": f"{type(e).__name__}: {e}"[:200]}


def code_score(solution_str: str, ground_truth, format_score: float = CODE_FORMAT_SCORE, limits=None) -> dict:
    """Run the answer's code against ground_truth['tests'] in the sandbox (hpcrl/rewards/sandbox.py).
    Never raises for a sample or a row: a malformed row scores 0 with reason `bad_tests`, any
    other error 0 with `crash` (the trainer's step goes on; metrics count the reasons)."""
    sandbox = _sandbox()
    try:
        code, tests, shape = _code_job(solution_str, ground_truth)
        res = sandbox.run_tests(code, tests, limits or sandbox.cpu_limits(CODE_TIMEOUT_S))
    except ValueError as e:  # json.loads, _code_job, a test that is neither an assert nor a pair
        return _unscored("bad_tests", e)
    except Exception as e:
        return _unscored("crash", e)
    return _code_result(res, shape, format_score)


def code_score_batch(solution_strs, ground_truths, format_score: float = CODE_FORMAT_SCORE, limits=None,
                     workers: int = 0, dedupe: bool = True) -> list:
    """code_score over a batch, run by the sandbox's bounded pool; a row or sample that cannot
    be scored scores 0 with its reason and never costs a sibling its score."""
    sandbox = _sandbox()
    out, jobs, where, shapes = [None] * len(solution_strs), [], [], []
    for i, (s, gt) in enumerate(zip(solution_strs, ground_truths)):
        try:
            code, tests, shape = _code_job(s, gt)
            jobs.append((code, tests))
            where.append(i)
            shapes.append(shape)
        except ValueError as e:
            out[i] = _unscored("bad_tests", e)
        except Exception as e:
            out[i] = _unscored("crash", e)
    results = sandbox.run_batch(jobs, limits or sandbox.cpu_limits(CODE_TIMEOUT_S), workers, dedupe) if jobs else []
    for i, r, shape in zip(where, results, shapes):
        out[i] = _code_result(r, shape, format_score)
    return out


# ------------------------------------------------------------------ dispatch

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's custom-reward entry point for the rule rewards hpcrl knows (a dict for code)."""
    if data_source == "countdown" or str(data_source).startswith("countdown"):
        return countdown_score(solution_str, ground_truth)
    if data_source in ("openai/gsm8k", "gsm8k"):
        return gsm8k_score(solution_str, ground_truth)
    if data_source == "code" or str(data_source).startswith("code"):
        return code_score(solution_str, ground_truth)
    if data_source == "arithmetic":  # hpcrl's generated sums: the last number of the response
        return gsm8k_score(solution_str, ground_truth, method="flexible")
    raise NotImplementedError(f"no built-in reward for data_source {data_source!r}; "
                              f"set args.reward to module:function or /path/file.py:function")


def compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos=None) -> list:
    """The batch form of compute_score: code rows go to the sandbox's pool together."""
    extra_infos = extra_infos or [None] * len(solution_strs)
    out = [None] * len(solution_strs)
    code = [i for i, ds in enumerate(data_sources) if str(ds).startswith("code")]
    for i, res in zip(code, code_score_batch([solution_strs[i] for i in code], [ground_truths[i] for i in code])):
        out[i] = res
    for i, ds in enumerate(data_sources):
        if out[i] is None:
            out[i] = compute_score(ds, solution_strs[i], ground_truths[i], extra_infos[i])
    return out


def is_batch_reward(fn) -> bool:
    """True for a function taking verl's batch parameter names (solution_strs, ...)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "solution_strs" in params


def gsm8k_flexible(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return gsm8k_score(solution_str, ground_truth, method="flexible")


BUILTIN = {
    "auto": compute_score_batch,
    "code": lambda data_sources, solution_strs, ground_truths, extra_infos=None: code_score_batch(
        solution_strs, ground_truths),
    "countdown": lambda ds, s, gt, extra_info=None: countdown_score(s, gt),
    "gsm8k": lambda ds, s, gt, extra_info=None: gsm8k_score(s, gt),
    "gsm8k_flexible": gsm8k_flexible,
}


def import_target(target: str, kind: str):
    """The module a user names: `/path/file.py` (loaded by path, as hpcrl_user_<kind>_<stem>) or
    `package.module`; FileNotFoundError for a file that is not there, ImportError as import says.
    Rewards and environments (hpcrl.envs) are named alike."""
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise FileNotFoundError(2, "no such file", str(path))
        mod_spec = importlib.util.spec_from_file_location(f"hpcrl_user_{kind}_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        return module
    return importlib.import_module(target)


def load_reward(spec: str):
    """A reward callable from 'auto' | 'countdown' | 'gsm8k' | 'gsm8k_flexible' | 'code' |
    'package.module:function' | '/path/to/file.py[:function]' (function defaults to compute_score)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    target, _, func = spec.partition(":") if not spec.endswith(".py") else (spec, "", "")
    func = func or "compute_score"
    try:
        module = import_target(target, "reward")
    except FileNotFoundError as e:
        raise ValueError(f"reward file {e.filename} does not exist") from None
    fn = getattr(module, func, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {target} has no function {func!r}")
    return fn
