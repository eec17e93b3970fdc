"""`hpcrl samples RUN`: what the model generated, how each answer scored and why, from the
samples the built-in trainer keeps (RUN/samples, hpcrl/samplestore.py) or verl's own dump of
each step (RUN/verl/rollouts, read as the same records by hpcrl/job/verl_rollouts.py). Stdlib
only: the same lines drawn plain (piped) or with rich (terminal.samples); pandas and pyarrow load only for
`--format parquet`."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from collections import Counter
from pathlib import Path

from .. import samplestore
from ..errors import HpcrlError
from ..job import verl_rollouts

SHOW = 8  # samples shown when --limit is not given (an export takes all of them)
PROMPT_LINES = 4  # lines of each prompt turn shown: the response is what one reads samples for


def source(run, directory=None):
    """(list_steps, read_step, directory) of the run's samples: an `hpcrl eval`'s `directory`,
    verl's dumps for a verl run, else the built-in trainer's store."""
    if directory is None and run.state().get("trainer") == "verl":
        return verl_rollouts.list_steps, verl_rollouts.read_step, verl_rollouts.rollouts_dir(run.dir)
    return samplestore.list_steps, samplestore.read_step, directory or run.layout.samples


def kept_steps(run, directory=None) -> dict[int, int]:
    """{step: bytes} of the run's kept steps (or of an `hpcrl eval`'s samples `directory`); a
    one-line error when there are none."""
    list_steps, _, where = source(run, directory)
    steps = list_steps(where)
    if steps:
        return steps
    if directory is not None:
        raise HpcrlError(f"no samples in {directory}: not an `hpcrl eval` output (see `ls {run.dir}/evals`)")
    trainer = run.state().get("trainer", "?")
    if trainer == "verl":
        raise HpcrlError(f"no samples recorded yet: run '{run.id}' has no step of verl's in {where} (verl writes "
                         "each step's generations there after its reward; a run submitted before hpcrl set "
                         "trainer.rollout_data_dir has none)")
    if trainer != "builtin":
        raise HpcrlError(f"no samples recorded yet: run '{run.id}' uses the {trainer} trainer; only the built-in "
                         "and verl trainers keep samples")
    raise HpcrlError(f"no samples recorded yet: run '{run.id}' has none in {run.layout.samples} (the built-in "
                     "trainer writes them after each RL step, every args.samples_every steps; 0 turns them off)")


def ranges(steps) -> str:
    """1-40, 44, 48: a list of steps, runs of consecutive ones as ranges."""
    out, steps = [], sorted(steps)
    i = 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        out.append(str(steps[i]) if i == j else f"{steps[i]}-{steps[j]}")
        i = j + 1
    return ", ".join(out)


def choose(run, step: int | None = None, order: str | None = None, reason: str | None = None,
           limit: int | None = None, everything: bool = False, directory=None) -> tuple[list[dict], str]:
    """(samples, a line saying what they are). Without --step: the newest step, or every kept
    step when sorting or filtering (--worst, --best, --reason) or exporting (`everything`).
    `directory`: an `hpcrl eval`'s samples instead of the run's (eval_samples_dir)."""
    steps = kept_steps(run, directory)
    evaluation = directory is not None
    _, read_step, directory = source(run, directory)
    if step is not None:
        if step not in steps:
            raise HpcrlError(f"step {step} has no samples kept in run '{run.id}'; kept steps: {_short(steps)}")
        picked = [step]
    elif order or reason or everything:
        picked = list(steps)
    else:
        picked = [max(steps)]
    chosen = [s for k in picked for s in read_step(directory, k)]
    where = f"step {picked[0]}" if len(picked) == 1 else f"{len(picked)} steps"
    if reason is not None:
        have = Counter(str(s.get("reason")) for s in chosen)
        chosen = [s for s in chosen if str(s.get("reason")) == reason]
        if not chosen:
            raise HpcrlError(f"no sample of run '{run.id}' ({where}) has the reason {reason!r}; reasons there: "
                             + (", ".join(f"{r} {n}" for r, n in have.most_common(8)) or "none"))
    total = len(chosen)
    if order in ("worst", "best"):
        chosen.sort(key=lambda s: (s.get("reward", 0.0), -s.get("step", 0)), reverse=order == "best")
    if limit is None and not everything:
        limit = SHOW
    if limit is not None and limit > 0:
        chosen = chosen[:limit]
    rewards = [s.get("reward", 0.0) for s in chosen]
    label = f"run {run.id} eval {Path(directory).parent.name}" if evaluation else f"run {run.id}"
    head = (f"{label}, {where} (kept: {_short(steps)}): {len(chosen)} of {total} samples"
            + (f", {order} first" if order else "") + (f", reason {reason}" if reason else "")
            + (f"; reward mean {sum(rewards) / len(rewards):.3f}" if rewards else ""))
    return chosen, head


def eval_samples_dir(run, name: str) -> Path:
    """`--eval NAME|DIR`: the samples of an `hpcrl eval` (RUN/evals/NAME, or its --out DIR)."""
    path = Path(name) if os.sep in name or name.startswith(".") else run.dir / "evals" / name
    if not path.is_dir():
        have = sorted(p.name for p in (run.dir / "evals").glob("*") if p.is_dir())
        raise HpcrlError(f"--eval {name}: no such evaluation of run '{run.id}'; its evaluations: "
                         f"{', '.join(have) or 'none (hpcrl eval RUN makes one)'}")
    return path / samplestore.SAMPLES_DIR


def _short(steps) -> str:
    text = ranges(steps)
    return text if len(text) <= 40 else text[:39] + "\u2026"


# ---------------------------------------------------------------- the lines


def _num(v) -> str:
    return f"{v:+.3f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def lines(samples: list[dict], width: int = 80) -> list[tuple[str, str]]:
    """(text, kind) per line, none longer than `width`: kind is head, score, role, prompt,
    response or cut (what terminal.samples styles)."""
    width = max(40, width)
    out: list[tuple[str, str]] = []
    for s in samples:
        # an evaluation's samples have no segment or advantage, and say how they were decoded
        title = "  ".join([f"-- step {s.get('step')}", f"sample {s.get('sample')}", f"group {s.get('group')}",
                           *(f"{k} {s[k]}" for k in ("segment", "decoding") if k in s)]) + " "
        out.append((title[:width].ljust(width, "-"), "head"))
        parts = [f"reward {s.get('reward', 0.0):.3f}"]
        if "advantage" in s:
            parts.append(f"advantage {_num(s.get('advantage'))}")
        if s.get("reason"):
            parts.append(f"reason {s['reason']}")
        terms = s.get("terms") or {}
        if len(terms) > 1:
            parts += [f"{k} {v:.3f}" for k, v in terms.items()]
        parts += [f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                  for k, v in (s.get("extras") or {}).items()]
        out += [(ln, "score") for ln in _wrap("  ".join(parts), width)]
        turns = s.get("turns") or []
        for i, turn in enumerate(turns):
            last = i == len(turns) - 1
            out.append((f"{turn.get('role', '?')}:", "role"))
            body = _wrap(str(turn.get("content", "")), width, indent=2)
            if not last and len(body) > PROMPT_LINES:
                cut = len(body) - PROMPT_LINES
                body = body[:PROMPT_LINES] + [f"  ... {cut} more line{'s' if cut > 1 else ''}"]
            out += [(ln, "response" if last else "prompt") for ln in body]
    return out


def _wrap(text: str, width: int, indent: int = 0) -> list[str]:
    pad = " " * indent
    out = []
    for line in text.splitlines() or [""]:
        line = line.expandtabs(4)
        # a wrapped line's rest goes under its own indentation, two further in (code stays legible)
        lead = min(len(line) - len(line.lstrip(" ")), width // 2)
        out += textwrap.wrap(line, width=width, initial_indent=pad, subsequent_indent=pad + " " * (lead + 2),
                             break_on_hyphens=False, drop_whitespace=True) or [pad.rstrip()]
    return out


def text(samples: list[dict], head: str, width: int = 80) -> str:
    """The plain text (piped): the head line, then each sample's lines."""
    return "\n".join([*_wrap(head, width), *(ln for ln, _ in lines(samples, width))])


