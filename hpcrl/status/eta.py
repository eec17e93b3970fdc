"""When a run will finish and what it costs: pure functions of the run's state, its segments'
timings (metrics.segment_timings) and a few numbers from its spec, on an injected clock.

The projection: the newest measured steps/s; each further segment costs what the latest segment
that stopped for continuation with today's walltime cost (its start-up before the first step, its
training window, its stop and save after the last step), and waits what the gaps between segments
were on average. Every past segment is measured by what it was queued with (seg["asked"]: hours,
nodes, GPUs; control.asked_of), so a resume that changes them leaves the past as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..lifecycle import SegState, is_active, seg_state
from .metrics import SegmentTiming


@dataclass(frozen=True)
class RunFacts:
    """The numbers of a run's spec the projection needs."""

    total_steps: int | None
    walltime_s: float          # asked walltime of each segment
    stop_lead_s: float = 0.0   # the site's signal lead: a segment stops training this early
    nodes: int = 1
    gpus_per_node: int = 0
    charge_factor: float | None = None  # the allocation's charge per node-hour, if the site says


def asked(seg: dict, facts: RunFacts) -> dict:
    """What the segment was queued with; the run's numbers for a segment recorded before segments
    kept theirs (or adopted from a hand-submitted job)."""
    own = seg.get("asked") or {}
    return {"walltime_s": float(own["hours"]) * 3600.0 if own.get("hours") else facts.walltime_s,
            "nodes": int(own.get("nodes") or facts.nodes),
            "gpus_per_node": int(own["gpus_per_node"]) if own.get("gpus_per_node") is not None else facts.gpus_per_node}


def planned_segments(state: dict, now: float) -> int:
    """N of SEG k/N: the segments started so far plus those the rest of the budget pays for at
    today's walltime (never fewer than have run, never more than max_segments)."""
    budget = state["budget"]
    started = [s for s in state["segments"] if s.get("started")]
    if not is_active(state):
        return len(started)
    cap = int(budget["max_segments"])
    if not (budget.get("total_hours") and budget.get("hours")):
        return max(cap, len(started))
    running = [s for s in started if seg_state(s) == SegState.RUNNING]
    closed = [s for s in started if s not in running]
    left_h = float(budget["total_hours"]) - sum(used_s(s, now) for s in closed) / 3600.0
    more = max(len(running), math.ceil(max(0.0, left_h) / float(budget["hours"]) - 1e-9))
    return max(len(started), min(cap, len(closed) + more))


def used_s(seg: dict, now: float) -> float:
    """Wall seconds a started segment held its nodes (so far, while it runs)."""
    if not seg.get("started"):
        return 0.0
    end = seg.get("ended") or (now if seg_state(seg) == SegState.RUNNING else seg["started"])
    return max(0.0, end - seg["started"])


def goodput(state: dict, timings: dict[int, SegmentTiming], facts: RunFacts, now: float) -> list[dict]:
    """Per started segment: training seconds that reached a checkpoint over walltime. A segment
    stopped for continuation is measured against the walltime it asked for (the stop lead and
    start-up are what it lost); a running or final one against the time it has used. Steps an
    ended segment trained past its last checkpoint (a hard kill, a crash) were lost: they count
    0 (`lost_steps`); a running segment's are at risk, not yet lost."""
    out = []
    for seg in state["segments"]:
        if not seg.get("started"):
            continue
        t = timings.get(seg.get("k"))
        used = used_s(seg, now)
        full = seg_state(seg) in (SegState.CONTINUE, SegState.LOST) and not seg.get("user_stop")
        base = max(used, asked(seg, facts)["walltime_s"]) if full else used
        train = t.train_s if t else None
        kept = t.steps if t else 0
        ended_badly = seg_state(seg) in (SegState.LOST, SegState.FAILED)
        if t and seg_state(seg) != SegState.RUNNING and (ended_badly or seg.get("end_step") is not None):
            # (a continuation with no checkpoint step on record, e.g. adopted: taken as saved whole)
            kept = min(t.steps, max(0, (seg.get("end_step") or 0) - (seg.get("start_step") or 0)))
        if train is not None and t and t.steps:
            train = min(train, used or train) * kept / t.steps
        out.append({"k": seg.get("k"), "job_id": seg.get("job_id"), "used_s": round(used, 1),
                    "train_s": None if train is None else round(train, 1),
                    "steps": t.steps if t else 0, "lost_steps": (t.steps - kept) if t else 0,
                    "goodput": None if train is None or not base else round(min(1.0, train / base), 3)})
    return out


