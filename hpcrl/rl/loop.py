"""The training loop of the built-in trainer (see train.py for the process entry point)."""

from __future__ import annotations

import copy
import random
import time

import torch

from .. import protocol
from ..schemas.builtin import ALGORITHMS
from ..checkpoints.trainer import checkpointer as checkpoint
from . import algos, data, fsdp, memory, metrics, policy, prepare, reward_mix, warmup
from .dist import Dist, generator, stream_seed
from .rollout import HFGenerateRollout, HFRollout
from .sampler import EpochSampler

say = metrics.say


class _NoLog:
    """The metrics log of a rank other than 0 (rank 0 writes the run's one metrics file)."""

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


class SaveFailed(RuntimeError):
    """Rank 0 could not write a checkpoint (the reason is printed there); every rank stops."""


class RLTrainer:
    def __init__(self, cfg: dict, ctx: protocol.Context, stop: protocol.StopFlag):
        self.cfg, self.ctx, self.stop = cfg, ctx, stop
        if cfg["threads"]:
            torch.set_num_threads(int(cfg["threads"]))
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        self.dist = Dist.from_env(cfg)
        # one rank: nothing to shard, the plain path (as ddp on one rank)
        self.fsdp = self.dist.enabled and cfg["parallel"] == "fsdp"
        if cfg["batch_size"] < self.dist.world:
            raise ValueError(f"args.batch_size = {cfg['batch_size']} is less than the {self.dist.world} ranks: "
                             "every rank needs at least one prompt (whole groups per rank)")
        self.device = self.dist.device(policy.pick_device(cfg["device"]))
        if not self.dist.is_main:
            self.dist.barrier()  # rank 0 builds the tiny model and the data first; the others find them
        # first: a reward that does not import fails the segment before the model is built or
        # copied into the run (SmolLM2: 517 MB) and before the data is generated
        self.reward = reward_mix.Reward(cfg, self.device)
        self.model_dir = prepare.prepare_model(cfg, ctx.run_dir)
        train_path, val_path = prepare.prepare_data(cfg, ctx.run_dir)
        if self.dist.is_main:
            self.dist.barrier()
        if self.fsdp:  # no rank ever holds the whole model (nor the reference): built on meta, sharded, then read
            self.model, self.ref = self._load_sharded(), (self._load_sharded().eval() if cfg["beta"] > 0 else None)
            self.tok = policy.load_tokenizer(self.model_dir)
            self.model.generation_config.pad_token_id = self.tok.pad_token_id  # as load_policy sets it
            if self.ref is not None:
                self.ref.requires_grad_(False)
            held = sum(p.to_local().numel() for p in self.model.parameters())
            total = sum(p.numel() for p in self.model.parameters())
            ref = ("" if self.ref is None else
                   f", {sum(p.to_local().numel() for p in self.ref.parameters())} of the reference's")
            self._say(f"fsdp: {len(fsdp.fsdp_modules(self.model))} modules sharded over {self.dist.world} ranks; "
                      f"rank 0 holds {held} of {total} parameters{ref}")
        else:
            self.model, self.tok = policy.load_policy(self.model_dir, self.device)
            self.ref = self._make_ref() if cfg["beta"] > 0 else None  # forward only, no optimizer state
        if cfg["gradient_checkpointing"]:  # non-reentrant: the variant FSDP2 and autocast support
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            # transformers recomputes only in training mode (from_pretrained leaves eval); the
            # rollout and the evaluation switch to eval for their own passes and back
            self.model.train()
            from transformers.modeling_layers import GradientCheckpointingLayer

            layers = sum(isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
                         for m in self.model.modules())
            self._say(f"gradient checkpointing: {layers} decoder layers recompute their activations in the backward")
        self.train_ex, self.val_ex = data.load_examples(train_path), data.load_examples(val_path)
        enc = dict(chat_template=cfg["chat_template"], max_prompt_length=cfg["max_prompt_length"])
        self.train_ids = policy.encode_prompts(self.tok, self.train_ex, **enc)
        self.val_ids = policy.encode_prompts(self.tok, self.val_ex[:cfg["eval_size"]], **enc)
        self.engine_bytes, self.engine_utilization = self._plan_engine()
        self.auto_rows = self._auto_rows()
        # fused: one kernel over all parameters instead of a loop of small ones (~12% of a tiny step)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"],
                                           fused=self.device.type in ("cpu", "cuda"))
        self.rollout = self._make_rollout()
        self.ckpt = checkpoint.Checkpointer(ctx.ckpt_dir, cfg["keep_last"], cfg["async_save"], self.tok)
        self.log = (metrics.MetricsLog(ctx.metrics_path, ctx.run_dir, ctx.segment, cfg["wandb_project"])
                    if self.dist.is_main else _NoLog())
        self.sampler = EpochSampler(len(self.train_ids), cfg["seed"])
        self.step = 0
        self.saved_step = None  # the checkpoint this process loaded or wrote (not the pointer: it may name a corrupt one)
        self.total = cfg["sft_steps"] + cfg["total_steps"]
        self.step_s = 0.0  # the slowest recent step, to decide whether another one fits
        self.carried_save_s = 0.0  # the run's last save time before this process (trainer state)

    def _load_sharded(self):
        return fsdp.load_sharded(self.model_dir, self.device, self.dist.rank, self.dist.world, self.cfg["dtype"])

    def _compute(self):
        """The forward passes' dtype: autocast over the float32 masters (fsdp: its mp_policy casts)."""
        return policy.autocast(self.device, "float32" if self.fsdp else self.cfg["dtype"])

    def _auto_rows(self) -> int | None:
        """The most rows per forward/backward when micro_batch_size is 0: none on a CPU (the whole
        mini-batch), what the memory allows on a GPU (hpcrl/rl/memory.py). Decided from the shapes
        alone, so every rank and every segment splits alike."""
        cfg = self.cfg
        total = memory.device_bytes(self.device)
        if cfg["micro_batch_size"] or total is None:
            return None
        prompt = max((len(p) for p in self.train_ids), default=1)
        chunk = policy.logit_chunk_tokens(self.model, cfg["logit_chunk_tokens"])

        def pass_of(rows):
            return memory.pass_bytes(self.model.config, rows, prompt, cfg["max_response_length"], cfg["dtype"],
                                     cfg["gradient_checkpointing"], chunk)
        params = sum(p.numel() for p in self.model.parameters())  # the full count, sharded or not
        state = memory.state_bytes(params, self.dist.world if self.fsdp else 1, self.ref is not None)
        total -= self.engine_bytes  # a colocated vLLM holds its share of the device for the whole run
        # the rows a rank holds per optimizer step (whole groups per rank: some ranks may hold more
        # than the mean, so the search runs up to the whole batch and the message names the most)
        local = -(-cfg["batch_size"] // self.dist.world) * cfg["group_size"] // cfg["mini_batches"]
        most = memory.max_rows(total, state, pass_of, cfg["batch_size"] * cfg["group_size"])
        rows = memory.even_split(max(1, local), most)
        self._say(memory.describe(rows, pass_of(rows), total, state))
        return most

    def _plan_engine(self) -> tuple[int, float | None]:
        """(bytes, gpu_memory_utilization) of this rank's vLLM engine on a GPU, derived from the
        model's shape unless the spec sets the share: its weights in the compute dtype and the KV
        cache of the rank's whole rollout at once, within what training's peak (the state with its
        largest pass, or the weight sync) leaves; (0, the spec's) elsewhere."""
        cfg = self.cfg
        total = memory.device_bytes(self.device)
        if cfg["rollout"] != "vllm" or total is None:
            return 0, cfg["vllm_gpu_memory_utilization"]
        if cfg["vllm_gpu_memory_utilization"]:
            return int(total * cfg["vllm_gpu_memory_utilization"]), cfg["vllm_gpu_memory_utilization"]
        plan = memory.engine_plan(self.model.config, [p.numel() for p in self.model.parameters()], cfg,
                                  self.dist.world, self.fsdp, self.ref is not None, total,
                                  policy.logit_chunk_tokens(self.model, cfg["logit_chunk_tokens"]))
        self._say(f"vLLM engine per rank: {plan[0] / 2 ** 30:.1f} GiB (gpu_memory_utilization {plan[1]:.2f}, "
                  "from the memory estimate; set vllm_gpu_memory_utilization to choose)")
        return plan

    def _rows_per_pass(self, rows: int) -> int:
        if self.cfg["micro_batch_size"]:
            return self.cfg["micro_batch_size"]
        return memory.even_split(rows, self.auto_rows or max(1, rows))

    def _make_ref(self):
        ref = copy.deepcopy(self.model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def _make_rollout(self):
        cfg = self.cfg
        if cfg["rollout"] == "vllm":
            from .vllm_rollout import VllmRollout

            engine = VllmRollout(self.model_dir, self.tok, cfg, self.device, world=self.dist.world, rank=self.dist.rank,
                                 local_rank=self.dist.local_rank, gpu_memory_utilization=self.engine_utilization)
            say(f"rank {self.dist.rank}: {engine.placement()}")  # every rank: where its own engine is
            return engine
        engine = HFGenerateRollout if cfg["rollout"] == "hf-generate" else HFRollout
        # no sampler log-probs: the old policy's are the trainer's own forward's (_update)
        return engine(self.model, self.tok, cfg["temperature"], cfg["top_p"], cfg["max_response_length"],
                      record_logprobs=False)

    # ------------------------------------------------------------------ segment

    def run(self) -> int:
        # No destroy_process_group at the end: under torchrun the process leaves with os._exit
        # (train.py), and a group torn down while a peer tears down its own can abort in gloo.
        return self._run()

    def _say(self, msg: str) -> None:
        if self.dist.is_main:
            say(msg)

    def _exit(self, code: int) -> int:
        """Every rank has finished (saved): rank 0 reports the code; all exit 0 under a launcher."""
        self.dist.barrier()
        if self.dist.is_main:
            return protocol.exit_code_for_launcher(self.ctx, code)
        return 0 if self.ctx.exit_file is not None else code

    def _stop_wish(self) -> str | None:
        """This rank's stop reason (None: go on) agreed with every other rank's: the strongest wins."""
        local = None
        if self.stop.should_stop(next_step_s=self.step_s, save_s=self._save_budget_s()):
            local = self.stop.reason or "deadline"
        return self.dist.agree_stop(local)

    def _run(self) -> int:
        resumed = self._resume()
        if not resumed:
            if self.cfg["eval_before"] and self._evaluate("eval_before") is None:
                return self._stop_exit()
            random.seed(self.cfg["seed"])
            torch.manual_seed(self.cfg["seed"])
        while self.step < self.total:
            reason = self._stop_wish()
            if reason:
                return self._stop_exit(reason)
            if not self._one_step():  # a stop request cut the rollout short: the step is discarded
                return self._stop_exit(self.dist.agree_stop(self.stop.reason or "deadline"))
            if self.step == self.cfg["sft_steps"] and self.cfg["sft_steps"] > 0:
                self._end_of_warmup()
            if self.cfg["save_every"] and self.step % self.cfg["save_every"] == 0 and self.step < self.total:
                self._save(background=None)
            if self.cfg["eval_every"] and self.step % self.cfg["eval_every"] == 0 and self.step < self.total:
                if self._evaluate("eval") is None:  # a stop cut it short (the step itself is done)
                    return self._stop_exit()
        return self._finish()

    def _finish(self) -> int:
        """Final checkpoint first (the work is safe), then the final evaluation."""
        if self.saved_step != self.step:
            self._save(background=False)
        else:
            self._collective(self.ckpt.wait, every_rank=True)  # (each rank writes under fsdp)
        if self.cfg["eval_after"] and self._evaluate("eval_after") is None:
            return self._stop_exit()  # the next segment finds step == total and only evaluates
        self._close_checkpoints()
        self.log.close()
        self._say(f"training complete at step {self.step}; peak RSS {metrics.peak_rss_mb():.0f} MB")
        return self._exit(protocol.EXIT_COMPLETE)

    def _stop_exit(self, reason: str | None = None) -> int:
        reason = reason or self.stop.reason or "deadline"
        fits = self.ctx.seconds_left() > self._save_budget_s()
        # the decision is rank 0's (its save time is the one that counts), so no rank disagrees
        save = self.step > 0 and self.saved_step != self.step and (reason != "SIGTERM" or fits)
        save = bool(self.dist.max([float(save) if self.dist.is_main else 0.0])[0])
        if save:
            self._save(background=False)
        else:
            self._collective(self.ckpt.wait, every_rank=True)  # (each rank writes under fsdp)
        self._close_checkpoints()
        self._say(f"stopping at step {self.step} ({reason}); checkpoint at step "
                  f"{self.saved_step}{f' (save {self.ckpt.last_save_s:.2f} s)' if save else ''}; "
                  f"exit {protocol.EXIT_CONTINUE} for the next segment; "
                  f"peak RSS {metrics.peak_rss_mb():.0f} MB")
        self.log.close()
        return self._exit(protocol.EXIT_CONTINUE)

    def _collective(self, fn, every_rank: bool = False) -> None:
        """Run fn on rank 0 (the checkpoint writer; every_rank: on each, as writers of parts) and
        tell every rank whether it worked, so a failed save stops them all at once instead of
        leaving them waiting for rank 0."""
        error = None
        if self.dist.is_main or every_rank:
            try:
                fn()
            except Exception as e:  # reported below, on rank 0, after the others know
                error = e
        failed = self.dist.max([float(error is not None)])[0]
        if error is not None:
            raise error
        if failed:
            raise SaveFailed("another rank failed to write its part of a checkpoint" if every_rank
                             else "rank 0 failed to write a checkpoint")

    def _close_checkpoints(self) -> None:
        """Let old checkpoints finish being deleted, within the time left before the kill."""
        self.ckpt.close(timeout=min(60.0, max(0.0, self.ctx.seconds_left() - 2.0)))

    def _save_budget_s(self) -> float:
        """Twice the last save's time; before this process has saved, the time the run's last save
        took (carried in the trainer state) or what this rank's checkpoint bytes need at a
        conservative rate, whichever is longer: a multi-GB first save must still fit the deadline."""
        last = self.ckpt.last_save_s or max(self.carried_save_s, checkpoint.estimate_save_s(self._ckpt_bytes()))
        return max(1.0, 2.0 * last)

    def _ckpt_bytes(self) -> int:
        """The bytes this rank writes in a save: its (fsdp: its shards' share of the) float32
        weights, AdamW's two moments of each, and the KL reference's when it is saved."""
        if getattr(self, "_ckpt_bytes_n", None) is None:  # asked every few decoded tokens: counted once
            local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in self.model.parameters())
            ref = local if self.ref is not None and self.cfg["sft_steps"] > 0 else 0
            self._ckpt_bytes_n = 3 * local + ref
        return self._ckpt_bytes_n

    def _save(self, background) -> None:
        # replicated state (ddp): rank 0's copy is every rank's, so rank 0 writes it alone
        state = {"step": self.step, "sampler": self.sampler.state(), "total": self.total,
                 "save_s": round(self.ckpt.last_save_s or self.carried_save_s, 3)}  # the next segment's first budget
        keep_ref = self.ref is not None and self.cfg["sft_steps"] > 0  # else ref = the base model on disk
        if self.fsdp:
            self._save_parts(state, self.ref if keep_ref else None, background)
        else:
            self._collective(lambda: self.ckpt.save_now(self.step, self.model, self.optimizer, state,
                                                        self.ref if keep_ref else None, background))
        self.saved_step = self.step

    def _save_parts(self, state: dict, ref, background) -> None:
        """Sharded (fsdp): every rank writes the whole tensors it owns (parts.py); the gathering
        is the snapshot, the writing may go on in the background."""
        self._collective(self.ckpt.wait, every_rank=True)  # the last save is sealed; its buffers free
        part, index = fsdp.owned_part(self.model, self.optimizer, self.dist.rank, self.dist.world, ref)
        made = {}
        self._collective(lambda: made.update(tmp=str(self.ckpt.store.new_tmp_dir())))
        tmp = self.dist.gather(made.get("tmp"))[0]  # rank 0's directory, for every rank to write into
        common = None
        if self.dist.is_main:  # the reference's tensors are in the parts, like the model's
            common = {"ref": None, "rng": checkpoint.rng_state(), "state": state, "config": self.model.config,
                      "index": index}
        self._collective(lambda: self.ckpt.save_part(self.step, tmp, part, self.dist.rank, self.dist.world, common,
                                                     background, wait_s=self.cfg["dist_timeout_s"]),
                         every_rank=True)

    def _resume(self) -> bool:
        t0 = time.monotonic()
        if self.dist.enabled:  # each rank reads a share of the files and sends what it read to the others
            # (fsdp: each rank its shards; ddp: whole tensors, broadcast), once every rank found the
            # same newest checkpoint intact (else RanksDisagree on every rank, in one line)
            _, path, share = checkpoint.restore_share(self.ckpt, self.dist.rank, self.dist.world, self.dist.gather,
                                                      ref=self.ref is not None)
            state = False  # nothing is read into the model before every rank's share is intact
            if path is not None:
                fsdp.scatter_share(self.model, self.optimizer, self.dist, *share, ref=self.ref)
                state = checkpoint.load_common(path)
        else:
            _, path, state = self.ckpt.restore(self.model, self.optimizer, self.ref)
        load_s = time.monotonic() - t0
        self.dist.barrier()  # every rank has read it before rank 0 may write (and prune) again
        if path is None:
            if state:  # a damaged checkpoint was partly read into the weights: start clean
                self._say("no intact checkpoint; starting from the base model")
                if self.fsdp:  # each rank reads its rows of the base weights again
                    with torch.no_grad():
                        fsdp.copy_shards(self._load_sharded(), self.model)
                        if self.ref is not None:
                            fsdp.copy_shards(self._load_sharded(), self.ref)
                else:
                    base, _ = policy.load_policy(self.model_dir, self.device)
                    self.model.load_state_dict(base.state_dict())
                    if self.ref is not None:
                        self.ref.load_state_dict(base.state_dict())
                self._sync_rollout()
            return False
        self.step = self.saved_step = int(state["step"])
        self.carried_save_s = float(state.get("save_s") or 0.0)
        self.sampler = EpochSampler(len(self.train_ids), self.cfg["seed"], **state["sampler"])
        self._sync_rollout()  # a vLLM engine started from the base weights
        self._say(f"resumed from {path} at step {self.step} of {self.total} (load {load_s:.2f} s)")
        return True

    # ------------------------------------------------------------------ steps

    def _one_step(self) -> bool:
        t0 = time.monotonic()
        comm0 = self.dist.comm_s
        if self.step < self.cfg["sft_steps"]:
            record = self._sft_step()
        else:
            record = self._rl_step()
        if record is None:
            return False
        self.step += 1
        dt = time.monotonic() - t0
        self.step_s = max(dt, 0.7 * self.step_s)  # decays, but one slow step is remembered
        record.update(step=self.step, step_time_s=round(dt, 4),
                      tokens_per_s=round(record.pop("_tokens") / max(dt, 1e-9), 1))
        if self.dist.enabled:  # time in collectives, waiting for the slowest rank included
            record["timing_s/comm"] = round(self.dist.comm_s - comm0, 4)
        self.log.write(record)
        return True

    def _end_of_warmup(self) -> None:
        """The warmed-up model becomes the KL reference; its score shows what RL starts from."""
        if self.ref is not None:
            if self.fsdp:
                fsdp.copy_shards(self.model, self.ref)
            else:
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
        rows = self.sampler.next(cfg["batch_size"] * cfg["group_size"])
        # whole groups per rank, as in RL; each row's target drawn from the row's own stream
        mine = self.dist.share(cfg["batch_size"])
        pos = range(mine.start * cfg["group_size"], mine.stop * cfg["group_size"])
        targets = [warmup.format_target(self.train_ex[rows[j]], random.Random(stream_seed(cfg["seed"], self.step, j)),
                                        cfg["countdown_ops"]) for j in pos]
        with self._compute():
            loss, ntok = warmup.sft_loss(self.model, self.tok, [self.train_ids[rows[j]] for j in pos], targets,
                                         self.device)
        # a mean over every rank's target tokens: this rank's share of them weighs its mean
        all_tok = self.dist.sum([ntok])[0]
        self.optimizer.zero_grad(set_to_none=True)
        (loss * (ntok / all_tok * self._loss_scale()) if self.dist.enabled else loss).backward()
        self._reduce_grads()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg["max_grad_norm"])
        self.optimizer.step()
        self._sync_rollout()
        mean = self.dist.sum([loss.item() * ntok])[0] / all_tok
        return {"phase": "sft", "loss": round(mean, 6), "lr": lr, "_tokens": int(all_tok)}

    def _rl_lr(self) -> float:
        rl_step = self.step - self.cfg["sft_steps"]
        warm = self.cfg["lr_warmup_steps"]
        return self.cfg["lr"] * (min(1.0, (rl_step + 1) / warm) if warm else 1.0)

    def _rl_step(self) -> dict:
        cfg = self.cfg
        lr = self._set_lr(self._rl_lr())
        G = cfg["group_size"]
        idx = self.sampler.next(cfg["batch_size"])
        mine = self.dist.share(len(idx))  # whole groups: this rank's prompts and all their samples
        # each prompt's samples from its own (seed, step, position) stream (vLLM: its per-request seed)
        streams = {}
        if cfg["rollout"] == "hf":
            streams["generators"] = [generator(self.device, cfg["seed"], self.step, p) for p in mine]
        elif cfg["rollout"] == "vllm":
            streams["seeds"] = [stream_seed(cfg["seed"], self.step, p) for p in mine]
        with self._for_generation():  # no collective per token: ranks decode at their own pace
            batch = self.rollout.generate([self.train_ids[idx[p]] for p in mine], n=G, abort=self._stop_requested,
                                          **streams)
        if self.dist.agree_stop("SIGUSR1" if batch is None else None) is not None:
            self._say(f"step {self.step + 1} abandoned in its rollout: stop requested")
            return None
        examples = [self.train_ex[idx[p]] for p in mine for _ in range(G)]
        t_reward = time.monotonic()
        values, reward_metrics = self.reward(examples, batch.texts, dist=self.dist)
        local = torch.tensor(values, dtype=torch.float32)
        reward_metrics["timing_s/reward"] = round(time.monotonic() - t_reward, 4)
        adv = algos.group_advantages(local, G, scale_by_std=ALGORITHMS[cfg["algorithm"]].scale_by_std)
        self._release_rollout()
        stats = self._update(batch, adv.to(self.device), row0=mine.start * G)
        self._sync_rollout()
        ntok = int(batch.response_mask.sum().item())
        if self.dist.enabled:  # the step's figures over the global batch, in its order
            parts = self.dist.gather((values, ntok))
            scores = torch.tensor([v for vals, _ in parts for v in vals], dtype=torch.float32)
            ntok = sum(n for _, n in parts)
        else:
            scores = local
        return {"phase": "train", "reward_mean": round(scores.mean().item(), 6),
                "reward_std": round(scores.std().item() if len(scores) > 1 else 0.0, 6),
                "solve_rate": round((scores >= 1.0).float().mean().item(), 6),
                "response_len_mean": round(ntok / len(scores), 3), "lr": lr, "_tokens": ntok, **stats,
                **reward_metrics}

    def _stop_requested(self) -> bool:
        """A stop seen by this rank alone (no collective: ranks reach this point at different
        times); the ranks agree right after the phase."""
        return self.stop.poll_stop_file() or self.stop.term or self.stop.should_stop(save_s=self._save_budget_s())

    def _update(self, batch, adv, row0: int = 0) -> dict:
        """ppo_epochs passes of mini_batches optimizer steps over one rollout batch.

        The mini-batches are cut from the global batch (rows row0.. are this rank's), in an order
        drawn from the (seed, step, epoch) stream, so they are the same on any number of ranks."""
        cfg = self.cfg
        n = adv.shape[0]
        total = cfg["batch_size"] * cfg["group_size"]
        size = total // cfg["mini_batches"]
        single = cfg["ppo_epochs"] * cfg["mini_batches"] == 1
        ref_logp = None
        if self.ref is not None:
            with fsdp.gathered(self.ref, self.fsdp):  # as the policy's no-grad passes below
                ref_logp = self._logprobs_no_grad(self.ref, batch)
        mismatch = {}
        if not single:
            # The ratio's denominator is the trainer's own forward, never the sampler's log-probs:
            # another engine's kernels (vLLM, bf16) differ from the trainer's, and a ratio built on
            # them measures that mismatch (GSPO's 3e-4 clip would clip on it alone). The sampler's
            # are only compared, as rollout/logp_mismatch.
            sampled = batch.old_logp
            with fsdp.gathered(self.model, self.fsdp):  # the ranks' row counts (passes) may differ
                batch.old_logp = self._logprobs_no_grad(self.model, batch)
            mismatch = self._logp_mismatch(sampled, batch)
        losses, last = [], {}
        for epoch in range(cfg["ppo_epochs"]):
            order = (torch.randperm(total, generator=generator("cpu", cfg["seed"], self.step, "epoch", epoch))
                     if cfg["mini_batches"] > 1 else torch.arange(total))
            for start in range(0, total, size):
                chunk = order[start:start + size]
                local = chunk[(chunk >= row0) & (chunk < row0 + n)] - row0
                loss, last = self._optimizer_step(batch, local, adv, ref_logp, single, global_rows=len(chunk))
                losses.append(loss)
        if self.dist.enabled:  # the last mini-batch's statistics, averaged over the ranks that had rows
            got = [d for d in self.dist.gather(last) if d]
            last = {k: (None if any(d[k] is None for d in got) else sum(d[k] for d in got) / len(got))
                    for k in got[0]}
        kl = last.pop("kl_ref")
        return {"loss": round(sum(losses) / len(losses), 6), "kl": round(kl, 6) if kl is not None else 0.0,
                **{k: round(v, 6) for k, v in last.items()}, **mismatch}

    def _logp_mismatch(self, sampled, batch) -> dict:
        """The sampler's log-probs against the trainer's: mean |difference| per response token over
        the global batch (every rank calls it: a collective, even with no sampler log-probs)."""
        mask = batch.response_mask
        local = [0.0, 0.0] if sampled is None else [((sampled - batch.old_logp).abs() * mask).sum().item(),
                                                    mask.sum().item()]
        have = self.dist.max([float(sampled is not None)])[0]
        if not have:
            return {}
        total, count = self.dist.sum(local)
        return {"rollout/logp_mismatch": round(total / max(count, 1.0), 6)}

    def _optimizer_step(self, batch, idx, adv, ref_logp, single, global_rows=None) -> tuple[float, dict]:
        """One optimizer step on rows `idx` (this rank's part of a mini-batch of `global_rows`),
        gradients accumulated over micro-batches, then summed over ranks: every weight below is
        this rank's share of the global mini-batch, so the sum is the global mean."""
        cfg = self.cfg
        micro = self._rows_per_pass(max(1, len(idx)))
        passes = -(-len(idx) // micro)
        all_tokens = batch.response_mask[idx].sum()
        if self.dist.enabled:
            all_tokens = all_tokens.new_tensor(self.dist.sum([all_tokens.item()])[0])
        if self.fsdp:  # every forward/backward is a collective: each rank runs the most any rank has
            passes = max(1, int(self.dist.max([passes])[0]))
        all_tokens = all_tokens.clamp(min=1.0)
        global_rows = global_rows or len(idx)
        self.optimizer.zero_grad(set_to_none=True)
        total, stats = 0.0, {}
        for k in range(passes):
            sub = idx[k * micro:(k + 1) * micro]
            dummy = len(sub) == 0  # this rank has no rows left: one row of its batch, weighted 0
            if dummy:
                sub = torch.arange(1)
            mb = batch.select(sub)
            with self._compute():
                logp = policy.response_logprobs(self.model, mb.prompt_ids, mb.prompt_mask, mb.response_ids,
                                                mb.response_mask, cfg["temperature"], cfg["group_size"],
                                                cfg["logit_chunk_tokens"])
            # one update per batch: the policy *is* the sampler, so old = logp without a pass
            old = logp.detach() if single or mb.old_logp is None else mb.old_logp
            loss, got = algos.policy_loss(
                logp, old, adv[sub], mb.response_mask, cfg["algorithm"], cfg["clip_low"], cfg["clip_high"],
                cfg["loss_agg"], None if ref_logp is None else ref_logp[sub], cfg["beta"],
                norm_len=cfg["max_response_length"])
            # each micro loss is a mean over its own rows: weight it into the mean over all of idx
            weight = mb.response_mask.sum() / all_tokens if cfg["loss_agg"] == "token-mean" else len(sub) / global_rows
            if dummy:
                weight = weight * 0.0
            else:
                stats = got
            (loss * (weight * self._loss_scale())).backward()
            total += loss.item() * float(weight)
        self._reduce_grads()
        if self.dist.enabled:
            total = self.dist.sum([total])[0]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg["max_grad_norm"])
        self.optimizer.step()
        return total, stats

    def _for_generation(self):
        """The context of a generation: the HF engines run the training model, whose weights fsdp
        gathers for the whole phase (and in the compute dtype); vLLM holds its own weights, so
        nothing is gathered for it."""
        import contextlib

        if self.cfg["rollout"] == "vllm":
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(fsdp.gathered(self.model, self.fsdp))
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
        if self.cfg["rollout"] != "vllm":
            self.rollout.sync_weights(self.model)
            return
        self.optimizer.zero_grad(set_to_none=True)
        self.rollout.sync_weights(fsdp.stream_weights(self.model, getattr(torch, self.cfg["dtype"])))

    def _loss_scale(self) -> float:
        # FSDP's reduce-scatter averages over the ranks; the weights above make a global mean
        # that the ddp path sums, so fsdp multiplies the loss back by the world size
        return float(self.dist.world) if self.fsdp else 1.0

    def _reduce_grads(self) -> None:
        if not self.fsdp:  # under fsdp the backward itself reduce-scattered them
            self.dist.all_reduce_grads(self.model.parameters())

    @torch.no_grad()
    def _logprobs_no_grad(self, model, batch):
        micro = self._rows_per_pass(batch.response_ids.shape[0])
        parts = []
        for start in range(0, batch.response_ids.shape[0], micro):
            mb = batch.select(torch.arange(start, min(start + micro, batch.response_ids.shape[0])))
            with self._compute():
                parts.append(policy.response_logprobs(model, mb.prompt_ids, mb.prompt_mask, mb.response_ids,
                                                      mb.response_mask, self.cfg["temperature"],
                                                      self.cfg["group_size"], self.cfg["logit_chunk_tokens"]))
        return torch.cat(parts)

    # ------------------------------------------------------------------ evaluation

    def _evaluate(self, phase: str) -> dict | None:
        """Greedy decoding on the val split; None when a stop request cut it short."""
        t0 = time.monotonic()
        scores, extra = [], {}
        bs = self.cfg["eval_batch_size"]
        mine = self.dist.share(len(self.val_ids))  # each rank decodes its share of the split
        abandoned = False
        # fork: evaluation must not change the training's random stream; gathered (fsdp): the
        # weights all-gathered once for the phase, so ranks with more batches need no collective
        with torch.random.fork_rng(), self._for_generation():
            for start in range(mine.start, mine.stop, bs):
                # a local check per batch (and inside the decoding); the ranks agree after the loop
                if self._stop_requested():
                    abandoned = True
                    break
                stop = min(start + bs, mine.stop)
                batch = self.rollout.generate(self.val_ids[start:stop], n=1, greedy=True,
                                              abort=self._stop_requested)
                if batch is None:
                    abandoned = True
                    break
                # val_ids holds only the first eval_size rows: score exactly the rows generated
                values, metrics_ = self.reward(self.val_ex[start:start + len(batch.texts)], batch.texts)
                scores.extend(values)
                for k, v in metrics_.items():  # weighted by batch size into a mean over the split
                    extra[k] = extra.get(k, 0.0) + v * len(values)
        if self.dist.agree_stop("SIGUSR1" if abandoned else None) is not None:
            self._say(f"{phase} abandoned: stop requested ({self.stop.reason or 'deadline'})")
            return None
        if self.dist.enabled:
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
        if phase in ("eval_before", "eval_sft"):  # the later one (after the warm-up) is what RL starts from
            self.before_rl = result
        elif phase == "eval_after" and getattr(self, "before_rl", None):
            b = self.before_rl
            self._say(f"pass rate (accuracy) before RL -> after: {b['eval/accuracy']:.3f} -> {result['eval/accuracy']:.3f}; "
                f"reward_mean {b['eval/reward_mean']:.3f} -> {result['eval/reward_mean']:.3f}")
        return result


# the rule rewards score 1.0 for a right answer: for them "accuracy" (scores >= 1.0) is the solve rate
RULE_REWARDS = ("auto", "countdown", "gsm8k", "gsm8k_flexible", "code")


def _accuracy_note(cfg: dict) -> str:
    """What accuracy means beside a reward that is not one of the rule rewards (its scale is the
    user's: 0.000 may only say that no answer scored a full 1.0)."""
    if all(name in RULE_REWARDS for _, name in reward_mix.parse_terms(cfg["reward"])):
        return ""
    return " (the share of answers scoring >= 1.0: a custom reward's scale may never reach it)"