# ---------------------------------------------------------------- export


FORMATS = ("jsonl", "parquet")


def flat(sample: dict) -> dict:
    """One table row: the prompt's turns and the response as text, nested values as JSON text
    (a parquet column holds one type; ground truths differ from row to row)."""
    turns = sample.get("turns") or []
    return {"step": sample.get("step"), "segment": sample.get("segment"), "sample": sample.get("sample"),
            "group": sample.get("group"), "row": sample.get("row"), "reward": sample.get("reward"),
            "advantage": sample.get("advantage"), "reason": sample.get("reason"),
            "prompt": "\n".join(str(t.get("content", "")) for t in turns[:-1]),
            "response": str(turns[-1].get("content", "")) if turns else "",
            "turns": json.dumps(turns, ensure_ascii=False), "terms": json.dumps(sample.get("terms") or {}),
            "extras": json.dumps(sample.get("extras") or {}, default=str), "data_source": sample.get("data_source"),
            "ground_truth": json.dumps(sample.get("ground_truth"), default=str)}


def export(samples: list[dict], fmt: str, out) -> None:
    """jsonl: the records as kept (to a path or a stream); parquet: one flat row each (a path)."""
    if fmt not in FORMATS:
        raise HpcrlError(f"--format {fmt}: use one of {', '.join(FORMATS)}")
    if fmt == "jsonl":
        data = "".join(json.dumps(s, ensure_ascii=False, default=str) + "\n" for s in samples)
        if isinstance(out, (str, Path)):
            Path(out).write_text(data, encoding="utf-8")
        else:
            out.write(data)
        return
    if not isinstance(out, (str, Path)):
        raise HpcrlError("--format parquet is binary: give --out FILE.parquet")
    try:
        import pandas as pd
        import pyarrow  # noqa: F401
    except ImportError as e:
        raise HpcrlError(f"`hpcrl samples --format parquet` needs pandas and pyarrow: pip install 'hpcrl[rl]' "
                         f"({e.name} is missing), or use --format jsonl") from None
    pd.DataFrame([flat(s) for s in samples]).to_parquet(out, index=False)


def print_text(samples: list[dict], head: str, width: int = 80, out=None) -> None:
    (out or sys.stdout).write(text(samples, head, width) + "\n")
