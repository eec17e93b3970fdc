"""What `status` and `logs` show. Reads run directories; never imports the ML stack or YAML."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

from . import atomicio, ckptstore, protocol, runs
from .errors import HpcrlError
from .runs import Run

STATE_COLOURS = {"RUNNING": "32", "CHECKPOINTING": "36", "RESUBMITTED": "36", "PENDING": "33",
                 "COMPLETED": "1;32", "FAILED": "1;31", "CANCELLED": "35", "STOPPED": "33"}


def _ckpt_info(run: Run, trainer: str) -> tuple[int | None, float | None]:
    from .trainers import get_trainer  # launcher-side adapters only: no torch

    ckpt_dir = run.dir / "checkpoints"
    step = get_trainer(trainer).checkpoint_step(run.dir, ckpt_dir)
    if step is None:
        return None, None
    path = ckpt_dir / ckptstore.checkpoint_name(step)
    try:
        return step, (path if path.exists() else ckpt_dir).stat().st_mtime
    except OSError:
        return step, None


def _display_state(run: Run, state: dict) -> str:
    if state["state"] == runs.RUNNING and (run.dir / ".checkpointing").exists():
        return runs.CHECKPOINTING
    return state["state"]


def planned_segments(state: dict) -> int:
    b = state["budget"]
    if b.get("total_hours") and b.get("hours"):
        return min(b["max_segments"], max(1, math.ceil(b["total_hours"] / b["hours"] - 1e-9)))
    return b["max_segments"]


def summary(run: Run, state: dict | None = None) -> dict:
    """One run as a flat dict (the --json row and the table row)."""
    state = state or run.state()
    ckpt_step, ckpt_time = _ckpt_info(run, state.get("trainer", "smoke"))
    metrics = protocol.read_last_metrics(run.dir / protocol.METRICS_FILE)
    live = [s for s in state["segments"] if s["state"] in (runs.SEG_RUNNING, runs.SEG_QUEUED)]
    started = [s for s in state["segments"] if s.get("started")]
    metric_name, metric = _headline_metric(metrics)
    return {
        "id": run.id, "site": state["site"], "state": _display_state(run, state), "reason": state.get("reason", ""),
        "segments": len(started), "segments_planned": planned_segments(state),
        "job_id": (live[0]["job_id"] if live else (started[-1]["job_id"] if started else None)),
        "step": (metrics or {}).get("step"), "checkpoint_step": ckpt_step,
        "checkpoint_age_s": round(time.time() - ckpt_time, 1) if ckpt_time else None, "checkpoint_time": ckpt_time,
        "used_hours": round(runs.used_hours(state, time.time()), 4), "total_hours": state["budget"].get("total_hours"),
        "metric_name": metric_name, "metric": metric, "run_dir": str(run.dir), "created": state.get("created"),
    }


def _cache_path() -> Path:
    from .paths import hpcrl_home

    return hpcrl_home() / "status-cache.json"


def _load_cache() -> dict:
    import json

    try:
        return json.loads(_cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def status_rows(ids: list[str], refresh) -> list[tuple]:
    """(run, state, row) for each run id; runs that are gone are skipped.

    A run in a final state changes only when resumed (which rewrites state.json), so its row is
    cached in $HPCRL_HOME/status-cache.json keyed by state.json's mtime: with 1,000 finished runs
    `status` costs one stat each. Active runs are read fresh and reconciled with their scheduler
    through `refresh`.
    """
    cache, fresh, out = _load_cache(), {}, []
    for run_id in ids:
        hit = cache.get(run_id)
        if hit:
            try:
                if os.stat(hit["row"]["run_dir"] + "/state.json").st_mtime_ns == hit["mtime_ns"]:
                    fresh[run_id] = hit
                    out.append((None, None, _aged(hit["row"])))
                    continue
            except OSError:
                pass
        try:
            run = Run.by_id(run_id)
            state = refresh(run) if run.state()["state"] in runs.ACTIVE_STATES else run.state()
        except HpcrlError:
            continue  # a run whose directory was deleted
        row = summary(run, state)
        if state["state"] in runs.FINAL_STATES:
            fresh[run_id] = {"mtime_ns": os.stat(run.dir / "state.json").st_mtime_ns, "row": row}
        out.append((run, state, row))
    if fresh != cache:
        try:
            atomicio.atomic_write_json(_cache_path(), fresh)
        except OSError:
            pass  # a read-only home still gets a (slower) status
    return out


def _aged(row: dict) -> dict:
    if row.get("checkpoint_time"):
        row["checkpoint_age_s"] = round(time.time() - row["checkpoint_time"], 1)
    return row


def _headline_metric(rec: dict | None) -> tuple[str | None, float | None]:
    for key in ("reward_mean", "eval/reward_mean", "reward", "loss"):
        if rec and isinstance(rec.get(key), (int, float)):
            return key, rec[key]
    return None, None


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def table_row(row: dict) -> list[str]:
    ckpt = "-" if row["checkpoint_step"] is None else f"{row['checkpoint_step']} ({_age(row['checkpoint_age_s'])} ago)"
    budget = f"{row['used_hours']:.2f}/{row['total_hours']:g}h" if row["total_hours"] else f"{row['used_hours']:.2f}h"
    metric = "-" if row["metric"] is None else f"{row['metric_name']}={row['metric']:.4g}"
    return [row["id"], row["site"], row["state"], f"{row['segments']}/{row['segments_planned']}", row["job_id"] or "-",
            "-" if row["step"] is None else str(row["step"]), ckpt, budget, metric]


HEADERS = ["RUN", "SITE", "STATE", "SEG", "JOB", "STEP", "CHECKPOINT", "USED", "LAST METRIC"]


def format_table(rows: list[list[str]], colour: bool) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(HEADERS)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEADERS, widths)).rstrip()]
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r, widths)]
        if colour and r[2] in STATE_COLOURS:
            cells[2] = f"\033[{STATE_COLOURS[r[2]]}m{cells[2]}\033[0m"
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def detail(run: Run, state: dict, row: dict) -> str:
    """`status RUN`: the summary, the segment history and every path."""
    out = [format_table([table_row(row)], colour=sys.stdout.isatty())]
    if row["reason"]:
        out.append(f"reason: {row['reason']}")
    out.append("\nsegments:")
    out.append("  K    JOB          STATE      START              END                STEPS         RC")
    for s in state["segments"]:
        steps = f"{_s(s.get('start_step'))} -> {_s(s.get('end_step'))}" if s.get("started") else "-"
        out.append(f"  {_s(s.get('k')):<4} {s.get('job_id') or '-':<12} {s['state']:<10} {_t(s.get('started')):<18} "
                   f"{_t(s.get('ended')):<18} {steps:<13} {_s(s.get('rc'))}")
    d = run.dir
    out.append("\npaths:")
    for name, p in (("run dir", d), ("script", d / "job.sh"), ("spec", d / "spec.json"), ("logs", d / "logs"),
                    ("checkpoints", d / "checkpoints"), ("metrics", d / protocol.METRICS_FILE), ("state", d / "state.json")):
        out.append(f"  {name:<12} {p}")
    return "\n".join(out)


def _s(v) -> str:
    return "-" if v is None else str(v)


def _t(ts) -> str:
    return time.strftime("%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


# ---------------------------------------------------------------- logs


def log_path(run: Run, seg: dict) -> Path:
    return run.dir / "logs" / f"job-{seg.get('job_id')}.log"


def _started_segments(state: dict) -> list[dict]:
    return [s for s in state["segments"] if s.get("started") or s["state"] == runs.SEG_RUNNING]


def pick_segment(state: dict, k: int | None) -> int:
    """Index into the started segments: K (1-based), else the newest."""
    started = _started_segments(state)
    if k is None:
        return max(0, len(started) - 1)
    if not 1 <= k <= max(1, len(started)):
        from .errors import RunError

        raise RunError(f"--segment {k}: the run has {len(started)} started segment(s); use 1..{max(1, len(started))}")
    return k - 1


def follow(run: Run, start_index: int, out, follow_on: bool, poll_s: float = 0.5) -> None:
    """Print the log of segment `start_index` and, with follow_on, every later one as it starts,
    until the run reaches a final state and its last log is drained."""
    index, pos = start_index, 0
    while True:
        state = run.state()
        started = _started_segments(state)
        if index < len(started):
            pos = _drain(log_path(run, started[index]), pos, out)
            if not follow_on:
                return
            seg_done = started[index]["state"] not in (runs.SEG_RUNNING,)
            if seg_done and index + 1 < len(started):
                pos = _drain(log_path(run, started[index]), pos, out)
                index, pos = index + 1, 0
                continue
            if seg_done and state["state"] in runs.FINAL_STATES:
                _drain(log_path(run, started[index]), pos, out)
                return
        elif not follow_on or state["state"] in runs.FINAL_STATES:
            return
        time.sleep(poll_s)


def _drain(path: Path, pos: int, out) -> int:
    try:
        with open(path, "rb") as f:
            f.seek(pos)
            data = f.read()
    except OSError:
        return pos
    # Only whole lines: a half-written line is printed when its newline arrives.
    cut = data.rfind(b"\n") + 1
    if cut:
        out.write(data[:cut].decode("utf-8", "replace"))
        out.flush()
    return pos + cut
