"""The code-optimisation reward (issue 42): a correct program scores by its speed against the row's
reference solution; a wrong or too-slow one scores 0. Stdlib only, beside sandbox.py.

    reward: "hpcrl.rewards.speed:compute_score"      (or its batch form, compute_score_batch)

A row's ground_truth: {"tests": [...], "reference": CODE, "bench": STATEMENT, "repeats": 5,
"noise": 0.25, "max_speedup": 4.0, "min_speedup": 0.5}. The tests decide correctness first
(the code reward's sandbox, all must pass). Then the sandbox runs, `repeats` rounds interleaved,
an empty program (and statement), the reference and the answer, each as a module followed by the
bench statement in a fresh process, and its pid 1 reads each run's CPU seconds (wait4: user + system, the kernel's
accounting, not the program's clock; a process may start no other process or thread, so none of
its work is off the books). speedup = (median reference - median empty) / (median answer -
median empty): the interpreter's and the sandbox's fixed cost is taken out of both. The score is
min(speedup, max_speedup) / max_speedup (the reference itself scores 1/max_speedup), 0 below
min_speedup (too slow).

The noise bound is stated before measuring (the row's `noise`, default 0.25): the spread of the
answer's repeats, the median absolute deviation over the median of its CPU seconds above the empty
program's, is reported as `spread`, and a sample over its bound is marked `noisy` (its score stands; the share of noisy
samples says whether the bench is long enough for this machine).

How it can be gamed, and what stops it:
- caching across calls (a dict kept between calls of the function): the bench is one statement run
  once per process, so a cache helps only within one run, as it would in real use; write the bench
  so that it calls with distinct inputs if a cache should not count;
- precomputed tables (the answers in the source, or computed at import): import time is inside the
  figure (the module is run in the timed process), so computing at import gains nothing; a table
  written into the source for the bench's inputs does, as would any hard-coding (the held-out
  inputs of the bench are the row's to choose: keep them out of the prompt);
- the harness's clock: the program never reports a time; it cannot reach its parent (another
  uid, its own session) and wait4 counts all of its threads; it cannot start another process to
  work off the books (RLIMIT_NPROC 1).
"""

from __future__ import annotations

import json
import statistics

try:
    from . import score as _score
except ImportError:  # loaded by path (verl): score.py beside this file
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _name = "hpcrl_speed_score"
    if _name not in _sys.modules:
        _here = _os.path.dirname(_os.path.abspath(__file__))
        _file = next(f for f in ("score.py", "rewards.py") if _os.path.isfile(_os.path.join(_here, f)))
        _spec = _util.spec_from_file_location(_name, _os.path.join(_here, _file))  # RUN/verl ships it as rewards.py
        _mod = _util.module_from_spec(_spec)
        _sys.modules[_name] = _mod
        _spec.loader.exec_module(_mod)
    _score = _sys.modules[_name]

def _settings(gt: dict) -> dict:
    return {"repeats": int(gt.get("repeats", 5)), "noise": float(gt.get("noise", 0.25)),
            "max_speedup": float(gt.get("max_speedup", 4.0)), "min_speedup": float(gt.get("min_speedup", 0.5))}


def speed_score(solution_str: str, ground_truth, limits=None) -> dict:
    """{score, speedup, spread, noisy, reason, pass_rate}: never raises for a sample or a row."""
    sandbox = _score._sandbox()
    try:
        gt = json.loads(ground_truth) if isinstance(ground_truth, str) else dict(ground_truth)
        reference, bench = gt["reference"], gt["bench"]
        if not isinstance(reference, str) or not isinstance(bench, str):
            raise ValueError("reference and bench must be text")
        opts = _settings(gt)
    except (ValueError, KeyError, TypeError) as e:
        return {**_zero("bad_tests"), "detail": f"speed reward: ground_truth needs tests, reference, bench: {e}"[:200]}
    correct = _score.code_score(solution_str, gt, 0.0, limits)
    if correct["all_passed"] != 1.0:
        return {**_zero(correct["reason"] if correct["reason"] != "ok" else "wrong_answer"),
                "pass_rate": correct["pass_rate"]}
    code, _, _ = _score._code_job(solution_str, gt)
    got = sandbox.cpu_times({"empty": ("pass", "pass"), "reference": (reference, bench), "answer": (code, bench)},
                            opts["repeats"], limits or sandbox.Limits())
    if isinstance(got, str):
        return {**_zero(got), "pass_rate": 1.0}
    times, errors = got
    if errors:
        why = errors.get("answer") or "reference_failed"
        return {**_zero(why if "answer" in errors else "reference_failed"), "pass_rate": 1.0}
    return _judge(times, opts)


def _judge(times: dict, opts: dict) -> dict:
    empty = statistics.median(times["empty"])
    ref = statistics.median(times["reference"]) - empty
    answer = [t - empty for t in times["answer"]]
    mid = statistics.median(answer)
    if ref <= 0:
        return {**_zero("reference_too_short"), "pass_rate": 1.0}
    speedup = ref / max(mid, 1e-6)
    # the median absolute deviation over the median: one repeat that a burst of load slowed moves
    # it little, where (max - min) / median took that burst whole (0.03 quiet, 0.3-0.55 beside a hog)
    spread = statistics.median(abs(t - mid) for t in answer) / max(mid, 1e-6)
    noisy = float(spread > opts["noise"])
    if speedup < opts["min_speedup"]:
        return {**_zero("too_slow"), "pass_rate": 1.0, "speedup": round(speedup, 4), "spread": round(spread, 4),
                "noisy": noisy}
    return {"score": round(min(speedup, opts["max_speedup"]) / opts["max_speedup"], 6), "pass_rate": 1.0,
            "speedup": round(speedup, 4), "spread": round(spread, 4), "noisy": noisy, "reason": "ok"}


def _zero(reason: str) -> dict:
    return {"score": 0.0, "pass_rate": 0.0, "speedup": 0.0, "spread": 0.0, "noisy": 0.0, "reason": reason}


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """verl's custom-reward signature (and the built-in trainer's `module:function` reward)."""
    return speed_score(solution_str, ground_truth)


def compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos=None) -> list:
    return [speed_score(s, g) for s, g in zip(solution_strs, ground_truths)]
