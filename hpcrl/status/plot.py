"""`hpcrl plot`: a run's curves (or several runs' on the same axes) as one PNG.

One panel per metric (reward with its evaluations, KL, loss, response length by default) against
the step; each segment's start is a dotted vertical line (numbered, at most ~12 labels whatever
the count), each segment's last checkpoint a triangle on the axis, the evaluations before and
after training annotated with their scores. Noisy training curves (reward, KL, loss) are drawn
faint with a moving mean over them; the warm-up -> RL switch is a labelled line, and the warm-up's
own loss (a different scale from RL's) has its own right-hand axis. Custom reward terms are named
by their file and function, not by the sanitised key. matplotlib comes from the `plot` extra.

The PNG carries what was drawn (panels, points, markers per run) in its "hpcrl" text chunk,
counted from the figure's own artists, so a test or a script can check a plot without a viewer.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import HpcrlError
from ..runs import Run
from .metrics import EVAL_PHASES, is_train, read_records

# (panel title, training key, evaluation key)
DEFAULT_PANELS = [("reward", "reward_mean", "eval/reward_mean"), ("KL to reference", "kl", None),
                  ("loss", "loss", None), ("response length", "response_len_mean", None)]
BOUNDARY, CHECKPOINT, RL_START = "segment-boundary", "checkpoint", "rl-start"
SEGMENT_LABELS = 12  # at most this many segment numbers on a panel: more overlap into a smear
LABEL_GAP = 0.04  # labels nearer than this share of the step axis would overlap: one label for them
SMOOTHED = {"reward_mean", "kl", "loss"}  # noisy per-step values: raw faint, moving mean over them


def _series(records: list[dict], key: str, train: bool) -> tuple[list, list, list]:
    """(steps, values, phases) of `key`, the last record kept where a resume redid a step."""
    last = {}
    for rec in records:
        if isinstance(rec.get(key), (int, float)) and isinstance(rec.get("step"), (int, float)) \
                and is_train(rec) == train:
            last[(rec.get("phase"), rec["step"])] = rec
    ordered = sorted(last.values(), key=lambda r: (r["step"], EVAL_PHASES.index(r["phase"])
                                                   if r.get("phase") in EVAL_PHASES else -1))
    return [r["step"] for r in ordered], [r[key] for r in ordered], [r.get("phase") for r in ordered]


def panels_for(runs_records: list[list[dict]], metrics: list[str] | None,
               betas: list[float | None] | None = None) -> list[tuple[str, str, str | None]]:
    keys = {k for recs in runs_records for r in recs for k, v in r.items() if isinstance(v, (int, float))}
    if metrics:
        unknown = [m for m in metrics if m not in keys]
        if unknown:
            have = ", ".join(sorted(k for k in keys if k not in ("step", "time", "segment")))
            raise HpcrlError(f"--metric {unknown[0]}: not in these runs' metrics; they have: {have}")
        return [(m, m, None) for m in metrics]
    chosen = [p for p in DEFAULT_PANELS if (p[1] in keys or (p[2] and p[2] in keys)) and not
              (p[1] == "kl" and not kl_computed(runs_records, betas))]
    if not chosen:
        raise HpcrlError("no metrics to plot yet (metrics.jsonl is empty); try again once the run has made steps")
    return chosen


def kl_computed(runs_records: list[list[dict]], betas: list[float | None] | None = None) -> bool:
    """Whether any run has a KL to its reference: with beta 0 the trainer keeps no reference and
    logs kl 0.0 at every step (a flat panel would read as 'no drift'). A run whose spec has beta >
    0 has one, whatever its logged values (a short run's may all be 0.0: #41, "beta 0" said of a
    run with beta 0.04); where the beta is not known, the values decide."""
    if any(b for b in betas or []):
        return True
    return any(r.get("kl") for recs in runs_records for r in recs if isinstance(r.get("kl"), (int, float)))


def kl_beta(run: Run) -> float | None:
    """The run's KL coefficient as its frozen spec holds it (the built-in trainer's args.beta,
    0.0 when unset: the schema's default); None for a trainer that logs KL otherwise."""
    try:
        spec = json.loads(run.layout.spec.read_text(encoding="utf-8"))["spec"]
        if spec.get("trainer") != "builtin":
            return None
        return float((spec.get("args") or {}).get("beta") or 0.0)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def plot(runs: list[Run], out: Path, metrics: list[str] | None = None) -> dict:
    """Draw the runs' metrics into `out` (PNG); return what was drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise HpcrlError("`hpcrl plot` needs matplotlib: pip install 'hpcrl[plot]'") from None
    data = [(run, run.state(), read_records(run.layout.metrics)) for run in runs]
    betas = [kl_beta(run) for run, _, _ in data]
    panels = panels_for([d[2] for d in data], metrics, betas)
    names = {}
    for run, _, _ in data:
        names.update(reward_names(run))
    panels = [(names.get(title, title), key, eval_key) for title, key, eval_key in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.6 * len(panels) + 0.6), sharex=True, squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    twins = {}
    for row, (title, key, eval_key) in enumerate(panels):
        ax = axes[row][0]
        for i, (run, state, records) in enumerate(data):
            colour = colours[i % len(colours)]
            twin = _draw_run(ax, run.id, f"{run.id} " if len(data) > 1 else "", state, records, key, eval_key,
                             colour, row == 0, names, twins.get(row))
            if twin is not None:
                twins[row] = twin
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if row in twins:
            more = twins[row].get_legend_handles_labels()
            handles, labels = handles + more[0], labels + more[1]
        if handles:
            ax.legend(handles, labels, loc="best", fontsize=8)
    axes[-1][0].set_xlabel("step")
    no_kl = not metrics and not kl_computed([d[2] for d in data], betas) and any("kl" in r for d in data for r in d[2])
    heading = " vs ".join(r.id for r in runs) + ": metrics by step (dotted: segment starts, ^: checkpoints)"
    if no_kl:  # "beta 0" only where the specs say so
        heading += ("\nKL not computed (beta 0: no reference model), so no KL panel" if all(b == 0.0 for b in betas)
                  else "\nKL 0.0 at every logged step, so no KL panel")
    fig.suptitle(heading)
    fig.tight_layout()  # after the right-hand axes exist: their labels are laid out too
    drawn = describe([axes[r][0] for r in range(len(panels))], [r.id for r in runs], panels, twins)
    drawn["kl_not_computed"] = no_kl
    drawn["title"] = heading
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, metadata={"hpcrl": json.dumps(drawn)}, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)
    return drawn


def _draw_run(ax, label: str, prefix: str, state: dict, records: list[dict], key: str, eval_key: str | None,
              colour: str, first_panel: bool, names: dict | None = None, twin=None):
    """One run's curve, its evaluations and its segment and checkpoint markers; artists' gids
    start with the run id (what describe counts). Returns the panel's right-hand axis when the
    warm-up's loss was drawn on one."""
    names = names or {}
    shown = names.get(key, key)
    steps, values, phases = _series(records, key, train=True)
    warm = [(s, v) for s, v, p in zip(steps, values, phases) if p == "sft"]
    if key == "loss" and warm and len(warm) < len(steps):  # RL's loss is flat on the warm-up's scale
        twin = twin or ax.twinx()
        twin.plot([s for s, _ in warm], [v for _, v in warm], color=colour, lw=1.0, ls="--", alpha=0.7,
                  label=f"{prefix}warm-up loss (right axis)", gid=f"{label}:train")
        twin.set_ylabel("warm-up loss")
        steps, values = zip(*[(s, v) for s, v, p in zip(steps, values, phases) if p != "sft"])
    else:
        twin = None
    if steps:
        smooth = key in SMOOTHED and len(steps) >= 20
        ax.plot(steps, values, color=colour, lw=0.8 if smooth else 1.2, alpha=0.25 if smooth else 1.0,
                label=f"{prefix}{shown}" + (" (each step)" if smooth else ""), gid=f"{label}:train")
        if smooth:
            ax.plot(steps, moving_mean(list(values), max(5, len(values) // 25)), color=colour, lw=1.6,
                    label=f"{prefix}{shown} (moving mean)", gid=f"{label}:smooth")
    rl_start = next((r["step"] for r in records if r.get("phase") == "train" and isinstance(r.get("step"), (int, float))),
                    None) if any(r.get("phase") == "sft" for r in records) else None
    if rl_start is not None:
        ax.axvline(rl_start - 0.5, color="grey", ls="-", lw=1.2, alpha=0.8, gid=f"{label}:{RL_START}")
        if first_panel:
            ax.annotate("warm-up | RL", (rl_start, 0.5), xycoords=("data", "axes fraction"), xytext=(-30, 0),
                        textcoords="offset points", fontsize=8, color="grey", rotation=90, va="center")
    ev_steps, ev_values, ev_phases = _series(records, eval_key or key, train=False)
    if ev_steps:
        ax.plot(ev_steps, ev_values, "o--", color=colour, ms=4, lw=0.8, alpha=0.8,
                label=f"{prefix}{names.get(eval_key or key, eval_key or key)} (greedy eval)", gid=f"{label}:eval")
        for s, v, phase in zip(ev_steps, ev_values, ev_phases):
            if phase in ("eval_before", "eval_after"):
                ax.annotate(f"{phase.split('_')[1]} {v:.3g}", (s, v), textcoords="offset points", xytext=(4, 6),
                            fontsize=8, color=colour)
    segs = [seg for seg in state["segments"] if seg.get("started")]
    many = len(segs) > 3 * SEGMENT_LABELS
    span = max([s for s in steps] + [seg.get("end_step") or 0 for seg in segs] + [1])
    for start, text in (segment_labels(segs, span) if first_panel else []):
        ax.annotate(text, (start, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -10),
                    textcoords="offset points", fontsize=7, color=colour, gid=f"{label}:segment-label")
    for seg in segs:
        start = seg.get("start_step") or 0
        ax.axvline(start, color=colour, ls=":", lw=0.6 if many else 1, alpha=0.35 if many else 0.7,
                   gid=f"{label}:{BOUNDARY}:{seg.get('k')}")
        if seg.get("end_step") is not None:
            ax.plot([seg["end_step"]], [0], marker="^", color=colour, ms=4 if many else 6,
                    transform=ax.get_xaxis_transform(), clip_on=False, gid=f"{label}:{CHECKPOINT}:{seg.get('k')}")
    return twin


def segment_labels(segs: list[dict], span: float) -> list[tuple[float, str]]:
    """(step, text) of the segment labels: segments starting at the same step share one label
    ("s2-6": they made no progress), a label nearer the previous one than LABEL_GAP of the axis
    is left out (its dotted line stays), at most SEGMENT_LABELS of them."""
    groups: list[list] = []  # [start, first k, last k]
    for seg in segs:
        start = seg.get("start_step") or 0
        if groups and start == groups[-1][0]:
            groups[-1][2] = seg.get("k")
        else:
            groups.append([start, seg.get("k"), seg.get("k")])
    every = max(1, -(-len(groups) // SEGMENT_LABELS))
    out: list[tuple[float, str]] = []
    for n, (start, first, last) in enumerate(groups):
        if n % every == 0 and (not out or start - out[-1][0] >= LABEL_GAP * span):  # too near the last: its line only
            out.append((start, f"s{first}" if first == last else f"s{first}-{last}"))
    return out


def moving_mean(values: list[float], window: int) -> list[float]:
    """The trailing mean of the last `window` values at each point (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _key(s: str) -> str:
    # the trainer's metric key of a reward term (hpcrl/rewards/mix.py _key; a test holds them together)
    import re

    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(s))[:60]


def reward_names(run: Run) -> dict[str, str]:
    """reward/<sanitised term> -> a readable name (my_reward.py:compute_score) for the run's
    custom reward terms, read from its frozen spec: the keys of runs from before the trainer named
    such terms short itself (hpcrl/rewards/mix.py term_names)."""
    import re

    try:
        reward = json.loads(run.layout.spec.read_text(encoding="utf-8"))["spec"]["args"].get("reward") or ""
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    out = {}
    for part in re.split(r"\s\+\s", str(reward)):
        name = re.sub(r"^\s*[-+.\deE]+\s*\*\s*", "", part).strip()
        if "/" in name or name.startswith("model:"):
            kind, _, rest = name.partition("model:") if name.startswith("model:") else ("", "", name)
            short = ("model:" if name.startswith("model:") else "") + Path(rest.rstrip("/")).name
            out[f"reward/{_key(name)}"] = f"reward/{short}"
    return out


def describe(axes, run_ids: list[str], panels, twins: dict | None = None) -> dict:
    """What the figure holds, counted from its artists (a panel's right-hand axis included)."""
    out = {"runs": run_ids, "panels": []}
    for row, (ax, (title, key, _)) in enumerate(zip(axes, panels)):
        lines = ax.get_lines() + ((twins or {})[row].get_lines() if row in (twins or {}) else [])
        gids = [line.get_gid() or "" for line in lines]
        points = sum(len(line.get_xdata()) for line in lines if (line.get_gid() or "").endswith(":train"))
        labels = [t for t in ax.texts if (t.get_gid() or "").endswith(":segment-label")]
        out["panels"].append({"title": title, "metric": key, "train_points": points,
                              "eval_points": sum(len(line.get_xdata()) for line in lines
                                                 if (line.get_gid() or "").endswith(":eval")),
                              "boundaries": {r: sum(g.startswith(f"{r}:{BOUNDARY}") for g in gids) for r in run_ids},
                              "checkpoints": sum(f":{CHECKPOINT}:" in g for g in gids),
                              "smoothed": any(g.endswith(":smooth") for g in gids),
                              "rl_start": any(g.endswith(f":{RL_START}") for g in gids),
                              "warmup_axis": row in (twins or {}),
                              "segment_labels": len(labels), "label_texts": [t.get_text() for t in labels],
                              "label_overlaps": _overlaps(labels),
                              "axis_labels_inside": _inside(ax.figure, [ax, *([twins[row]] if row in (twins or {}) else [])])})
    return out


def _overlaps(texts) -> int:
    """Pairs of texts whose drawn boxes overlap."""
    renderer = texts[0].figure.canvas.get_renderer() if texts else None
    boxes = [t.get_window_extent(renderer) for t in texts]
    return int(sum(bool(a.overlaps(b)) for i, a in enumerate(boxes) for b in boxes[i + 1:]))


def _inside(fig, axes) -> bool:
    """Whether every y-axis label of these axes lies whole inside the saved figure."""
    renderer = fig.canvas.get_renderer()
    for ax in axes:
        ext = ax.yaxis.label.get_window_extent(renderer)
        if ax.yaxis.label.get_text() and not (ext.x0 >= fig.bbox.x0 and ext.x1 <= fig.bbox.x1):
            return False
    return True