def replaying(records: list[dict], state: dict) -> tuple[int, int] | None:
    """(step now, highest step trained before) while the running segment re-trains steps an
    earlier one trained and lost (past its last checkpoint); None otherwise."""
    running = [s for s in state["segments"] if seg_state(s) == SegState.RUNNING and s.get("k")]
    if not running:
        return None
    k = running[-1]["k"]
    mine = [r["step"] for r in records if r.get("segment") == k and _is_step(r)]
    before = [r["step"] for r in records if isinstance(r.get("segment"), int) and r["segment"] < k and _is_step(r)]
    now = mine[-1] if mine else running[-1].get("start_step")
    top = max(before, default=None)
    return (int(now or 0), int(top)) if top is not None and (now or 0) < top else None


def at_risk(records: list[dict], state: dict, ckpt_step: int | None, now: float) -> dict | None:
    """What a hard kill of the running segment would lose now: its steps past the last
    checkpoint, and the seconds since the first of them began."""
    running = [s for s in state["segments"] if seg_state(s) == SegState.RUNNING and s.get("k")]
    if not running:
        return None
    k = running[-1]["k"]
    mine = [r for r in records if r.get("segment") == k and _is_step(r) and r["step"] > (ckpt_step or 0)]
    if not mine:
        return {"steps": 0, "seconds": 0.0}
    saved_at = max((r.get("time") for r in records if _is_step(r) and r["step"] == ckpt_step
                    and isinstance(r.get("time"), (int, float))), default=None)
    since = saved_at or running[-1].get("started") or now
    return {"steps": len({r["step"] for r in mine}), "seconds": round(max(0.0, now - since), 1)}


def _is_step(rec: dict) -> bool:
    return rec.get("phase") in (None, "train", "sft") and isinstance(rec.get("step"), (int, float))


def _model(state: dict, timings: dict[int, SegmentTiming], facts: RunFacts) -> tuple[float, float, float, float]:
    """(start-up s, training window s, segment wall s, gap s) a further segment is expected to take:
    measured on the latest full segment queued with today's walltime, else today's walltime less
    the stop lead and the latest start-up seen."""
    started = [s for s in state["segments"] if s.get("started")]
    startup, window, wall = None, None, None
    for seg in reversed(started):
        t = timings.get(seg.get("k"))
        if not (t and t.train_s):
            continue
        if startup is None:
            startup = max(0.0, t.first_time - t.step_s - seg["started"])
        if seg_state(seg) == SegState.CONTINUE and seg.get("ended") and \
                abs(asked(seg, facts)["walltime_s"] - facts.walltime_s) < 1.0:
            startup = max(0.0, t.first_time - t.step_s - seg["started"])
            window, wall = t.train_s, seg["ended"] - seg["started"]
            break
    if startup is None:  # no step timed yet: the running segment's start-up so far is unknown
        running = started[-1] if started else None
        t = timings.get(running.get("k")) if running else None
        startup = max(0.0, t.first_time - t.step_s - running["started"]) if t and t.first_time and t.step_s else 0.0
    if window is None:  # no full segment at this walltime yet: the walltime less the stop lead and start-up
        wall = facts.walltime_s
        window = max(1.0, facts.walltime_s - facts.stop_lead_s - startup)
    gaps = [b["started"] - a["ended"] for a, b in zip(started, started[1:]) if a.get("ended")]
    gap = sum(gaps) / len(gaps) if gaps else 0.0
    return startup, window, wall, max(0.0, gap)


