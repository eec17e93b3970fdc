"""The training loop of the built-in trainer (see train.py for the process entry point)."""

from __future__ import annotations

import copy
import random
import time

import torch

from .. import protocol
from ..schemas.builtin import ALGORITHMS
from . import algos, checkpoint, data, metrics, policy, prepare, reward_mix, warmup
from .rollout import HFGenerateRollout, HFRollout
from .sampler import EpochSampler

say = metrics.say


class RLTrainer:
    def __init__(self, cfg: dict, ctx: protocol.Context, stop: protocol.StopFlag):
        self.cfg, self.ctx, self.stop = cfg, ctx, stop
        if cfg["threads"]:
            torch.set_num_threads(int(cfg["threads"]))
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        self.device = policy.pick_device(cfg["device"])
        self.model_dir = prepare.prepare_model(cfg, ctx.run_dir)
        train_path, val_path = prepare.prepare_data(cfg, ctx.run_dir)
        self.model, self.tok = policy.load_policy(self.model_dir, self.device, cfg["dtype"])
        self.ref = self._make_ref() if cfg["beta"] > 0 else None
        self.train_ex, self.val_ex = data.load_examples(train_path), data.load_examples(val_path)
        enc = dict(chat_template=cfg["chat_template"], max_prompt_length=cfg["max_prompt_length"])
        self.train_ids = policy.encode_prompts(self.tok, self.train_ex, **enc)
        self.val_ids = policy.encode_prompts(self.tok, self.val_ex[:cfg["eval_size"]], **enc)
        self.reward = reward_mix.Reward(cfg, self.device)
        # fused: one kernel over all parameters instead of a loop of small ones (~12% of a tiny step)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"],
                                           fused=self.device.type in ("cpu", "cuda"))
        self.rollout = self._make_rollout()
        self.ckpt = checkpoint.Checkpointer(ctx.ckpt_dir, cfg["keep_last"], cfg["async_save"], self.tok)
        self.log = metrics.MetricsLog(ctx.metrics_path, ctx.run_dir, ctx.segment, cfg["wandb_project"])
        self.sampler = EpochSampler(len(self.train_ids), cfg["seed"])
        self.step = 0
        self.saved_step = None  # the checkpoint this process loaded or wrote (not the pointer: it may name a corrupt one)
        self.total = cfg["sft_steps"] + cfg["total_steps"]
        self.step_s = 0.0  # the slowest recent step, to decide whether another one fits

    def _make_ref(self):
        ref = copy.deepcopy(self.model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def _make_rollout(self):
        cfg = self.cfg
        if cfg["rollout"] == "vllm":
            from .vllm_rollout import VllmRollout

            return VllmRollout(self.model_dir, self.tok, cfg, self.device)
        several_updates = cfg["ppo_epochs"] * cfg["mini_batches"] > 1
        engine = HFGenerateRollout if cfg["rollout"] == "hf-generate" else HFRollout
        return engine(self.model, self.tok, cfg["temperature"], cfg["top_p"], cfg["max_response_length"],
                      record_logprobs=several_updates)

    # ------------------------------------------------------------------ segment

    def run(self) -> int:
        resumed = self._resume()
        if not resumed:
            if self.cfg["eval_before"] and self._evaluate("eval_before") is None:
                return self._stop_exit()
            random.seed(self.cfg["seed"])
            torch.manual_seed(self.cfg["seed"])
        while self.step < self.total:
            if self.stop.should_stop(next_step_s=self.step_s, save_s=self._save_budget_s()):
                return self._stop_exit()
            self._one_step()
            if self.step == self.cfg["sft_steps"] and self.cfg["sft_steps"] > 0:
                self._end_of_warmup()
            if self.cfg["save_every"] and self.step % self.cfg["save_every"] == 0 and self.step < self.total:
                self._save(background=None)
            if self.cfg["eval_every"] and self.step % self.cfg["eval_every"] == 0 and self.step < self.total:
                self._evaluate("eval")
        return self._finish()

    def _finish(self) -> int:
        """Final checkpoint first (the work is safe), then the final evaluation."""
        self.ckpt.wait()
        if self.saved_step != self.step:
            self._save(background=False)
        if self.cfg["eval_after"] and self._evaluate("eval_after") is None:
            return self._stop_exit()  # the next segment finds step == total and only evaluates
        self._close_checkpoints()
        self.log.close()
        say(f"training complete at step {self.step}; peak RSS {metrics.peak_rss_mb():.0f} MB")
        return protocol.EXIT_COMPLETE

    def _stop_exit(self) -> int:
        reason = self.stop.reason or "deadline"
        self.ckpt.wait()
        fits = self.ctx.seconds_left() > self._save_budget_s()
        if self.step > 0 and self.saved_step != self.step and (reason != "SIGTERM" or fits):
            self._save(background=False)
        self._close_checkpoints()
        say(f"stopping at step {self.step} ({reason}); checkpoint at step "
            f"{self.saved_step}; exit {protocol.EXIT_CONTINUE} for the next segment; peak RSS {metrics.peak_rss_mb():.0f} MB")
        self.log.close()
        return protocol.EXIT_CONTINUE

    def _close_checkpoints(self) -> None:
        """Let old checkpoints finish being deleted, within the time left before the kill."""
        self.ckpt.close(timeout=min(60.0, max(0.0, self.ctx.seconds_left() - 2.0)))

    def _save_budget_s(self) -> float:
        return max(1.0, 2.0 * self.ckpt.last_save_s)

    def _save(self, background) -> None:
        state = {"step": self.step, "sampler": self.sampler.state(), "total": self.total}
        keep_ref = self.ref is not None and self.cfg["sft_steps"] > 0  # else ref = the base model on disk
        self.ckpt.save_now(self.step, self.model, self.optimizer, state, self.ref if keep_ref else None, background)
        self.saved_step = self.step

    def _resume(self) -> bool:
        _, path, state = self.ckpt.restore(self.model, self.optimizer, self.ref)
        if path is None:
            if state:  # a damaged checkpoint was partly read into the weights: start clean
                say("no intact checkpoint; starting from the base model")
                base, _ = policy.load_policy(self.model_dir, self.device, self.cfg["dtype"])
                self.model.load_state_dict(base.state_dict())
                if self.ref is not None:
                    self.ref.load_state_dict(base.state_dict())
                self.rollout.sync_weights(self.model)
            return False
        self.step = self.saved_step = int(state["step"])
        self.sampler = EpochSampler(len(self.train_ids), self.cfg["seed"], **state["sampler"])
        self.rollout.sync_weights(self.model)  # a vLLM engine started from the base weights
        say(f"resumed from {path} at step {self.step} of {self.total}")
        return True

    # ------------------------------------------------------------------ steps

    def _one_step(self) -> None:
        t0 = time.monotonic()
        if self.step < self.cfg["sft_steps"]:
            record = self._sft_step()
        else:
            record = self._rl_step()
        self.step += 1
        dt = time.monotonic() - t0
        self.step_s = max(dt, 0.7 * self.step_s)  # decays, but one slow step is remembered
        record.update(step=self.step, step_time_s=round(dt, 4),
                      tokens_per_s=round(record.pop("_tokens") / max(dt, 1e-9), 1))
        self.log.write(record)

    def _end_of_warmup(self) -> None:
        """The warmed-up model becomes the KL reference; its score shows what RL starts from."""
        if self.ref is not None:
            self.ref.load_state_dict(self.model.state_dict())
        if self.cfg["eval_before"]:
            self._evaluate("eval_sft")

    def _set_lr(self, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _sft_step(self) -> dict:
        cfg = self.cfg
        lr = self._set_lr(cfg["sft_lr"])
        idx = self.sampler.next(cfg["batch_size"] * cfg["group_size"])
        targets = [warmup.format_target(self.train_ex[i], random, cfg["countdown_ops"]) for i in idx]
        loss, ntok = warmup.sft_loss(self.model, self.tok, [self.train_ids[i] for i in idx], targets, self.device)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg["max_grad_norm"])
        self.optimizer.step()
        self.rollout.sync_weights(self.model)
        return {"phase": "sft", "loss": round(loss.item(), 6), "lr": lr, "_tokens": ntok}

    def _rl_lr(self) -> float:
        rl_step = self.step - self.cfg["sft_steps"]
        warm = self.cfg["lr_warmup_steps"]
        return self.cfg["lr"] * (min(1.0, (rl_step + 1) / warm) if warm else 1.0)

    def _rl_step(self) -> dict:
        cfg = self.cfg
        lr = self._set_lr(self._rl_lr())
        idx = self.sampler.next(cfg["batch_size"])
        batch = self.rollout.generate([self.train_ids[i] for i in idx], n=cfg["group_size"])
        examples = [self.train_ex[i] for i in idx for _ in range(cfg["group_size"])]
        t_reward = time.monotonic()
        values, reward_metrics = self.reward(examples, batch.texts)
        scores = torch.tensor(values, dtype=torch.float32)
        reward_metrics["timing_s/reward"] = round(time.monotonic() - t_reward, 4)
        adv = algos.group_advantages(scores, cfg["group_size"], scale_by_std=ALGORITHMS[cfg["algorithm"]].scale_by_std)
        stats = self._update(batch, adv.to(self.device))
        self.rollout.sync_weights(self.model)
        ntok = int(batch.response_mask.sum().item())
        return {"phase": "train", "reward_mean": round(scores.mean().item(), 6),
                "reward_std": round(scores.std().item() if len(scores) > 1 else 0.0, 6),
                "solve_rate": round((scores >= 1.0).float().mean().item(), 6),
                "response_len_mean": round(ntok / len(scores), 3), "lr": lr, "_tokens": ntok, **stats,
                **reward_metrics}

    def _update(self, batch, adv) -> dict:
        """ppo_epochs passes of mini_batches optimizer steps over one rollout batch."""
        cfg = self.cfg
        n = adv.shape[0]
        size = n // cfg["mini_batches"]
        single = cfg["ppo_epochs"] * cfg["mini_batches"] == 1
        ref_logp = self._logprobs_no_grad(self.ref, batch) if self.ref is not None else None
        if not single and batch.old_logp is None:  # the engine gave none: one extra forward pass
            batch.old_logp = self._logprobs_no_grad(self.model, batch)
        losses, last = [], {}
        for _ in range(cfg["ppo_epochs"]):
            order = torch.randperm(n) if cfg["mini_batches"] > 1 else torch.arange(n)
            for start in range(0, n, size):
                loss, last = self._optimizer_step(batch, order[start:start + size], adv, ref_logp, single)
                losses.append(loss)
        kl = last.pop("kl_ref")
        return {"loss": round(sum(losses) / len(losses), 6), "kl": round(kl, 6) if kl is not None else 0.0,
                **{k: round(v, 6) for k, v in last.items()}}

    def _optimizer_step(self, batch, idx, adv, ref_logp, single) -> tuple[float, dict]:
        """One optimizer step on rows `idx`, gradients accumulated over micro-batches."""
        cfg = self.cfg
        micro = cfg["micro_batch_size"] or len(idx)
        all_tokens = batch.response_mask[idx].sum().clamp(min=1.0)
        self.optimizer.zero_grad(set_to_none=True)
        total, stats = 0.0, {}
        for start in range(0, len(idx), micro):
            sub = idx[start:start + micro]
            mb = batch.select(sub)
            logp = policy.response_logprobs(self.model, mb.prompt_ids, mb.prompt_mask, mb.response_ids,
                                            mb.response_mask, cfg["temperature"], cfg["group_size"])
            # one update per batch: the policy *is* the sampler, so old = logp without a pass
            old = logp.detach() if single or mb.old_logp is None else mb.old_logp
            loss, stats = algos.policy_loss(
                logp, old, adv[sub], mb.response_mask, cfg["algorithm"], cfg["clip_low"], cfg["clip_high"],
                cfg["loss_agg"], None if ref_logp is None else ref_logp[sub], cfg["beta"],
                norm_len=cfg["max_response_length"])
            # each micro loss is a mean over its own rows: weight it into the mean over all of idx
            weight = mb.response_mask.sum() / all_tokens if cfg["loss_agg"] == "token-mean" else len(sub) / len(idx)
            (loss * weight).backward()
            total += loss.item() * float(weight)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg["max_grad_norm"])
        self.optimizer.step()
        return total, stats

    @torch.no_grad()
    def _logprobs_no_grad(self, model, batch):
        micro = self.cfg["micro_batch_size"] or batch.response_ids.shape[0]
        parts = []
        for start in range(0, batch.response_ids.shape[0], micro):
            mb = batch.select(torch.arange(start, min(start + micro, batch.response_ids.shape[0])))
            parts.append(policy.response_logprobs(model, mb.prompt_ids, mb.prompt_mask, mb.response_ids,
                                                  mb.response_mask, self.cfg["temperature"], self.cfg["group_size"]))
        return torch.cat(parts)

    # ------------------------------------------------------------------ evaluation

    def _evaluate(self, phase: str) -> dict | None:
        """Greedy decoding on the val split; None when a stop request cut it short."""
        t0 = time.monotonic()
        scores, extra = [], {}
        bs = self.cfg["eval_batch_size"]
        with torch.random.fork_rng():  # evaluation must not change the training's random stream
            for start in range(0, len(self.val_ids), bs):
                if self.stop.usr1 or self.stop.term or self.stop.should_stop(save_s=self._save_budget_s()):
                    say(f"{phase} abandoned: stop requested ({self.stop.reason or 'deadline'})")
                    return None
                batch = self.rollout.generate(self.val_ids[start:start + bs], n=1, greedy=True)
                # val_ids holds only the first eval_size rows: score exactly the rows generated
                values, metrics_ = self.reward(self.val_ex[start:start + len(batch.texts)], batch.texts)
                scores.extend(values)
                for k, v in metrics_.items():  # weighted by batch size into a mean over the split
                    extra[k] = extra.get(k, 0.0) + v * len(values)
        n = max(1, len(scores))
        result = {"eval/reward_mean": round(sum(scores) / n, 6),
                  "eval/accuracy": round(sum(s >= 1.0 for s in scores) / n, 6), "eval/n": len(scores),
                  "peak_rss_mb": metrics.peak_rss_mb(), **{f"eval/{k}": round(v / n, 6) for k, v in extra.items()}}
        self.log.write({"step": self.step, "phase": phase, **result})
        say(f"{phase} step {self.step}: reward_mean={result['eval/reward_mean']:.3f} "
            f"accuracy={result['eval/accuracy']:.3f} n={len(scores)} ({time.monotonic() - t0:.1f} s)")
        if phase in ("eval_before", "eval_sft"):  # the later one (after the warm-up) is what RL starts from
            self.before_rl = result
        elif phase == "eval_after" and getattr(self, "before_rl", None):
            b = self.before_rl
            say(f"pass rate (accuracy) before RL -> after: {b['eval/accuracy']:.3f} -> {result['eval/accuracy']:.3f}; "
                f"reward_mean {b['eval/reward_mean']:.3f} -> {result['eval/reward_mean']:.3f}")
        return result
