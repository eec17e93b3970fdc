"""What `status` and `logs` show. Reads run directories; never imports the ML stack or YAML,
and never waits on the network (reconciling is control's, done before rows are drawn)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .. import lifecycle
from ..atomicio import atomic_write_text
from ..errors import HpcrlError
from ..lifecycle import RunState, SegState
from ..runs import Run

def _ckpt_info(run: Run, trainer: str) -> tuple[int | None, float | None]:
    from ..trainers import get_trainer  # launcher-side adapters only: no torch

    ckpt_dir = run.layout.checkpoints
    step = get_trainer(trainer).checkpoint_step(run.dir, ckpt_dir, remote=False)
    if step is None:
        return None, None
    from ..checkpoints.store import checkpoint_name  # only for rows read fresh (cached rows need none)

    path = ckpt_dir / checkpoint_name(step)  # hpcrl's own store; other trainers: the dir's own time
    try:
        return step, (path if path.exists() else ckpt_dir).stat().st_mtime
    except OSError:
        return step, None


def _display_state(run: Run, state: dict) -> str:
    if state["state"] == RunState.RUNNING and run.layout.checkpointing_flag.exists():
        return RunState.CHECKPOINTING.value
    return state["state"]


def planned_segments(state: dict, now: float | None = None) -> int:
    from . import eta

    return eta.planned_segments(state, time.time() if now is None else now)


# progress and results are imported where used: `status` of finished runs reads only the cache
ACTIVE_STATES = frozenset(s.value for s in lifecycle.ACTIVE)


def run_facts(run: Run, state: dict):
    """The numbers of the frozen spec that ETA and cost need (defaults where it cannot be read):
    a eta.RunFacts."""
    from . import eta
    from ..trainers import get_trainer  # launcher-side adapters only: no torch

    try:
        resolved = json.loads(run.layout.spec.read_text(encoding="utf-8"))
        spec, site = resolved["spec"], resolved["site"]
    except (OSError, ValueError, KeyError, TypeError):
        spec, site = {}, {}
    res = spec.get("resources") or {}
    try:
        total = get_trainer(state.get("trainer", "smoke")).total_steps(spec.get("args") or {})
    except (HpcrlError, KeyError, TypeError, ValueError):
        total = None
    return eta.RunFacts(total_steps=total, walltime_s=float(state["budget"].get("hours") or 0) * 3600.0,
                             stop_lead_s=float(site.get("signal_lead_s") or 0), nodes=int(res.get("nodes") or 1),
                             gpus_per_node=int(res.get("gpus_per_node") or site.get("gpus_per_node") or 0),
                             charge_factor=site.get("charge_factor"))


def summary(run: Run, state: dict | None = None, note: str | None = None) -> dict:
    """One run as a dict (the --json row and the table row). note: a line the run's backend adds
    (e.g. that no watcher keeps it going). eta and cost: see hpcrl/status/eta.py."""
    from . import eta, metrics

    state = state or run.state()
    now = time.time()
    ckpt_step, ckpt_time = _ckpt_info(run, state.get("trainer", "smoke"))
    records = metrics.read_records(run.layout.metrics)
    last = records[-1] if records else None
    live = lifecycle.live_segments(state)
    started = [s for s in state["segments"] if s.get("started")]
    metric_name, metric = _headline_metric(last)
    facts, timings = run_facts(run, state), metrics.segment_timings(records)
    step = (last or {}).get("step")
    finish = eta.eta(state, timings, facts, step, now)
    return {
        "id": run.id, "site": state["site"], "state": _display_state(run, state),
        "reason": state.get("reason", ""), "note": note,
        "segments": len(started), "segments_planned": planned_segments(state, now),
        "job_id": (live[0]["job_id"] if live else (started[-1]["job_id"] if started else None)),
        "step": step, "checkpoint_step": ckpt_step,
        "checkpoint_age_s": round(now - ckpt_time, 1) if ckpt_time else None, "checkpoint_time": ckpt_time,
        "used_hours": round(lifecycle.used_hours(state, now), 4), "total_hours": state["budget"].get("total_hours"),
        "metric_name": metric_name, "metric": metric, "run_dir": str(run.dir), "created": state.get("created"),
        "eta": finish, "cost": eta.cost(state, facts, now, finish["wall_s_left"]),
        "replaying": eta.replaying(records, state), "at_risk": eta.at_risk(records, state, ckpt_step, now),
    }


def goodput_of(run: Run, state: dict) -> list[dict]:
    """Each started segment's training time over its walltime (`status RUN`; not cached per row:
    a list of 1,000 runs must stay a small file)."""
    from . import eta, metrics

    timings = metrics.segment_timings(metrics.read_records(run.layout.metrics))
    return eta.goodput(state, timings, run_facts(run, state), time.time())


def _cache_path() -> Path:
    from ..paths import hpcrl_home

    return hpcrl_home() / "status-cache.json"


def _load_cache() -> dict:
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
    changed = False  # a new finished row, or a run gone from the cache (no deep compare: 1,000 rows)
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
        if lifecycle.is_active(state) or lifecycle.live_segments(state):
            active.append(run)  # a final run with a segment still open is reconciled too
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
            if not lifecycle.is_active(state) and not lifecycle.live_segments(state):
                fresh[run_id] = {"key": _file_key(run.layout.state), "row": row}
                changed = True
        out.append((run, state, row))
    if changed or len(fresh) != len(cache):
        try:
            # compact: every `status` reads it whole
            atomic_write_text(_cache_path(), json.dumps(fresh, separators=(",", ":")))
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


def duration(seconds: float | None) -> str:
    """A short duration: 45s, 12m, 3h05m, 2d4h."""
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s" if s < 600 else f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600}h"


def is_active_row(row: dict) -> bool:
    return row["state"] in ACTIVE_STATES


def eta_cell(row: dict) -> str:
    eta = row.get("eta") or {}
    if not is_active_row(row):
        return "-"
    return "?" if eta.get("eta_s") is None else duration(eta["eta_s"])


def table_row(row: dict) -> list[str]:
    ckpt = "-" if row["checkpoint_step"] is None else f"{row['checkpoint_step']} ({_age(row['checkpoint_age_s'])} ago)"
    budget = f"{row['used_hours']:.2f}/{row['total_hours']:g}h" if row["total_hours"] else f"{row['used_hours']:.2f}h"
    metric = "-" if row["metric"] is None else f"{row['metric_name']}={row['metric']:.4g}"
    return [row["id"], row["site"], row["state"], f"{row['segments']}/{row['segments_planned']}", row["job_id"] or "-",
            step_cell(row), ckpt, budget, eta_cell(row), metric]


def step_cell(row: dict) -> str:
    """The step; while a successor re-trains steps a lost segment had trained: 'N (replaying -> M)'."""
    if row["step"] is None:
        return "-"
    replay = row.get("replaying") if is_active_row(row) else None
    return f"{row['step']} (replaying -> {replay[1]})" if replay else str(row["step"])


HEADERS = ["RUN", "SITE", "STATE", "SEG", "JOB", "STEP", "CHECKPOINT", "USED", "ETA", "LAST METRIC"]


def format_table(rows: list[list[str]], headers: list[str] = HEADERS) -> str:
    """The plain table (stdout not a terminal): every column whole, for scripts and pipes."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return "\n".join(lines)


