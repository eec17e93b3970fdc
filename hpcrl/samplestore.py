"""The samples of a run's steps, on disk: what the trainer generated, how each answer was scored,
and its advantage. Stdlib only: the built-in trainer writes it (rank 0), the launcher's
`hpcrl samples` reads it on a login node that has no pandas.

    RUN/samples/step-00000012.jsonl      one file per kept step, one JSON object per sample

A sample (one line):

    {"step": 12, "segment": 2, "sample": 5, "group": 1,
     "turns": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}],
     "reward": 0.33, "terms": {"code": 0.33}, "reason": "wrong_answer", "advantage": -0.41,
     "extras": {"pass_rate": 0.33}, "data_source": "code-tiny", "ground_truth": "...", "row": 17}

`turns` is the episode as a list of messages (the prompt's, then the response as the last
assistant turn), so a multi-turn episode is the same record with more turns. `group` is the
prompt's position in the step's batch (its samples share it), `row` its index in the training
split. `reward` is the weighted sum of `terms` (each term's own score), `reason` the first term's
string `reason` (the code reward's verdict), `extras` the terms' other keys.

Why a file per step: a step written again after a resume (the steps a lost segment trained past
its checkpoint are trained again) replaces its file instead of appending a duplicate, the
checkpoint's step cuts the later files off on resume (`Writer.resume_at`), thinning deletes whole
files, and `--step N` reads one file. Each file is written whole and renamed into place: a reader
never sees half a step, and a killed trainer leaves at most a hidden temporary file.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

SAMPLES_DIR = "samples"  # in the run directory
DEFAULT_MAX_MB = 200
_NAME = re.compile(r"^step-(\d+)\.jsonl$")


def step_file(directory, step: int) -> Path:
    return Path(directory) / f"step-{int(step):08d}.jsonl"


def list_steps(directory, name=None) -> dict[int, int]:
    """{step: bytes} of every kept step file (temporaries and foreign files left out); `name`: the
    files' pattern, its group the step (default this store's step-NNNNNNNN.jsonl)."""
    name = name or _NAME
    out = {}
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return out
    for e in entries:
        m = name.match(e.name)
        if m:
            try:
                out[int(m.group(1))] = e.stat().st_size
            except OSError:
                continue  # thinned while we looked
    return dict(sorted(out.items()))


def read_step(directory, step: int) -> list[dict]:
    """The samples of one step, in the batch's order ([] when the step was not kept)."""
    try:
        data = step_file(directory, step).read_bytes()
    except OSError:
        return []
    return json_records(data)


def json_records(data: bytes) -> list[dict]:
    """The JSON objects of a JSON-lines file's bytes; a torn or foreign line is skipped (a writer
    killed mid-line, or metrics.jsonl's appends read while they happen)."""
    out = []
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def encode(samples: list[dict]) -> bytes:
    # default=str: a ground truth read from parquet may hold a type json does not know
    return "".join(json.dumps(s, ensure_ascii=False, default=str, separators=(",", ":")) + "\n"
                   for s in samples).encode("utf-8")


def to_thin(sizes: dict[int, int], budget: int, every: int = 1) -> list[int]:
    """The steps to delete so that the rest fit `budget` bytes: the newest half of the kept steps
    stays whole, the older half keeps every 2nd (by step / every), then every 4th, and so on while
    the total is over. A function of the kept files alone (no state to carry across segments);
    the newest step is never deleted (one step over the budget is kept: the run never stops)."""
    kept = dict(sizes)
    total = sum(kept.values())
    every = max(1, int(every))
    gone: list[int] = []
    stride = 2
    while total > budget:
        steps = sorted(kept)
        older = steps[: len(steps) // 2]
        if not older:
            break
        victims = [s for s in older if (s // every) % stride]
        if not victims:
            stride *= 2  # the older half is every `stride`th already: thin it to every 2*stride-th
            continue
        for s in victims:
            total -= kept.pop(s)
            gone.append(s)
    return sorted(gone)


class Writer:
    """Rank 0's writer: one file per kept step, the run's byte budget kept by thinning old steps.
    The kept files' sizes are read once (one directory listing per segment), then tracked."""

    def __init__(self, run_dir, max_mb: float = DEFAULT_MAX_MB, every: int = 1):
        self.dir = Path(run_dir) / SAMPLES_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.budget = int(float(max_mb) * 1e6)
        self.every = max(1, int(every))
        for e in os.scandir(self.dir):  # a killed writer's temporary
            if e.name.startswith(".step-"):
                try:
                    os.unlink(e.path)
                except OSError:
                    pass
        self.sizes = list_steps(self.dir)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def resume_at(self, step: int) -> None:
        """The run continues after `step` (its checkpoint's; 0: from the start): the later steps a
        lost segment wrote are trained again, so their files go now (else a crash before they are
        replayed would leave samples of a trajectory that no longer exists)."""
        for s in [s for s in self.sizes if s > step]:
            self._delete(s)

    def write(self, step: int, samples: list[dict]) -> None:
        data = encode(samples)
        path = step_file(self.dir, step)
        tmp = self.dir / f".{path.name}.tmp"
        # not fsync'ed: samples are a report, as metrics are (protocol.append_metrics)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        self.sizes[step] = len(data)
        if sum(self.sizes.values()) > self.budget:
            for s in to_thin(self.sizes, self.budget, self.every):
                self._delete(s)

    def _delete(self, step: int) -> None:
        try:
            step_file(self.dir, step).unlink()
        except FileNotFoundError:
            pass
        self.sizes.pop(step, None)
