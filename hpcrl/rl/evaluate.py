"""The evaluation of the built-in trainer: greedy decoding on the val split, each rank its share,
scored by the reward. A mixin of RLTrainer."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .. import protocol
from ..atomicio import atomic_write_json
from ..rewards import mix as reward_mix
from . import metrics

# the rule rewards score 1.0 for a right answer: for them "accuracy" (scores >= 1.0) is the solve rate
RULE_REWARDS = ("auto", "countdown", "gsm8k", "gsm8k_flexible", "code")


def _accuracy_note(cfg) -> str:
    """What accuracy means beside a reward that is not one of the rule rewards (its scale is the
    user's: 0.000 may only say that no answer scored a full 1.0)."""
    if all(name in RULE_REWARDS for _, name in reward_mix.parse_terms(cfg.reward)):
        return ""
    return " (the share of answers scoring >= 1.0: a custom reward's scale may never reach it)"


def figures(scores: list, extra: dict) -> dict:
    """An evaluation's figures from its scores and the reward's metrics summed over its samples:
    the run's (metrics.jsonl) and `hpcrl eval`'s (hpcrl/rl/heldout.py) alike, so the two compare."""
    n = max(1, len(scores))
    return {"eval/reward_mean": round(sum(scores) / n, 6),
            "eval/accuracy": round(sum(s >= 1.0 for s in scores) / n, 6), "eval/n": len(scores),
            **{f"eval/{k}": round(v / n, 6) for k, v in extra.items()}}


# The evaluations a later segment repeats when a stop cuts them short (before training: no
# checkpoint yet; after it: the final checkpoint is there, the evaluation not): their results are
# kept batch by batch, so an evaluation longer than a segment goes on in the next one, and once
# done it is never run (nor logged) again.
KEPT_PHASES = ("eval_before", "eval_after")


class KeptEval:
    """The kept results of one evaluation (phase, step) in RUN_DIR/eval_progress/: a file per rank
    of the batches it scored ({"rows": [...], "scores": [...], "extra": {...}}, rewritten
    atomically after each batch), and once the evaluation is whole its result record
    (PHASE-STEP.json), the partial files removed. Rows are the val split's own indices, so a later
    segment on another number of ranks takes what any rank kept."""

    def __init__(self, run_dir, phase: str, step: int, rank: int, n_rows: int):
        self.dir = Path(run_dir) / "eval_progress"
        self.stem, self.rank, self.n_rows = f"{phase}-{step}", rank, n_rows
        self.mine: list = []  # the batches this process scored (and kept)

    @property
    def done_path(self) -> Path:
        return self.dir / f"{self.stem}.json"

    def result(self) -> dict | None:
        try:
            rec = json.loads(self.done_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return rec if rec.get("eval/n") == self.n_rows else None

    def kept(self) -> list:
        """Every batch any rank kept of this evaluation (an unreadable or foreign file: none of it)."""
        out = []
        for path in sorted(self.dir.glob(f"{self.stem}.rank*.json")):
            try:
                got = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if got.get("n_rows") == self.n_rows:
                out.extend(got["batches"])
        return out

    def keep(self, rows: list, scores: list, extra: dict) -> None:
        self.mine.append({"rows": list(rows), "scores": list(scores), "extra": dict(extra)})
        path = self.dir / f"{self.stem}.rank{self.rank}.json"
        # this rank's earlier segments' batches stay in its file beside this segment's
        old = [b for b in self._own(path) if b["rows"][0] not in {m["rows"][0] for m in self.mine}]
        atomic_write_json(path, {"n_rows": self.n_rows, "batches": old + self.mine})

    def _own(self, path: Path) -> list:
        try:
            got = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []
        return got["batches"] if got.get("n_rows") == self.n_rows else []

    def finish(self, record: dict) -> None:
        """Rank 0, once every rank's share is in `record`: the result kept, the batches removed."""
        atomic_write_json(self.done_path, record)
        for path in self.dir.glob(f"{self.stem}.rank*.json"):
            path.unlink(missing_ok=True)


def bump_progress(run_dir, rows: int) -> None:
    """The run's count of evaluation rows kept (protocol.PROGRESS_FILE): the launcher counts a
    segment that raised it as progress, as it does one that advanced the checkpoint."""
    if rows:
        protocol.write_progress(run_dir, (protocol.read_progress(run_dir) or 0) + rows)


class Evaluation:
    def _evaluate(self, phase: str) -> dict | None:
        """Greedy decoding on the val split; None when a stop request cut it short."""
        t0 = time.monotonic()
        kept = None
        if phase in KEPT_PHASES:
            kept = KeptEval(self.ctx.run_dir, phase, self.step, self.dist.rank, len(self.val_ids))
            done = kept.result() if self.dist.is_main else None
            # rank 0 decides (another node may not see the file yet): every rank skips, or none
            if self.dist.max([1.0 if done else 0.0])[0]:
                if done:
                    self._say(f"{phase} step {self.step}: done in an earlier segment (reward_mean="
                              f"{done['eval/reward_mean']:.3f} accuracy={done['eval/accuracy']:.3f}); not repeated")
                    self._compare_with_before_rl(phase, done)
                return done or {}
        self.eval_started = time.monotonic()
        scores, extra = self._decode_split(kept)
        if self.walltime.after_phase(cut=scores is None) is not None:
            self._say(f"{phase} abandoned: stop requested ({self.walltime.reason})"
                      + (f"; {self._kept_rows(kept)} of {len(self.val_ids)} rows kept for the next segment"
                         if kept else ""))
            return None
        parts = self.dist.gather((scores, extra))
        scores = [v for vals, _ in parts for v in vals]
        extra = {}
        for _, ex in parts:
            for k, v in ex.items():
                extra[k] = extra.get(k, 0.0) + v
        result = {**figures(scores, extra), "peak_rss_mb": metrics.peak_rss_mb()}
        if kept is not None and self.dist.is_main:
            kept.finish({"step": self.step, "phase": phase, **result})
            bump_progress(self.ctx.run_dir, len(scores) - sum(len(b["rows"]) for b in kept.mine))
        self.log.write({"step": self.step, "phase": phase, **result})
        self._say(f"{phase} step {self.step}: reward_mean={result['eval/reward_mean']:.3f} "
                  f"accuracy={result['eval/accuracy']:.3f}{_accuracy_note(self.cfg)} n={len(scores)} "
                  f"({time.monotonic() - t0:.1f} s)")
        self._compare_with_before_rl(phase, result)
        return result

    def _decode_split(self, kept: KeptEval | None = None):
        """(scores, summed reward metrics) of this rank's share of the split; (None, {}) when a
        stop request cut the decoding short. With `kept`, the batches an earlier segment kept are
        taken as they are (those starting in this rank's share are its to count) and each new
        batch is kept as soon as it is scored."""
        scores, extra = [], {}
        bs = self.cfg.eval_batch_size
        mine = self.dist.share(len(self.val_ids))  # each rank decodes its share of the split
        done_rows: set = set()
        for b in kept.kept() if kept is not None else []:
            done_rows.update(b["rows"])
            if b["rows"][0] in mine:
                scores.extend(b["scores"])
                for k, v in b["extra"].items():
                    extra[k] = extra.get(k, 0.0) + v
        todo = [i for i in mine if i not in done_rows]
        if done_rows:
            self._say(f"evaluation: {len(done_rows)} of {len(self.val_ids)} rows kept by earlier segments; "
                      f"decoding the rest")
        # fork: evaluation must not change the training's random stream; gathered (fsdp): the
        # weights all-gathered once for the phase, so ranks with more batches need no collective
        batch_s = 0.0  # the slowest batch so far: one that would not end before the deadline is not begun
        with torch.random.fork_rng(), self._for_generation():
            for at in range(0, len(todo), bs):
                # a local check per batch (and inside the decoding); the ranks agree after the loop.
                # An engine that cannot be interrupted (vLLM's one call) would otherwise run a batch
                # into the kill, and the segment end LOST
                if self._stop_requested() or (batch_s and kept is not None and self.stop.should_stop(
                        next_step_s=batch_s, save_s=self._save_budget_s())):
                    return None, {}
                t_batch = time.monotonic()
                rows = todo[at:at + bs]
                batch = self.rollout.generate([self.val_ids[i] for i in rows], n=1, greedy=True,
                                              abort=self._stop_requested)
                if batch is None:
                    return None, {}
                # val_ids holds only the first eval_size rows: score exactly the rows generated
                rows = rows[:len(batch.texts)]
                values, metrics_ = self.reward([self.val_ex[i] for i in rows], batch.texts)
                scores.extend(values)
                summed = {k: v * len(values) for k, v in metrics_.items()}  # weighted into a mean over the split
                for k, v in summed.items():
                    extra[k] = extra.get(k, 0.0) + v
                batch_s = max(batch_s, time.monotonic() - t_batch)
                if kept is not None:
                    kept.keep(rows, values, summed)
                    if self.dist.is_main:
                        bump_progress(self.ctx.run_dir, len(rows))
        return scores, extra

    def _kept_rows(self, kept: KeptEval) -> int:
        return len({i for b in kept.kept() for i in b["rows"]})

    def _compare_with_before_rl(self, phase: str, result: dict) -> None:
        if phase in ("eval_before", "eval_sft"):  # the later one (after the warm-up) is what RL starts from
            self.before_rl = result
        elif phase == "eval_after" and (b := getattr(self, "before_rl", None) or self._kept_before_rl()):
            self._say(f"pass rate (accuracy) before RL -> after: {b['eval/accuracy']:.3f} -> "
                      f"{result['eval/accuracy']:.3f}; reward_mean {b['eval/reward_mean']:.3f} -> "
                      f"{result['eval/reward_mean']:.3f}")

    def _kept_before_rl(self) -> dict | None:
        """A resumed run's evaluation before RL, as an earlier segment kept it (the one after a
        warm-up is not kept: none then)."""
        if self.cfg.sft_steps or not self.cfg.eval_before:
            return None
        return KeptEval(self.ctx.run_dir, "eval_before", 0, self.dist.rank, len(self.val_ids)).result()

    def _slow_start_note(self, reason: str) -> str:
        """Why a segment stopped before the run's first training step, with its numbers and what
        to change: the line `status` shows when two such segments fail the run."""
        now = time.monotonic()
        began = getattr(self, "eval_started", None)
        startup = (began or now) - self.t_init
        evaluating = now - began if began is not None else 0.0
        kept = KeptEval(self.ctx.run_dir, "eval_before", 0, self.dist.rank, len(self.val_ids))
        rows = len(self.val_ids) if kept.result() else self._kept_rows(kept)
        fix = ("raise --hours, or set args.eval_before=false (or a smaller args.eval_size)" if began is not None
               else "raise --hours: the first step and its save must fit after the start-up")
        return (f"stopped ({reason}) before the first training step: the start-up took {startup:.0f} s and "
                f"eval_before {evaluating:.0f} s of this segment ({rows} of {len(self.val_ids)} eval rows kept "
                f"so far); {fix}")