# ---------------------------------------------------------------- status RUN


SEG_HEADERS = ["K", "JOB", "STATE", "START", "END", "STEPS", "RC", "USED", "GOODPUT"]


def segment_rows(state: dict, row: dict) -> list[list[str]]:
    good = {g["k"]: g for g in row.get("goodput") or []}
    out = []
    for s in state["segments"]:
        steps = f"{_s(s.get('start_step'))} -> {_s(s.get('end_step'))}" if s.get("started") else "-"
        g = good.get(s.get("k")) if s.get("started") else None
        out.append([_s(s.get("k")), s.get("job_id") or "-", s["state"], _t(s.get("started")), _t(s.get("ended")),
                    steps, _s(s.get("rc")), duration(g["used_s"]) if g else "-",
                    f"{g['goodput']:.0%}" if g and g["goodput"] is not None else "-"])
    return out


def progress_line(row: dict) -> str:
    """Steps/s, projected finish and segments left; '' when nothing can be said."""
    eta = row.get("eta") or {}
    total = eta.get("total_steps")
    parts = [f"step {_s(row['step'])}/{_s(total)}"]
    if eta.get("steps_per_s"):
        parts.append(f"{eta['steps_per_s']:.3g} steps/s (last segment)")
    if is_active_row(row):
        if eta.get("finish_time"):
            left = eta["segments_left"]
            parts.append(f"finish ~{_t(eta['finish_time'])} (in {duration(eta['eta_s'])}, "
                         f"{left} more segment{'s' if left != 1 else ''})")
        else:
            parts.append("finish: not known yet (needs steps with times and a total)")
    return ", ".join(parts)


