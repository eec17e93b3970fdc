"""`hpcrl plot`: a run's curves (or several runs' on the same axes) as one PNG.

One panel per metric (reward with its evaluations, KL, loss, response length by default) against
the step; each segment's start is a dotted vertical line labelled with its number, each
segment's last checkpoint a triangle on the axis, the evaluations before and after training
annotated with their scores. matplotlib comes from the `plot` extra.

The PNG carries what was drawn (panels, points, markers per run) in its "hpcrl" text chunk,
counted from the figure's own artists, so a test or a script can check a plot without a viewer.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import results
from .errors import HpcrlError
from .runs import Run

# (panel title, training key, evaluation key)
DEFAULT_PANELS = [("reward", "reward_mean", "eval/reward_mean"), ("KL to reference", "kl", None),
                  ("loss", "loss", None), ("response length", "response_len_mean", None)]
BOUNDARY, CHECKPOINT = "segment-boundary", "checkpoint"


def _series(records: list[dict], key: str, train: bool) -> tuple[list, list, list]:
    """(steps, values, phases) of `key`, the last record kept where a resume redid a step."""
    last = {}
    for rec in records:
        if isinstance(rec.get(key), (int, float)) and isinstance(rec.get("step"), (int, float)) \
                and results.is_train(rec) == train:
            last[(rec.get("phase"), rec["step"])] = rec
    ordered = sorted(last.values(), key=lambda r: (r["step"], results.EVAL_PHASES.index(r["phase"])
                                                   if r.get("phase") in results.EVAL_PHASES else -1))
    return [r["step"] for r in ordered], [r[key] for r in ordered], [r.get("phase") for r in ordered]


def panels_for(runs_records: list[list[dict]], metrics: list[str] | None) -> list[tuple[str, str, str | None]]:
    keys = {k for recs in runs_records for r in recs for k, v in r.items() if isinstance(v, (int, float))}
    if metrics:
        unknown = [m for m in metrics if m not in keys]
        if unknown:
            have = ", ".join(sorted(k for k in keys if k not in ("step", "time", "segment")))
            raise HpcrlError(f"--metric {unknown[0]}: not in these runs' metrics; they have: {have}")
        return [(m, m, None) for m in metrics]
    chosen = [p for p in DEFAULT_PANELS if p[1] in keys or (p[2] and p[2] in keys)]
    if not chosen:
        raise HpcrlError("no metrics to plot yet (metrics.jsonl is empty); try again once the run has made steps")
    return chosen


def plot(runs: list[Run], out: Path, metrics: list[str] | None = None) -> dict:
    """Draw the runs' metrics into `out` (PNG); return what was drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise HpcrlError("`hpcrl plot` needs matplotlib: pip install 'hpcrl[plot]'") from None
    data = [(run, run.state(), results.read_records(run.layout.metrics)) for run in runs]
    panels = panels_for([d[2] for d in data], metrics)
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.6 * len(panels) + 0.6), sharex=True, squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, (title, key, eval_key) in enumerate(panels):
        ax = axes[row][0]
        for i, (run, state, records) in enumerate(data):
            colour = colours[i % len(colours)]
            _draw_run(ax, run.id, f"{run.id} " if len(data) > 1 else "", state, records, key, eval_key, colour,
                      row == 0)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
    axes[-1][0].set_xlabel("step")
    fig.suptitle(" vs ".join(r.id for r in runs) + ": metrics by step (dotted: segment starts, ^: checkpoints)")
    fig.tight_layout()
    drawn = describe(fig, [r.id for r in runs], panels)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, metadata={"hpcrl": json.dumps(drawn)})
    plt.close(fig)
    return drawn


def _draw_run(ax, label: str, prefix: str, state: dict, records: list[dict], key: str, eval_key: str | None,
              colour: str, first_panel: bool) -> None:
    """One run's curve, its evaluations and its segment and checkpoint markers; artists' gids
    start with the run id (what describe counts)."""
    steps, values, _ = _series(records, key, train=True)
    if steps:
        ax.plot(steps, values, color=colour, lw=1.2, label=f"{prefix}{key}", gid=f"{label}:train")
    ev_steps, ev_values, ev_phases = _series(records, eval_key or key, train=False)
    if ev_steps:
        ax.plot(ev_steps, ev_values, "o--", color=colour, ms=4, lw=0.8, alpha=0.8,
                label=f"{prefix}{eval_key or key} (greedy eval)", gid=f"{label}:eval")
        for s, v, phase in zip(ev_steps, ev_values, ev_phases):
            if phase in ("eval_before", "eval_after"):
                ax.annotate(f"{phase.split('_')[1]} {v:.3g}", (s, v), textcoords="offset points", xytext=(4, 6),
                            fontsize=8, color=colour)
    for seg in state["segments"]:
        if not seg.get("started"):
            continue
        start = seg.get("start_step") or 0
        ax.axvline(start, color=colour, ls=":", lw=1, alpha=0.7, gid=f"{label}:{BOUNDARY}:{seg.get('k')}")
        if first_panel:
            ax.annotate(f"s{seg.get('k')}", (start, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -10),
                        textcoords="offset points", fontsize=7, color=colour)
        if seg.get("end_step") is not None:
            ax.plot([seg["end_step"]], [0], marker="^", color=colour, ms=6, transform=ax.get_xaxis_transform(),
                    clip_on=False, gid=f"{label}:{CHECKPOINT}:{seg.get('k')}")


def describe(fig, run_ids: list[str], panels) -> dict:
    """What the figure holds, counted from its artists."""
    out = {"runs": run_ids, "panels": []}
    for ax, (title, key, _) in zip(fig.axes, panels):
        gids = [line.get_gid() or "" for line in ax.get_lines()]
        points = sum(len(line.get_xdata()) for line in ax.get_lines() if (line.get_gid() or "").endswith(":train"))
        out["panels"].append({"title": title, "metric": key, "train_points": points,
                              "eval_points": sum(len(line.get_xdata()) for line in ax.get_lines()
                                                 if (line.get_gid() or "").endswith(":eval")),
                              "boundaries": {r: sum(g.startswith(f"{r}:{BOUNDARY}") for g in gids) for r in run_ids},
                              "checkpoints": sum(f":{CHECKPOINT}:" in g for g in gids)})
    return out
