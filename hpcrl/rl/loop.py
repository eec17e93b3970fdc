"""The training loop of the built-in trainer (see train.py for the process entry point).

A segment: resume (or evaluate the base model), steps until the total or a stop, then the final
save and evaluation (`_run`). One RL step is rollout -> reward -> advantages -> update
(`_rl_step`). Where the model lives over the ranks is parallel.py's, when to stop walltime.py's,
the update's math update.py's, the evaluation evaluate.py's, the set-up's sizes build.py's.
"""

from __future__ import annotations

import contextlib
import random
import time

import torch

from .. import protocol
from ..checkpoints.trainer import checkpointer as checkpoint
from ..schemas.builtin import ALGORITHMS
from ..rewards import mix as reward_mix
from .. import envs
from . import algos, build, data, episodes, fsdp, metrics, parallel, policy, prepare, samples, walltime, warmup
from .dist import Dist, generator, stream_seed
from .evaluate import Evaluation
from .parallel import SaveFailed  # noqa: F401  (train.py reports it)
from .sampler import EpochSampler
from .update import Update

say = metrics.say


class _NoLog:
    """The metrics log of a rank other than 0 (rank 0 writes the run's one metrics file)."""

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


class RLTrainer(Update, Evaluation):
    # ------------------------------------------------------------------ the algorithm

    def _run(self) -> int:
        """The segment: resume or evaluate the base model, steps until the total or a stop, the end."""
        cfg = self.cfg
        if not self._resume():
            if cfg.eval_before and self._evaluate("eval_before") is None:
                return self._stop_exit()
            random.seed(cfg.seed)
            torch.manual_seed(cfg.seed)
        self.t_train0 = time.monotonic()  # the time rule of the run's first checkpoint counts from here
        while self.step < self.total:
            reason = self.walltime.before_step(self._save_budget_s())
            if reason:
                return self._stop_exit(reason)
            if not self._one_step():  # a stop request cut the rollout short: the step is discarded
                return self._stop_exit(self.walltime.agreed())
            if self.step == cfg.sft_steps and cfg.sft_steps > 0:
                self._end_of_warmup()
            if self._due(cfg.save_every) or self._first_save_due():
                self._save(background=None)
            if self._due(cfg.eval_every) and self._evaluate("eval") is None:
                return self._stop_exit()  # a stop cut it short (the step itself is done)
        return self._finish()

    def _rl_step(self) -> dict | None:
        """One RL step: rollout -> reward -> advantages -> update; None when a stop cut the rollout short."""
        cfg, G = self.cfg, self.cfg.group_size
        lr = self._set_lr(self._rl_lr())
        # an abandoned step must leave no trace: the stop's checkpoint is resumed from, and a data
        # position or RNG state past this step's draw made the next segment skip its rows
        before = self.sampler.state(), checkpoint.rng_state()
        idx = self.sampler.next(cfg.batch_size)
        mine = self.dist.share(len(idx))  # whole groups: this rank's prompts and all their samples
        got = self._episodes([self.train_ex[idx[p]] for p in mine], [self.train_ids[idx[p]] for p in mine], mine)
        if self.walltime.after_phase(cut=got is None) is not None:
            self._say(f"step {self.step + 1} abandoned in its rollout: stop requested")
            self.sampler = EpochSampler(len(self.train_ids), cfg.seed, **before[0])
            checkpoint.set_rng_state(before[1])
            return None
        batch, eps = got
        examples = [self.train_ex[idx[p]] for p in mine for _ in range(G)]
        values = [ep.reward for ep in eps]  # an episode's reward: the sum of its terms
        reward_metrics = {**self._reward_figures(len(eps)), **episodes.figures(eps, self.env, self.dist.gather),
                          "timing_s/reward": round(self.env_s, 4)}
        adv = algos.group_advantages(torch.tensor(values, dtype=torch.float32), G,
                                     scale_by_std=ALGORITHMS[cfg.algorithm].scale_by_std)
        if self.samples.due(self.step + 1):  # what was generated and how it scored: RUN/samples
            self.samples.keep(self.step + 1, samples.records(
                examples, [idx[p] for p in mine], batch.texts, values, episodes.details(eps, self.env),
                adv.tolist(), mine.start, G, [ep.messages for ep in eps] if self.env.multi_turn else None), self.log)
        self._release_rollout()
        stats = self._update(batch, adv.to(self.device), row0=mine.start * G)
        self._sync_rollout()
        return {**self._batch_figures(values, batch, lr), **stats, **reward_metrics}

    # ------------------------------------------------------------------ set-up

    def __init__(self, cfg, ctx: protocol.Context, stop: protocol.StopFlag):
        self.cfg, self.ctx, self.stop = cfg, ctx, stop
        self.t_init = time.monotonic()  # a stop before the first step says how long the start-up took
        if cfg.threads:
            torch.set_num_threads(int(cfg.threads))
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        self.dist = Dist.from_env(cfg)
        if cfg.batch_size < self.dist.world:
            raise ValueError(f"args.batch_size = {cfg.batch_size} is less than the {self.dist.world} ranks: "
                             "every rank needs at least one prompt (whole groups per rank)")
        self.device = self.dist.device(policy.pick_device(cfg.device))
        train_path, val_path = self._prepare()
        self.par, self.model, self.ref, self.tok = parallel.parallelize(cfg, self.dist, self.device, self.model_dir,
                                                                        self._say)
        self.fsdp = self.par.sharded
        if cfg.gradient_checkpointing:
            self._say(build.checkpoint_activations(self.model))
        self._encode(train_path, val_path)
        self.engine_bytes, self.engine_utilization = build.plan_engine(
            cfg, self.model, self.device, self.dist, self.par, self.ref is not None, self._say)
        self.auto_rows = build.auto_rows(cfg, self.model, self.device, self.dist, self.par, self.ref is not None,
                                         self.train_ids, self.engine_bytes, self._say)
        # fused: one kernel over all parameters instead of a loop of small ones (~12% of a tiny step)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           fused=self.device.type in ("cpu", "cuda"))
        self.rollout = build.make_rollout(cfg, self.model, self.tok, self.model_dir, self.device, self.dist,
                                          self.engine_utilization)
        self.ckpt = checkpoint.Checkpointer(ctx.ckpt_dir, cfg.keep_last, cfg.async_save, self.tok,
                                            checkpoint.base_model_files(self.model_dir))
        self.log = (metrics.MetricsLog(ctx.metrics_path, ctx.run_dir, ctx.segment, cfg.wandb_project)
                    if self.dist.is_main else _NoLog())
        self.sampler = EpochSampler(len(self.train_ids), cfg.seed)
        self.samples = samples.Keeper(cfg, ctx.run_dir, ctx.segment, self.dist)
        self.walltime = walltime.Walltime(stop, ctx, self.dist)
        self.step = 0
        # the checkpoint this process loaded or wrote (not the pointer: it may name a corrupt one)
        self.saved_step = None
        self.total = cfg.sft_steps + cfg.total_steps
        self.carried_save_s = 0.0  # the run's last save time before this process (trainer state)

    def _prepare(self):
        """The reward, the model's directory and the data's (train, val) paths; rank 0 builds the
        tiny model and the data first, the other ranks find them."""
        if not self.dist.is_main:
            self.dist.barrier()
        # first: a reward that does not import fails the segment before the model is built or
        # copied into the run (SmolLM2: 517 MB) and before the data is generated
        self.reward = reward_mix.Reward(self.cfg, self.device, run_dir=self.ctx.run_dir)
        self.env = envs.load(self.cfg, self._score)
        self.model_dir = prepare.prepare_model(self.cfg, self.ctx.run_dir)
        paths = prepare.prepare_data(self.cfg, self.ctx.run_dir)
        if self.dist.is_main:
            self.dist.barrier()
        return paths

    def _encode(self, train_path, val_path) -> None:
        cfg = self.cfg
        self.train_ex, self.val_ex = data.load_examples(train_path), data.load_examples(val_path)
        enc = dict(chat_template=cfg.chat_template, max_prompt_length=cfg.max_prompt_length)
        self.train_ids = policy.encode_prompts(self.tok, self.train_ex, **enc)
        self.val_ids = policy.encode_prompts(self.tok, self.val_ex[:cfg.eval_size], **enc)
        self.env.check(self.train_ex)  # a row the environment cannot run fails the start, in one line

    # ------------------------------------------------------------------ segment

    def run(self) -> int:
        # No destroy_process_group at the end: under torchrun the process leaves with os._exit
        # (train.py), and a group torn down while a peer tears down its own can abort in gloo.
        return self._run()

    def _say(self, msg: str) -> None:
        if self.dist.is_main:
            say(msg)

    def _due(self, every: int) -> bool:
        """A save or evaluation every `every` steps (0: never), the last step's being the end's."""
        return bool(every) and self.step % every == 0 and self.step < self.total

    def _first_save_due(self) -> bool:
        """The run's first checkpoint, by time as well as steps: a segment that has trained for
        args.save_first_after_s with none in the run saves now, so a hard kill (a node failure, an
        uninterruptible phase run into the walltime) cannot take every step of it. The ranks agree
        (a save is collective; clocks differ): one collective a step until that save."""
        after = self.cfg.save_first_after_s
        if not after or self.saved_step is not None or self.step >= self.total:
            return False
        return bool(self.dist.max([float(time.monotonic() - self.t_train0 >= after)])[0])

    def _exit(self, code: int) -> int:
        """Every rank has finished (saved): rank 0 reports the code; all exit 0 under a launcher."""
        self.dist.barrier()
        if self.dist.is_main:
            return protocol.exit_code_for_launcher(self.ctx, code)
        return 0 if self.ctx.exit_file is not None else code

    def _finish(self) -> int:
        """Final checkpoint first (the work is safe), then the final evaluation."""
        if self.saved_step != self.step:
            self._save(background=False)
        else:
            self.par.wait(self.ckpt)
        if self.cfg.eval_after and self._evaluate("eval_after") is None:
            return self._stop_exit()  # the next segment finds step == total and only evaluates
        self._close_checkpoints()
        self.log.close()
        self._say(f"training complete at step {self.step}; peak RSS {metrics.peak_rss_mb():.0f} MB")
        return self._exit(protocol.EXIT_COMPLETE)

    def _stop_exit(self, reason: str | None = None) -> int:
        reason = reason or self.walltime.reason
        save = self.walltime.save_at_stop(reason, self.step > 0 and self.saved_step != self.step,
                                          self._save_budget_s())
        if save:
            self._save(background=False)
        else:
            self.par.wait(self.ckpt)
        self._close_checkpoints()
        if self.saved_step is None and self.step == 0 and self.dist.is_main:
            # nothing trained yet: if this repeats, the run fails for lack of progress, and this
            # line (the trainer's own reason) is what `status` then shows
            note = self._slow_start_note(reason)
            self._say(note)
            protocol.report_error(self.ctx.run_dir, note)
        self._say(f"stopping at step {self.step} ({reason}); checkpoint at step "
                  f"{self.saved_step}{f' (save {self.ckpt.last_save_s:.2f} s)' if save else ''}; "
                  f"exit {protocol.EXIT_CONTINUE} for the next segment; "
                  f"peak RSS {metrics.peak_rss_mb():.0f} MB")
        self.log.close()
        return self._exit(protocol.EXIT_CONTINUE)

    def _stop_requested(self) -> bool:
        """A stop seen by this rank alone, inside a phase; the ranks agree right after it."""
        return self.walltime.requested(self._save_budget_s)

    # ------------------------------------------------------------------ checkpoints

    def _close_checkpoints(self) -> None:
        """Let old checkpoints finish being deleted, within the time left before the kill."""
        self.ckpt.close(timeout=min(60.0, max(0.0, self.ctx.seconds_left() - 2.0)))

    def _save_budget_s(self) -> float:
        return walltime.save_budget_s(self.ckpt.last_save_s, self.carried_save_s, self._ckpt_bytes)

    def _ckpt_bytes(self) -> int:
        """The bytes this rank writes in a save: its (fsdp: its shards' share of the) float32
        weights, AdamW's two moments of each, and the KL reference's when it is saved."""
        if getattr(self, "_ckpt_bytes_n", None) is None:  # asked every few decoded tokens: counted once
            local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in self.model.parameters())
            ref = local if self.ref is not None and self.cfg.sft_steps > 0 else 0
            self._ckpt_bytes_n = 3 * local + ref
        return self._ckpt_bytes_n

    def _save(self, background) -> None:
        state = {"step": self.step, "sampler": self.sampler.state(), "total": self.total,
                 "save_s": round(self.ckpt.last_save_s or self.carried_save_s, 3)}  # the next segment's first budget
        keep_ref = self.ref is not None and self.cfg.sft_steps > 0  # else ref = the base model on disk
        self.par.save(self.ckpt, self.step, self.model, self.optimizer, state, self.ref if keep_ref else None,
                      background, self.cfg.dist_timeout_s)
        self.saved_step = self.step

    def _resume(self) -> bool:
        t0 = time.monotonic()
        path, state = self.par.restore(self.ckpt, self.model, self.optimizer, self.ref)
        load_s = time.monotonic() - t0
        self.dist.barrier()  # every rank has read it before rank 0 may write (and prune) again
        if path is None:
            if state:  # a damaged checkpoint was partly read into the weights: start clean
                self._say("no intact checkpoint; starting from the base model")
                self.par.reload_base(self.model, self.ref, self.model_dir, self.device, self.cfg.dtype)
                self._sync_rollout()
            return False
        self.step = self.saved_step = int(state["step"])
        self.carried_save_s = float(state.get("save_s") or 0.0)
        self.sampler = EpochSampler(len(self.train_ids), self.cfg.seed, **state["sampler"])
        self._sync_rollout()  # a vLLM engine started from the base weights
        self._say(f"resumed from {path} at step {self.step} of {self.total} (load {load_s:.2f} s)")
        return True

    # ------------------------------------------------------------------ steps

    def _one_step(self) -> bool:
        t0 = time.monotonic()
        comm0 = self.dist.comm_s
        record = self._sft_step() if self.step < self.cfg.sft_steps else self._rl_step()
        if record is None:
            return False
        self.step += 1
        dt = time.monotonic() - t0
        self.walltime.step_took(dt)
        record.update(step=self.step, step_time_s=round(dt, 4),
                      tokens_per_s=round(record.pop("_tokens") / max(dt, 1e-9), 1))
        if self.dist.enabled:  # time in collectives, waiting for the slowest rank included
            record["timing_s/comm"] = round(self.dist.comm_s - comm0, 4)
        self.log.write(record)
        return True

    def _end_of_warmup(self) -> None:
        """The warmed-up model becomes the KL reference; its score shows what RL starts from."""
        if self.ref is not None:
            self.par.copy_weights(self.model, self.ref)
        if self.cfg.eval_before:
            self._evaluate("eval_sft")

    def _set_lr(self, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _sft_step(self) -> dict:
        cfg, G = self.cfg, self.cfg.group_size
        lr = self._set_lr(cfg.sft_lr)
        rows = self.sampler.next(cfg.batch_size * G)
        # whole groups per rank, as in RL; each row's target drawn from the row's own stream
        mine = self.dist.share(cfg.batch_size)
        pos = range(mine.start * G, mine.stop * G)
        targets = [warmup.format_target(self.train_ex[rows[j]], random.Random(stream_seed(cfg.seed, self.step, j)),
                                        cfg.countdown_ops) for j in pos]
        with self._compute():
            loss, ntok = warmup.sft_loss(self.model, self.tok, [self.train_ids[rows[j]] for j in pos], targets,
                                         self.device)
        # a mean over every rank's target tokens: this rank's share of them weighs its mean
        all_tok = self.dist.sum([ntok])[0]
        self.optimizer.zero_grad(set_to_none=True)
        (loss * (ntok / all_tok * self._loss_scale())).backward()
        self._reduce_grads()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        self.optimizer.step()
        self._sync_rollout()
        mean = self.dist.sum([loss.item() * ntok])[0] / all_tok
        return {"phase": "sft", "loss": round(mean, 6), "lr": lr, "_tokens": int(all_tok)}

    def _rl_lr(self) -> float:
        warm, rl_step = self.cfg.lr_warmup_steps, self.step - self.cfg.sft_steps
        return self.cfg.lr * (min(1.0, (rl_step + 1) / warm) if warm else 1.0)

    def _streams(self, mine, turn: int = 1, keys=None) -> dict:
        """The engine's random streams of a turn: turn 1's one per prompt (the rollout's as it
        always was), a later turn's one per live episode, keyed by its prompt and sample."""
        cfg = self.cfg
        keys = [(p,) for p in mine] if keys is None else [(mine[p], "turn", turn, j) for p, j in keys]
        if cfg.rollout == "hf":
            return {"generators": [generator(self.device, cfg.seed, self.step, *k) for k in keys]}
        if cfg.rollout == "vllm":
            return {"seeds": [stream_seed(cfg.seed, self.step, *k) for k in keys]}
        return {}

    def _episodes(self, rows: list, prompts: list, mine):
        """This rank's episodes of the step (hpcrl/rl/episodes.py): (batch, episodes), or None when
        a stop request cut the decoding short. The environment's time is timing_s/reward."""
        cfg = self.cfg
        # no collective per token: ranks decode at their own pace (one agreement per later turn)
        runner = episodes.Runner(self.rollout, self.env, self.tok, episodes.Budget(cfg, self.env.multi_turn),
                                 episodes.uses_template(self.tok, cfg.chat_template), self._for_generation,
                                 self._turns_agree if self.dist.enabled else None,
                                 lambda: torch.autocast(self.device.type, enabled=False))
        encode = lambda msgs: policy.encode_prompts(self.tok, [{"messages": msgs}], cfg.chat_template,
                                                    cfg.max_prompt_length)[0]
        got = runner.run(rows, prompts, cfg.group_size, lambda turn, keys: self._streams(mine, turn, keys),
                         abort=self._stop_requested, encode=encode)
        self.env_s = runner.env_s
        return got

    def _turns_agree(self, live: int, cut: bool) -> tuple[bool, bool]:
        """(any rank has live episodes, any rank's decoding was cut by a stop): one collective a turn."""
        more, stopped = self.dist.max([float(live), float(cut)])
        return more > 0, stopped > 0

    def _score(self, rows: list, texts: list, whole_batch: bool = False):
        """args.reward over (rows, texts): (values, metrics, each sample's details). whole_batch:
        every rank scores its share of the global batch once (a reward model's `batch`
        normalisation is then over the global batch, a collective)."""
        values, metrics_ = self.reward(rows, texts, dist=self.dist if whole_batch else None)
        return values, metrics_, self.reward.details

    def _reward_figures(self, n: int) -> dict:
        """The reward's figures (reward/*) of the step over the global batch: every rank's share
        combined as if scored at once (mix.combine; a collective). Rank 0's alone were logged
        before: on two ranks, half the batch."""
        mine = self.env.metrics
        parts = self.dist.gather((dict(mine), getattr(mine, "weights", {}), n))
        return dict(reward_mix.combine([(reward_mix.Figures(m, w), k) for m, w, k in parts]))

    def _batch_figures(self, values: list, batch, lr: float) -> dict:
        """The step's figures over the global batch, in its order."""
        parts = self.dist.gather((values, int(batch.response_mask.sum().item())))
        scores = torch.tensor([v for vals, _ in parts for v in vals], dtype=torch.float32)
        ntok = sum(n for _, n in parts)
        return {"phase": "train", "reward_mean": round(scores.mean().item(), 6),
                "reward_std": round(scores.std().item() if len(scores) > 1 else 0.0, 6),
                "solve_rate": round((scores >= 1.0).float().mean().item(), 6),
                "response_len_mean": round(ntok / len(scores), 3), "lr": lr, "_tokens": ntok}

    # ------------------------------------------------------------------ the rollout engine

    def _for_generation(self):
        """The context of a generation: the HF engines run the training model, whose weights fsdp
        gathers for the whole phase (and in the compute dtype); vLLM holds its own weights, so
        nothing is gathered for it."""
        if self.cfg.rollout == "vllm":
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(self.par.gathered(self.model))
        stack.enter_context(self._compute())
        return stack

    def _release_rollout(self) -> None:
        """vLLM's weights and KV cache out of the way of the update, where vLLM can sleep."""
        release = getattr(self.rollout, "release", None)
        if release is not None:
            release()

    def _sync_rollout(self) -> None:
        """New weights to a separate engine (vLLM); the HF engines use the model itself.

        The gradients are freed first (the next step's zero_grad would free them anyway), then
        the weights go to the engine one tensor at a time in the compute dtype: each tensor is
        cast on its shards and (fsdp) all-gathered alone, the same order on every rank (a
        collective per tensor), and dropped once vLLM has copied it. The peak is one tensor,
        not the whole float32 state_dict that was gathered on every rank before."""
        if self.cfg.rollout != "vllm":
            self.rollout.sync_weights(self.model)
            return
        self.optimizer.zero_grad(set_to_none=True)
        self.rollout.sync_weights(fsdp.stream_weights(self.model, getattr(torch, self.cfg.dtype)))
