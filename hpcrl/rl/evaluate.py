"""The evaluation of the built-in trainer: greedy decoding on the val split, each rank its share,
scored by the reward. A mixin of RLTrainer."""

from __future__ import annotations

import time

import torch

from . import metrics, reward_mix

# the rule rewards score 1.0 for a right answer: for them "accuracy" (scores >= 1.0) is the solve rate
RULE_REWARDS = ("auto", "countdown", "gsm8k", "gsm8k_flexible", "code")


def _accuracy_note(cfg) -> str:
    """What accuracy means beside a reward that is not one of the rule rewards (its scale is the
    user's: 0.000 may only say that no answer scored a full 1.0)."""
    if all(name in RULE_REWARDS for _, name in reward_mix.parse_terms(cfg.reward)):
        return ""
    return " (the share of answers scoring >= 1.0: a custom reward's scale may never reach it)"


class Evaluation:
    def _evaluate(self, phase: str) -> dict | None:
        """Greedy decoding on the val split; None when a stop request cut it short."""
        t0 = time.monotonic()
        scores, extra = self._decode_split()
        if self.walltime.after_phase(cut=scores is None) is not None:
            self._say(f"{phase} abandoned: stop requested ({self.walltime.reason})")
            return None
        parts = self.dist.gather((scores, extra))
        scores = [v for vals, _ in parts for v in vals]
        extra = {}
        for _, ex in parts:
            for k, v in ex.items():
                extra[k] = extra.get(k, 0.0) + v
        n = max(1, len(scores))
        result = {"eval/reward_mean": round(sum(scores) / n, 6),
                  "eval/accuracy": round(sum(s >= 1.0 for s in scores) / n, 6), "eval/n": len(scores),
                  "peak_rss_mb": metrics.peak_rss_mb(), **{f"eval/{k}": round(v / n, 6) for k, v in extra.items()}}
        self.log.write({"step": self.step, "phase": phase, **result})
        self._say(f"{phase} step {self.step}: reward_mean={result['eval/reward_mean']:.3f} "
                  f"accuracy={result['eval/accuracy']:.3f}{_accuracy_note(self.cfg)} n={len(scores)} "
                  f"({time.monotonic() - t0:.1f} s)")
        self._compare_with_before_rl(phase, result)
        return result

    def _decode_split(self):
        """(scores, summed reward metrics) of this rank's share of the split; (None, {}) when a
        stop request cut the decoding short."""
        scores, extra = [], {}
        bs = self.cfg.eval_batch_size
        mine = self.dist.share(len(self.val_ids))  # each rank decodes its share of the split
        # fork: evaluation must not change the training's random stream; gathered (fsdp): the
        # weights all-gathered once for the phase, so ranks with more batches need no collective
        with torch.random.fork_rng(), self._for_generation():
            for start in range(mine.start, mine.stop, bs):
                # a local check per batch (and inside the decoding); the ranks agree after the loop
                if self._stop_requested():
                    return None, {}
                stop = min(start + bs, mine.stop)
                batch = self.rollout.generate(self.val_ids[start:stop], n=1, greedy=True,
                                              abort=self._stop_requested)
                if batch is None:
                    return None, {}
                # val_ids holds only the first eval_size rows: score exactly the rows generated
                values, metrics_ = self.reward(self.val_ex[start:start + len(batch.texts)], batch.texts)
                scores.extend(values)
                for k, v in metrics_.items():  # weighted by batch size into a mean over the split
                    extra[k] = extra.get(k, 0.0) + v * len(values)
        return scores, extra

    def _compare_with_before_rl(self, phase: str, result: dict) -> None:
        if phase in ("eval_before", "eval_sft"):  # the later one (after the warm-up) is what RL starts from
            self.before_rl = result
        elif phase == "eval_after" and getattr(self, "before_rl", None):
            b = self.before_rl
            self._say(f"pass rate (accuracy) before RL -> after: {b['eval/accuracy']:.3f} -> "
                      f"{result['eval/accuracy']:.3f}; reward_mean {b['eval/reward_mean']:.3f} -> "
                      f"{result['eval/reward_mean']:.3f}")
