"""A run's metrics across its segments: the records of metrics.jsonl, per-segment timing, and the
one table `hpcrl metrics` writes. Stdlib only until a table is written (pandas/pyarrow then)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import HpcrlError
from ..samplestore import json_records as _parse

TRAIN_PHASES = (None, "train", "sft")  # records of a training step; evaluations have their own phase
EVAL_PHASES = ("eval_before", "eval_sft", "eval", "eval_after")


# path -> (inode, bytes consumed, records): `logs -f` redraws its progress line every half second
# and `status RUN` looks at the records several times; each reads only what was appended since
# (by offset, as the verl launcher follows its log), and a replaced or shortened file is read anew
_READ: dict[str, tuple[int, int, list]] = {}


def read_records(path) -> list[dict]:
    """Every complete record of a metrics file, in order (a torn last line waits for its newline)."""
    key = str(path)
    try:
        st = os.stat(key)
        inode, pos, records = _READ.get(key, (None, 0, []))
        if inode != st.st_ino or st.st_size < pos:
            pos, records = 0, []
        if st.st_size > pos:
            with open(key, "rb") as f:
                f.seek(pos)
                data = f.read(st.st_size - pos)
            cut = data.rfind(b"\n") + 1
            records = records + _parse(data[:cut])  # a new list: callers may hold the old one
            pos += cut
        _READ[key] = (st.st_ino, pos, records)
    except OSError:
        _READ.pop(key, None)
        return []
    return list(records)




def is_train(rec: dict) -> bool:
    return rec.get("phase") in TRAIN_PHASES and isinstance(rec.get("step"), (int, float))


@dataclass
class SegmentTiming:
    """What one segment's training records say: its steps and when they were logged."""

    k: int
    first_step: int
    last_step: int
    steps: int                 # records (a step redone after a resume counts again: it was work)
    first_time: float | None
    last_time: float | None
    step_s: float | None       # mean seconds per step

    @property
    def steps_per_s(self) -> float | None:
        return 1.0 / self.step_s if self.step_s else None

    @property
    def train_s(self) -> float | None:
        """Seconds spent in training steps (the first record is logged after its step)."""
        if self.first_time is None or self.last_time is None or not self.step_s:
            return None
        return self.last_time - self.first_time + self.step_s


def segment_timings(records: list[dict]) -> dict[int, SegmentTiming]:
    """Per segment number (the records' "segment"), from its training records' "step" and "time"."""
    groups: dict[int, list[dict]] = {}
    for rec in records:
        if is_train(rec) and isinstance(rec.get("segment"), int):
            groups.setdefault(rec["segment"], []).append(rec)
    out = {}
    for k, recs in groups.items():
        times = [r["time"] for r in recs if isinstance(r.get("time"), (int, float))]
        step_s = None
        if len(times) >= 2 and times[-1] > times[0]:
            step_s = (times[-1] - times[0]) / (len(times) - 1)
        elif isinstance(recs[-1].get("step_time_s"), (int, float)) and recs[-1]["step_time_s"] > 0:
            step_s = float(recs[-1]["step_time_s"])
        out[k] = SegmentTiming(k, int(recs[0]["step"]), int(recs[-1]["step"]), len(recs),
                               times[0] if times else None, times[-1] if times else None, step_s)
    return out


# ---------------------------------------------------------------- the table


FORMATS = ("csv", "parquet", "jsonl")


def surviving(records: list[dict]) -> list[dict]:
    """The trajectory that survived: where a successor re-trained steps a lost segment had
    trained past its last checkpoint, the later record of each (phase, step) supersedes the
    earlier; order kept. (The plot keeps the last too: plot._series.)"""
    last = {}
    for i, rec in enumerate(records):
        if isinstance(rec.get("step"), (int, float)):
            last[(rec.get("phase"), rec["step"])] = i
    keep = set(last.values())
    return [rec for i, rec in enumerate(records) if i in keep or not isinstance(rec.get("step"), (int, float))]


def table_rows(records: list[dict], state: dict) -> list[dict]:
    """One row per surviving record (one per training step: replayed steps superseded): segment,
    phase and wall time columns first (wall_s: seconds since the run's first segment started),
    then the trainer's own keys. Evaluations stay their own rows."""
    starts = [s["started"] for s in state.get("segments", []) if s.get("started")]
    t0 = min(starts) if starts else None
    rows = []
    for rec in surviving(records):
        t = rec.get("time")
        row = {"segment": rec.get("segment"), "phase": rec.get("phase") or "train", "step": rec.get("step"),
               "time": t, "wall_s": round(t - t0, 3) if isinstance(t, (int, float)) and t0 else None}
        row.update({k: v for k, v in rec.items() if k not in row})
        rows.append(row)
    return rows


def write_table(rows: list[dict], fmt: str, out) -> None:
    """Write rows as csv, parquet or jsonl to `out` (a path or a text stream for csv/jsonl)."""
    if fmt not in FORMATS:
        raise HpcrlError(f"--format {fmt}: use one of {', '.join(FORMATS)}")
    if fmt == "jsonl":
        text = "".join(json.dumps(r, sort_keys=False) + "\n" for r in rows)
        _write_text(out, text)
        return
    try:
        import pandas as pd
        if fmt == "parquet":
            import pyarrow  # noqa: F401
    except ImportError as e:
        raise HpcrlError(f"`hpcrl metrics --format {fmt}` needs pandas and pyarrow: pip install 'hpcrl[rl]' "
                         f"({e.name} is missing)") from None
    frame = pd.DataFrame(rows)
    if fmt == "csv":
        _write_text(out, frame.to_csv(index=False))
    else:
        if not isinstance(out, (str, Path)):
            raise HpcrlError("--format parquet is binary: give --out FILE.parquet")
        frame.to_parquet(out, index=False)


def _write_text(out, text: str) -> None:
    if isinstance(out, (str, Path)):
        Path(out).write_text(text, encoding="utf-8")
    else:
        out.write(text)
