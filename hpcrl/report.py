"""What `status` and `logs` show. Reads run directories; never imports the ML stack or YAML,
and never waits on the network (reconciling is launch's, done before rows are drawn)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from . import lifecycle, protocol
from .atomicio import atomic_write_json
from .errors import HpcrlError
from .lifecycle import RunState, SegState
from .runs import Run

STATE_COLOURS = {"RUNNING": "32", "CHECKPOINTING": "36", "RESUBMITTED": "36", "PENDING": "33",
                 "COMPLETED": "1;32", "FAILED": "1;31", "CANCELLED": "35", "STOPPED": "33"}


def _ckpt_info(run: Run, trainer: str) -> tuple[int | None, float | None]:
    from .trainers import get_trainer  # launcher-side adapters only: no torch

    ckpt_dir = run.layout.checkpoints
    step = get_trainer(trainer).checkpoint_step(run.dir, ckpt_dir, remote=False)
    if step is None:
        return None, None
    from .ckptstore import checkpoint_name  # only for rows read fresh (cached rows need none)

    path = ckpt_dir / checkpoint_name(step)  # hpcrl's own store; other trainers: the dir's own time
    try:
        return step, (path if path.exists() else ckpt_dir).stat().st_mtime
    except OSError:
        return step, None


def _display_state(run: Run, state: dict) -> str:
    if state["state"] == RunState.RUNNING and run.layout.checkpointing_flag.exists():
        return RunState.CHECKPOINTING.value
    return state["state"]


def planned_segments(state: dict) -> int:
    return lifecycle.planned_segments(state["budget"])


def summary(run: Run, state: dict | None = None, note: str | None = None) -> dict:
    """One run as a flat dict (the --json row and the table row). note: a line the run's
    backend adds (e.g. that no watcher keeps it going)."""
    state = state or run.state()
    ckpt_step, ckpt_time = _ckpt_info(run, state.get("trainer", "smoke"))
    metrics = protocol.read_last_metrics(run.layout.metrics)
    live = lifecycle.live_segments(state)
    started = [s for s in state["segments"] if s.get("started")]
    metric_name, metric = _headline_metric(metrics)
    return {
        "id": run.id, "site": state["site"], "state": _display_state(run, state),
        "reason": state.get("reason", ""), "note": note,
        "segments": len(started), "segments_planned": planned_segments(state),
        "job_id": (live[0]["job_id"] if live else (started[-1]["job_id"] if started else None)),
        "step": (metrics or {}).get("step"), "checkpoint_step": ckpt_step,
        "checkpoint_age_s": round(time.time() - ckpt_time, 1) if ckpt_time else None, "checkpoint_time": ckpt_time,
        "used_hours": round(lifecycle.used_hours(state, time.time()), 4), "total_hours": state["budget"].get("total_hours"),
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


def _file_key(path) -> list[int]:
    # inode, mtime_ns and size: a rewrite within one mtime tick still changes the inode (state.json
    # is replaced by rename) or the size
    st = os.stat(path)
    return [st.st_ino, st.st_mtime_ns, st.st_size]


def status_rows(ids: list[str], refresh_many, note=None) -> list[tuple]:
    """(run, state, row) for each run id; runs that are gone are skipped.

    A run in a final state changes only when resumed (which rewrites state.json), so its row is
    cached in $HPCRL_HOME/status-cache.json keyed by state.json's inode, mtime and size: with
    1,000 finished runs `status` costs one stat each. Active runs are read fresh and reconciled
    with their schedulers by `refresh_many(runs) -> {id: state}`, once for all of them.
    note(run, state): the backend's line for a run, or None.
    """
    cache, fresh, rows, active = _load_cache(), {}, {}, []
    for run_id in ids:
        hit = cache.get(run_id)
        if hit:
            try:
                if _file_key(hit["row"]["run_dir"] + "/state.json") == hit["key"]:
                    fresh[run_id] = hit
                    rows[run_id] = (None, None, _aged(hit["row"]))
                    continue
            except (OSError, KeyError, TypeError):
                pass
        try:
            run = Run.by_id(run_id)
            state = run.state()
        except (HpcrlError, OSError, ValueError):
            continue  # a run whose directory was deleted
        if lifecycle.is_active(state):
            active.append(run)
        rows[run_id] = (run, state, None)
    states = refresh_many(active) if active else {}
    out = []
    for run_id in ids:
        if run_id not in rows:
            continue
        run, state, row = rows[run_id]
        if row is None:
            state = states.get(run_id, state)
            row = summary(run, state, note(run, state) if note else None)
            if not lifecycle.is_active(state):
                fresh[run_id] = {"key": _file_key(run.layout.state), "row": row}
        out.append((run, state, row))
    if fresh != cache:
        try:
            atomic_write_json(_cache_path(), fresh)
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
    if row.get("note"):
        out.append(f"note: {row['note']}")
    out.append("\nsegments:")
    out.append("  K    JOB          STATE      START              END                STEPS         RC")
    for s in state["segments"]:
        steps = f"{_s(s.get('start_step'))} -> {_s(s.get('end_step'))}" if s.get("started") else "-"
        out.append(f"  {_s(s.get('k')):<4} {s.get('job_id') or '-':<12} {s['state']:<10} {_t(s.get('started')):<18} "
                   f"{_t(s.get('ended')):<18} {steps:<13} {_s(s.get('rc'))}")
    lay = run.layout
    out.append("\npaths:")
    for name, p in (("run dir", lay.root), ("script", lay.script), ("spec", lay.spec), ("logs", lay.logs),
                    ("checkpoints", lay.checkpoints), ("metrics", lay.metrics), ("state", lay.state)):
        out.append(f"  {name:<12} {p}")
    return "\n".join(out)


def _s(v) -> str:
    return "-" if v is None else str(v)


def _t(ts) -> str:
    return time.strftime("%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


# ---------------------------------------------------------------- logs


def log_path(run: Run, seg: dict) -> Path:
    return run.layout.log(seg.get("job_id"))


def _started_segments(state: dict) -> list[dict]:
    return [s for s in state["segments"] if s.get("started") or s["state"] == SegState.RUNNING]


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
            seg_done = started[index]["state"] != SegState.RUNNING
            if seg_done and index + 1 < len(started):
                pos = _drain(log_path(run, started[index]), pos, out)
                index, pos = index + 1, 0
                continue
            if seg_done and not lifecycle.is_active(state):
                _drain(log_path(run, started[index]), pos, out)
                return
        elif not follow_on or not lifecycle.is_active(state):
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