def cost_line(row: dict) -> str:
    c = row.get("cost") or {}
    if not c:
        return ""
    nodes, used = c["nodes"], c.get("nodes_used") or []
    if len(used) > 1:  # segments on different node counts: each counted with its own
        text = f"{c['wall_hours']:.3g} h wall on {used[0]}-{used[-1]} nodes = {c['node_hours']:.3g} node-h"
    else:
        nodes = used[0] if used else nodes
        text = f"{c['wall_hours']:.3g} h wall x {nodes} node{'s' if nodes != 1 else ''} = {c['node_hours']:.3g} node-h"
    if c.get("gpu_hours") is not None:
        text += f" ({c['gpu_hours']:.3g} GPU-h)"
    if c.get("charged_hours") is not None:
        text += f", charged {c['charged_hours']:.3g} (x{c['charge_factor']:g})"
    if is_active_row(row) and c.get("node_hours_projected") is not None:
        text += f"; whole run ~{c['node_hours_projected']:.3g} node-h"
        if c.get("gpu_hours_projected") is not None:
            text += f" ({c['gpu_hours_projected']:.3g} GPU-h)"
        if c.get("charged_hours_projected") is not None:
            text += f", charged ~{c['charged_hours_projected']:.3g}"
    return text


def replay_line(row: dict) -> str:
    replay = row.get("replaying") if is_active_row(row) else None
    if not replay:
        return ""
    return (f"replaying {replay[0]} -> {replay[1]}: this segment re-trains the steps an earlier one trained "
            f"past its last checkpoint ({_s(row.get('checkpoint_step'))}) and lost")


def risk_line(row: dict) -> str:
    """What a hard kill of the running segment would lose (work since the last save)."""
    risk = row.get("at_risk") if is_active_row(row) else None
    if not risk:
        return ""
    if not risk["steps"]:
        return "nothing: no step trained since the last checkpoint"
    return (f"{risk['steps']} step{'s' if risk['steps'] != 1 else ''} ({duration(risk['seconds'])}) since the last "
            f"checkpoint ({_s(row.get('checkpoint_step'))}): what a hard kill would lose now")


def goodput_line(row: dict) -> str:
    good = [g for g in row.get("goodput") or [] if g["goodput"] is not None]
    if not good:
        return ""
    shares = ", ".join(f"{g['goodput']:.0%}" for g in good)
    text = (f"{shares} of each segment's time trained into a checkpoint (start-up and the stop before the walltime "
            f"are the rest)")
    lost = [g for g in row.get("goodput") or [] if g.get("lost_steps")]
    if lost:
        text += "; lost past the last checkpoint: " + ", ".join(
            f"segment {g['k']} {g['lost_steps']} step{'s' if g['lost_steps'] != 1 else ''}" for g in lost)
    return text


