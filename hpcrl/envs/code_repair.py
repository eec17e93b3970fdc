"""code-repair: the model writes code, the visible tests run in the sandbox, their failures go back
as the next turn, up to args.env_max_turns turns; the reward runs held-out tests it never saw.

A row is a code row (hpcrl/rl/data.py code_row): ground_truth {"tests": [...], "prefix": ...},
optionally "visible_tests": [...]. With visible_tests, `tests` are all held out; without, the first
half of `tests` (at least one) is visible and the rest held out, so a row needs two tests or more.
Feedback names the visible tests that failed and the sandbox's first failure message; the held-out
tests never appear in it, so nothing the environment says can be copied into a passing answer.

An episode ends when its code passes every visible test or at its last turn; its reward is
args.reward on the last answer with the held-out tests as ground truth (`code` or `auto`: the
share of them that pass) and the row's extra_info plus `turns` and `messages` (verl's
compute_score(data_source, solution_str, ground_truth, extra_info)); its one term is `heldout`.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from ..rewards.mix import combine
from .base import Environment, Turn

FEEDBACK_TESTS = 4        # failing visible tests quoted in one message, at most
FEEDBACK_CHARS = 600      # the sandbox's detail quoted, at most


def split_tests(ground_truth) -> tuple[list, list, str]:
    """(visible, held_out, prefix) of a code row's ground truth; ValueError names what is wrong."""
    gt = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if not isinstance(gt, dict) or not isinstance(gt.get("tests"), list):
        raise ValueError("env code-repair: ground_truth must be {'tests': [...]} (optionally 'visible_tests', 'prefix')")
    tests = list(gt["tests"])
    if isinstance(gt.get("visible_tests"), list):
        visible, held = list(gt["visible_tests"]), tests
    else:
        k = max(1, len(tests) // 2)
        visible, held = tests[:k], tests[k:]
    if not visible or not held:
        raise ValueError(f"env code-repair: a row needs visible and held-out tests; it has {len(tests)} test(s) "
                         "and no 'visible_tests' (give two tests or more, or 'visible_tests')")
    return visible, held, gt.get("prefix") or ""


def feedback(result, visible: list) -> str:
    """The next user message after a failing answer: which visible tests failed, and why."""
    if result.reason in ("syntax_error", "no_code"):
        head = "Your answer has no program that parses" + (f": {result.detail}" if result.detail else ".")
    else:
        failed = [t for t, ok in zip(visible, result.per_test or [False] * len(visible)) if not ok]
        quoted = "\n".join(_show(t) for t in failed[:FEEDBACK_TESTS])
        head = f"Your code failed {result.total - result.passed} of {result.total} tests ({result.reason}):\n{quoted}"
        if result.detail:
            head += f"\n{result.detail[:FEEDBACK_CHARS]}"
    return head + "\nFix the code and answer with the whole corrected program."


def _show(test) -> str:
    if isinstance(test, dict):
        return f"input {test.get('input')!r} should print {test.get('output')!r}"
    return str(test)


class CodeRepair(Environment):
    name = "code-repair"
    multi_turn = True

    def check(self, rows: list) -> None:
        for r in rows:
            split_tests(r["ground_truth"])

    def reset(self, rows: list, group_size: int) -> list:
        first = super().reset(rows, group_size)
        self.split = [split_tests(r["ground_truth"]) for r in self.rows]
        self.history = [[] for _ in self.rows]
        self.metrics, self._parts = {}, []
        return first

    def step(self, responses: list, final: list) -> list:
        live = [i for i, r in enumerate(responses) if r is not None]
        for i in live:
            self.history[i].append({"role": "assistant", "content": responses[i]})
        checks = {i: r for i, r in zip([i for i in live if not final[i]],
                                       self._visible([i for i in live if not final[i]], responses))}
        out = [Turn(None) for _ in responses]
        done = [i for i in live if final[i] or checks[i].passed == checks[i].total]
        for i in live:
            if i not in done:
                msg = {"role": "user", "content": feedback(checks[i], self.split[i][0])}
                self.history[i].append(msg)
                out[i] = Turn([msg], info={"reason": checks[i].reason})
        if done:
            values, metrics, details = self.score([self._held_row(i) for i in done], [responses[i] for i in done],
                                                  whole_batch=False)
            self._parts.append((metrics, len(done)))
            self.metrics = combine(self._parts)  # the step's figures over every call of it
            for i, v, d in zip(done, values, details):
                out[i] = Turn(None, {"heldout": v}, d)
        return out

    def _visible(self, idx: list, responses: list) -> list:
        """The sandbox's results of the visible tests, a batch at a time (its public run_tests)."""
        from ..rewards import cpus, extract, sandbox

        cfg = self.cfg
        limits = sandbox.cpu_limits(cfg["code_timeout_s"], cfg["code_memory_mb"])

        def run(i):
            visible, _, prefix = self.split[i]
            code, _ = extract.extract(responses[i], prefix)
            return sandbox.run_tests(prefix + code, visible, limits)

        if not idx:
            return []
        workers = cfg["code_workers"] or cpus.workers_per_rank()
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(idx)))) as pool:
            return list(pool.map(run, idx))

    def _held_row(self, i: int) -> dict:
        """Row i as the reward sees it: the held-out tests its ground truth, the conversation in extra_info."""
        row = self.rows[i]
        _, held, prefix = self.split[i]
        gt = {"tests": held, **({"prefix": prefix} if prefix else {})}
        extra = {**(row.get("extra_info") or {}), "turns": sum(m["role"] == "assistant" for m in self.history[i]),
                 "messages": list(self.history[i])}
        return {**row, "ground_truth": json.dumps(gt), "extra_info": extra}

