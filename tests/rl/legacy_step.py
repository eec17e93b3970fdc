"""The built-in trainer with its RL step as it was before environments (issue 42), the reference
the one-turn environment must equal step for step (tests/rl/test_env_one_turn.py).

    python tests/rl/legacy_step.py --config trainer.json

`_rl_step` and `_rollout` below are main's code of 2026-12-06 before the change, verbatim: the
rollout, then the reward called on the responses, then the advantages and the update. The
trainer itself carries no such path; this wrapper patches it in and runs hpcrl.rl.train's main.
"""

from __future__ import annotations

import time


def _rl_step(self) -> dict | None:
    import torch

    from hpcrl.rl import algos, samples
    from hpcrl.schemas.builtin import ALGORITHMS

    cfg, G = self.cfg, self.cfg.group_size
    lr = self._set_lr(self._rl_lr())
    idx = self.sampler.next(cfg.batch_size)
    mine = self.dist.share(len(idx))  # whole groups: this rank's prompts and all their samples
    batch = self._rollout([self.train_ids[idx[p]] for p in mine], mine)
    if self.walltime.after_phase(cut=batch is None) is not None:
        self._say(f"step {self.step + 1} abandoned in its rollout: stop requested")
        return None
    examples = [self.train_ex[idx[p]] for p in mine for _ in range(G)]
    t_reward = time.monotonic()
    values, reward_metrics = self.reward(examples, batch.texts, dist=self.dist)
    reward_metrics["timing_s/reward"] = round(time.monotonic() - t_reward, 4)
    adv = algos.group_advantages(torch.tensor(values, dtype=torch.float32), G,
                                 scale_by_std=ALGORITHMS[cfg.algorithm].scale_by_std)
    if self.samples.due(self.step + 1):  # what was generated and how it scored: RUN/samples
        self.samples.keep(self.step + 1, samples.records(
            examples, [idx[p] for p in mine], batch.texts, values, getattr(self.reward, "details", None),
            adv.tolist(), mine.start, G), self.log)
    self._release_rollout()
    stats = self._update(batch, adv.to(self.device), row0=mine.start * G)
    self._sync_rollout()
    return {**self._batch_figures(values, batch, lr), **stats, **reward_metrics}


def _rollout(self, prompts: list, mine: range):
    from hpcrl.rl.dist import generator, stream_seed

    cfg = self.cfg
    streams = {}
    if cfg.rollout == "hf":
        streams["generators"] = [generator(self.device, cfg.seed, self.step, p) for p in mine]
    elif cfg.rollout == "vllm":
        streams["seeds"] = [stream_seed(cfg.seed, self.step, p) for p in mine]
    with self._for_generation():  # no collective per token: ranks decode at their own pace
        return self.rollout.generate(prompts, n=cfg.group_size, abort=self._stop_requested, **streams)


def main() -> int:
    from hpcrl.rl import train
    from hpcrl.rl.loop import RLTrainer

    RLTrainer._rl_step = _rl_step
    RLTrainer._rollout = _rollout
    return train.main()


if __name__ == "__main__":
    from hpcrl.rl.train import leave

    leave(main())