def eta(state: dict, timings: dict[int, SegmentTiming], facts: RunFacts, step: int | None, now: float) -> dict:
    """Steps/s of the last segment, projected finish (unix time and seconds from now), segments
    left after the running one, and the wall seconds the rest will hold nodes for."""
    started = [s for s in state["segments"] if s.get("started")]
    # the newest segment that has a rate: right after a segment starts, the one before it
    rates = [timings[s["k"]].steps_per_s for s in started if s.get("k") in timings]
    rate = next((r for r in reversed(rates) if r), None)
    out = {"total_steps": facts.total_steps, "steps_per_s": None if rate is None else round(rate, 4),
           "finish_time": None, "eta_s": None, "segments_left": None, "wall_s_left": None}
    if not is_active(state):
        ended = max((s.get("ended") or 0 for s in started), default=0) or None
        return {**out, "finish_time": ended, "eta_s": 0.0, "segments_left": 0, "wall_s_left": 0.0}
    if rate is None or facts.total_steps is None or step is None:
        return out
    left = max(0, facts.total_steps - step) / rate  # training seconds still to go
    startup, window, wall, gap = _model(state, timings, facts)
    tail = max(0.0, wall - startup - window)  # the stop and save after the last step
    running = started[-1] if started and seg_state(started[-1]) == SegState.RUNNING else None
    t, held, segments = now, 0.0, 0
    if running:
        own_s = asked(running, facts)["walltime_s"]  # resumed with other hours: its own walltime
        own_wall = wall if abs(own_s - facts.walltime_s) < 1.0 else own_s
        train_end = running["started"] + startup + max(1.0, window + own_wall - wall)
        can = max(0.0, train_end - now)
        if left <= can:
            return _done(out, now + left, now, left + tail, 0)
        left -= can
        seg_end = max(now, running["started"] + own_wall)
        held, t = seg_end - now, seg_end + gap
    while True:
        segments += 1
        if left <= window:
            finish = t + startup + left
            return _done(out, finish, now, held + startup + left + tail, segments)
        left -= window
        held += wall
        t += wall + gap


def _done(out: dict, finish: float, now: float, held_s: float, segments: int) -> dict:
    return {**out, "finish_time": round(finish, 1), "eta_s": round(max(0.0, finish - now), 1),
            "segments_left": segments, "wall_s_left": round(held_s, 1)}


def cost(state: dict, facts: RunFacts, now: float, wall_s_left: float | None) -> dict:
    """Wall hours, node-hours and GPU-hours used (each segment's time held x the nodes and GPUs it
    was queued with) and, with a projection, those of the whole run (the rest at today's
    resources); charged = node-hours x the site's charge factor."""
    segs = [(used_s(s, now), asked(s, facts)) for s in state["segments"]]
    used = sum(u for u, _ in segs)
    node_s = sum(u * a["nodes"] for u, a in segs)
    gpu_s = sum(u * a["nodes"] * a["gpus_per_node"] for u, a in segs)
    any_gpu = facts.gpus_per_node or any(a["gpus_per_node"] for u, a in segs if u)
    out = {"nodes": facts.nodes, "gpus_per_node": facts.gpus_per_node, "charge_factor": facts.charge_factor,
           "nodes_used": sorted({a["nodes"] for u, a in segs if u})}  # more than one: resumed with --nodes
    more = None if wall_s_left is None else wall_s_left
    for suffix, wall, n_s, g_s in (("", used, node_s, gpu_s),
                                   ("_projected", None if more is None else used + more,
                                    None if more is None else node_s + more * facts.nodes,
                                    None if more is None else gpu_s + more * facts.nodes * facts.gpus_per_node)):
        node_h = None if wall is None else n_s / 3600.0
        out[f"wall_hours{suffix}"] = None if wall is None else round(wall / 3600.0, 4)
        out[f"node_hours{suffix}"] = None if node_h is None else round(node_h, 4)
        out[f"gpu_hours{suffix}"] = None if node_h is None or not any_gpu else round(g_s / 3600.0, 4)
        out[f"charged_hours{suffix}"] = None if node_h is None or facts.charge_factor is None else \
            round(node_h * facts.charge_factor, 4)
    return out
