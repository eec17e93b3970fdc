"""verl's own dump of each step's generations, read as hpcrl's sample records (hpcrl/samplestore.py),
so that `hpcrl samples RUN` shows a verl run as it shows a built-in one. Stdlib only: the launcher
reads it on a login node, and the job-side launcher (hpcrl/job/verl.py) prunes it.

The adapter sets verl's `trainer.rollout_data_dir` to RUN/verl/rollouts. verl 0.9.1 then writes,
after each training step's reward (ray_trainer.py _log_rollout_data / _write_generations, in a
background thread, the file opened "w": not atomic), one JSON line per response:

    RUN/verl/rollouts/12.jsonl
    {"input": "<the prompt, chat template applied, decoded without special tokens>",
     "output": "<the response, decoded likewise>", "gts": <reward_model.ground_truth>,
     "score": <the reward's score: token_level_scores summed>, "step": 12,
     ...the reward's extra keys (a dict-returning reward's: reason, pass_rate, ...)}

A step trained again after a resume rewrites its file, as the built-in trainer's store does. What
verl does not dump, the record leaves out: the advantage, the segment, the training row (and the
prompt's turns: verl keeps only the templated text, which becomes the one prompt turn). `group`
numbers the step's distinct prompts in order of first appearance: verl reorders a batch
(trainer.balance_batch) and the legacy trainer dumps no uid, so equal prompt text is what groups.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .. import samplestore
from ..samplestore import json_records

ROLLOUTS_DIR = "verl/rollouts"  # in the run directory
_NAME = re.compile(r"^(\d+)\.jsonl$")
_VERL_KEYS = ("input", "output", "gts", "score", "step")


def rollouts_dir(run_dir) -> Path:
    return Path(run_dir) / ROLLOUTS_DIR


def list_steps(directory) -> dict[int, int]:
    """{step: bytes} of every dumped step file."""
    return samplestore.list_steps(directory, _NAME)


def step_file(directory, step: int) -> Path:
    return Path(directory) / f"{int(step)}.jsonl"


def read_step(directory, step: int) -> list[dict]:
    """One dumped step as hpcrl's sample records ([] when it was not dumped); a line verl's
    writer had not finished is skipped."""
    try:
        data = step_file(directory, step).read_bytes()
    except OSError:
        return []
    return records(json_records(data), step)


def records(dumped: list[dict], step: int) -> list[dict]:
    """verl's dumped lines of one step -> hpcrl's sample records (the module's docstring)."""
    groups: dict[str, int] = {}
    out = []
    for i, d in enumerate(dumped):
        prompt = str(d.get("input", ""))
        extras = {k: v for k, v in d.items() if k not in _VERL_KEYS and k != "reason"}
        reason = d.get("reason")
        out.append({"step": int(d.get("step", step)), "sample": i, "group": groups.setdefault(prompt, len(groups)),
                    "turns": [{"role": "user", "content": prompt},
                              {"role": "assistant", "content": str(d.get("output", ""))}],
                    "reward": _number(d.get("score")), "reason": reason if isinstance(reason, str) and reason else None,
                    "extras": extras, "ground_truth": d.get("gts")})
    return out


def prune(directory, after: int | None) -> list[int]:
    """Delete the dumps of steps past `after` (the checkpoint a segment resumes from; None: no
    checkpoint, so every dump is of a trajectory being trained again): a lost segment trained
    past its checkpoint, and if the run ends before they are replayed they would describe a
    trajectory that no longer exists. Returns the steps deleted."""
    return _delete(directory, [step for step in list_steps(directory) if after is None or step > after])


def thin(directory, budget_bytes: int) -> list[int]:
    """Keep the dumps within `budget_bytes` by the built-in store's rule (samplestore.to_thin:
    the newest half whole, the older half every 2nd step, then every 4th...). verl writes every
    step; the launcher calls this at each segment's start and end."""
    return _delete(directory, samplestore.to_thin(list_steps(directory), budget_bytes))


def _delete(directory, steps) -> list[int]:
    """Delete these steps' dumps; the steps deleted (one already gone is not)."""
    gone = []
    for step in steps:
        try:
            os.unlink(step_file(directory, step))
            gone.append(step)
        except OSError:
            pass
    return gone


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0