def export_line(run: Run) -> str:
    rec = newest_export(run)
    if rec is None:
        return ""
    return f"{rec['out']} (step {rec['step']}, {_t(rec['time'])})"


def newest_export(run: Run) -> dict | None:
    from . import metrics

    recs = metrics.read_records(run.layout.exports)
    return recs[-1] if recs else None


def sparkline(values: list[float], width: int = 40) -> str:
    """Values as one line of block characters, bucketed to at most `width` (the mean of each)."""
    values = [v for v in values if isinstance(v, (int, float))]
    if not values:
        return ""
    n = min(width, len(values))
    buckets = [values[i * len(values) // n:(i + 1) * len(values) // n] for i in range(n)]
    means = [sum(b) / len(b) for b in buckets if b]
    lo, hi = min(means), max(means)
    bars = "▁▂▃▄▅▆▇█"
    return "".join(bars[0 if hi == lo else min(7, int((m - lo) / (hi - lo) * 8))] for m in means)


def headline_series(run: Run) -> tuple[str | None, list[float]]:
    """The headline metric of the training records, step by step (the sparkline's data)."""
    from . import metrics

    recs = [r for r in metrics.read_records(run.layout.metrics) if metrics.is_train(r)]
    for key in ("reward_mean", "reward", "loss"):
        values = [r[key] for r in recs if isinstance(r.get(key), (int, float))]
        if values:
            return key, values
    return None, []


def detail_sections(run: Run, state: dict, row: dict) -> list[tuple[str, str]]:
    """(label, text) lines of `status RUN` under its table, empty ones left out."""
    lines = [("reason", row["reason"]), ("error", error_line(state, row["reason"])), ("note", row.get("note") or ""),
             ("steps", replay_line(row)), ("at risk", risk_line(row)),
             ("requeued", requeue_line(state)), ("eval", eval_line(run)),
             ("resources", resources_line(run)), ("progress", progress_line(row)), ("cost", cost_line(row)), ("goodput", goodput_line(row)),
             ("export", export_line(run))]
    return [(k, v) for k, v in lines if v]


def eval_line(run: Run) -> str:
    """The evaluations of a run, before -> after: at the start, after the warm-up, the newest."""
    from . import metrics

    ev = [r for r in metrics.read_records(run.layout.metrics)
          if str(r.get("phase") or "").startswith("eval") and isinstance(r.get("eval/reward_mean"), (int, float))]
    first = {r["phase"]: r for r in reversed(ev)}
    parts = [(first[p], text) for p, text in (("eval_before", "at the start"), ("eval_sft", "after the warm-up"))
             if p in first]
    later = [r for r in ev if r["phase"] in ("eval", "eval_after")]
    if later:
        parts.append((later[-1], "at the end" if later[-1]["phase"] == "eval_after" else "latest"))
    if not parts:
        return ""
    return "reward " + " -> ".join(f"{r['eval/reward_mean']:.3f} {text} (step {_s(r.get('step'))})"
                                   for r, text in parts)


def resources_line(run: Run) -> str:
    """What the next segment asks for (resume --nodes / --set resources.* change it): nodes, the
    world size of a trainer under torchrun, GPUs per node."""
    try:
        spec = json.loads(run.layout.spec.read_text(encoding="utf-8"))["spec"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    res = spec.get("resources") or {}
    nodes, ranks, gpus = int(res.get("nodes") or 1), res.get("ranks_per_node"), res.get("gpus_per_node")
    parts = [f"{nodes} node{'s' if nodes != 1 else ''}"]
    if ranks:
        world = nodes * int(ranks)
        parts[0] += f" x {ranks} per node = {world} rank{'s' if world != 1 else ''}"
    if gpus:
        parts.append(f"{gpus} GPU{'s' if gpus != 1 else ''} per node")
    parallel = (spec.get("args") or {}).get("parallel") if ranks and nodes * int(ranks) > 1 else None
    if parallel:
        parts.append(f"parallel: {parallel}")
    return ", ".join(parts)


def requeue_line(state: dict) -> str:
    """Segments whose job the scheduler started again (node failure, preemption): each earlier
    start is an attempt in the segment's record, and its hours count (lifecycle._requeued)."""
    parts = []
    for seg in state["segments"]:
        attempts = seg.get("requeues") or []
        if attempts:
            last = attempts[-1]
            times = "once" if len(attempts) == 1 else f"{len(attempts)} times"
            parts.append(f"segment {seg.get('k') or '-'} (job {seg.get('job_id')}) {times}, the last after "
                         f"{str(last.get('state') or '?').lower()} at step {_s(last.get('end_step'))}")
    return "; ".join(parts)


def error_line(state: dict, reason: str) -> str:
    """Why the newest ended segment failed, in the trainer's words, when it said (and the run's
    reason does not already)."""
    ended = [s for s in state["segments"] if s.get("ended") and s.get("rc") is not None]
    if not ended or ended[-1]["state"] != SegState.FAILED or not ended[-1].get("error"):
        return ""
    seg = ended[-1]
    if seg["error"] in reason:
        return ""
    return f"segment {seg.get('k')} failed (exit code {seg['rc']}): {seg['error']}"


def detail_paths(run: Run) -> list[tuple[str, Path]]:
    lay = run.layout
    return [("run dir", lay.root), ("script", lay.script), ("spec", lay.spec), ("logs", lay.logs),
            ("checkpoints", lay.checkpoints), ("metrics", lay.metrics),
            # the built-in trainer's samples of its steps (`hpcrl samples RUN` reads them)
            *([("samples", lay.samples)] if lay.samples.is_dir() else []), ("state", lay.state)]


def detail(run: Run, state: dict, row: dict) -> str:
    """`status RUN` as plain text: the summary, progress and cost, the segments and every path."""
    out = [format_table([table_row(row)])]
    out += [f"{label}: {text}" for label, text in detail_sections(run, state, row)]
    out.append("\nsegments:")
    out += ["  " + line for line in format_table(segment_rows(state, row), SEG_HEADERS).splitlines()]
    out.append("\npaths:")
    out += [f"  {name:<12} {p}" for name, p in detail_paths(run)]
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
        from ..errors import RunError

        raise RunError(f"--segment {k}: the run has {len(started)} started segment(s); use 1..{max(1, len(started))}")
    return k - 1


def print_all(run: Run, out) -> None:
    """`hpcrl logs RUN`: every started segment's log in order, each under a line naming it."""
    started = _started_segments(run.state())
    for seg in started:
        path = log_path(run, seg)
        out.write(f"==> segment {seg.get('k')}/{len(started)} (job {seg.get('job_id')}, {seg['state']}): {path} <==\n")
        _drain(path, 0, out)


FINAL_QUIET_POLLS = 20  # ~10 s at the default poll


def follow(run: Run, start_index: int, out, follow_on: bool, poll_s: float = 0.5, on_tick=None) -> None:
    """Print the log of segment `start_index` and, with follow_on, every later one as it starts,
    until the run reaches a final state and its last log is drained. on_tick(): called once per
    poll (the terminal's progress line)."""
    index, pos, quiet = start_index, 0, 0
    while True:
        if on_tick is not None:
            on_tick()
        state = run.state()
        started = _started_segments(state)
        if index < len(started):
            before, pos = pos, _drain(log_path(run, started[index]), pos, out)
            if not follow_on:
                return
            seg_done = started[index]["state"] != SegState.RUNNING
            # a final run whose segment is still marked RUNNING (its job was killed before its end
            # hook could run): once its log has been silent for FINAL_QUIET_POLLS polls, stop
            quiet = quiet + 1 if pos == before and not lifecycle.is_active(state) else 0
            if not seg_done and quiet >= FINAL_QUIET_POLLS:
                out.write(f"hpcrl: run {state['state']}; segment {started[index].get('k')} is still recorded as running "
                          f"but its log went quiet: its job ended without its end hook\n")
                return
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
