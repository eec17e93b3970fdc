"""The samples of a step, kept in RUN/samples (the format: hpcrl/samplestore.py; `hpcrl samples RUN`
reads it). Every rank builds the records of its own share of the batch; rank 0 gathers them
and writes the step's one file."""

from __future__ import annotations

from .. import samplestore


def records(examples: list, rows: list, texts: list, values: list, details: list | None, advantages: list,
            first_group: int, group_size: int, conversations: list | None = None) -> list[dict]:
    """This rank's samples of one step: examples/texts/values/advantages per sample, `rows` the
    training split's index of each of its prompts, `first_group` its first prompt's position in
    the global batch, `details` the reward's per-sample terms and reason (Reward.details);
    `conversations`: each episode's turns after its prompt (a multi-turn environment's), else the
    one response."""
    out = []
    for j, (ex, text) in enumerate(zip(examples, texts)):
        d = details[j] if details and j < len(details) else {}
        after = conversations[j] if conversations is not None else [{"role": "assistant", "content": text}]
        out.append({"group": first_group + j // group_size, "row": int(rows[j // group_size]),
                    "turns": [*ex["messages"], *after],
                    "reward": float(values[j]), "terms": d.get("terms", {}), "reason": d.get("reason"),
                    "advantage": float(advantages[j]), "extras": d.get("extras", {}),
                    "data_source": ex.get("data_source"), "ground_truth": ex.get("ground_truth")})
    return out


class Keeper:
    """Which steps' samples are kept, and rank 0's writer. `due` is the same on every rank (keep
    gathers: every rank calls it on a due step)."""

    def __init__(self, cfg, run_dir, segment: int, dist):
        self.every, self.segment, self.dist = int(cfg.samples_every), segment, dist
        self.writer = (samplestore.Writer(run_dir, cfg.samples_max_mb, self.every)
                       if dist.is_main and self.every else None)
        self._first = True

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def keep(self, step: int, mine: list[dict], log=None) -> None:
        parts = self.dist.gather(mine)
        if self.writer is None:
            return
        if self._first:
            # this process's first kept step follows its checkpoint's: files from there on are a
            # lost segment's, trained past its checkpoint and being trained again now
            self.writer.resume_at(step - 1)
            self._first = False
        recs = [{"step": step, "segment": self.segment, "sample": i, **r}
                for i, r in enumerate(r for part in parts for r in part)]
        self.writer.write(step, recs)
        log_samples = getattr(log, "log_samples", None)
        if log_samples is not None:
            log_samples(step, recs)
