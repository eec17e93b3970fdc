"""The built-in trainer with test-only delays, for tests that race it with signals or kill -9.

    python tests/rl/hooked_train.py [--step-delay-s S] [--save-pause-s S] --config trainer.json

--step-delay-s  sleep S inside every training step (counted in its step time), so a signal
                test is not a race with a fast loop
--save-pause-s  sleep S inside every checkpoint save, once its files are written and before it
                is sealed (manifest, rename, pointer), so a test can kill -9 a half-written save
--eval-delay-s  sleep S inside every evaluation batch's decoding (a long evaluation, so a stop
                arrives in the middle of one)
--ckpt-dir-of-rank R=DIR  rank R's checkpoint directory is DIR (a node whose file system is not the
                others': what one machine cannot otherwise show)
--sampler-logp-shift X  the HF rollout reports log-probs X above the policy's own, as a sampler
                with other kernels would (a test double of vLLM's log-probs)
--deadline-in-s S  the deadline is S seconds after the first step begins, not a time the caller
                chose before the process started: the deadline test's clock starts once the
                trainer is ready (imports, model and data took over 40 s, and then over 20 s
                past the imports, under the whole suite's load beside a hog: no step was reached)
--usr1-in-rollout-of-step K  a SIGUSR1 to itself as step K's rollout begins (its rows drawn,
                nothing decoded yet), and the HF rollout asks for a stop after every token (not
                every 8th: a tiny model's responses are shorter): the stop that abandons a step,
                not a race with the clock
--grads-dir D   after every optimizer step's gradient reduction (before clipping and AdamW), rank
                0 writes the whole gradients to D/grads-STEP-K.pt (K: the step's K-th update)

The trainer itself carries no test hooks: this wrapper patches its functions and then runs
hpcrl.rl.train's main, as `python -m hpcrl.rl.train` would. (The patches import torch before
main installs its signal handlers; the tests signal only once steps have run.)
"""

from __future__ import annotations

import argparse
import functools
import time


def delayed(fn, seconds: float):
    """`fn`, then a sleep of `seconds`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        result = fn(*args, **kwargs)
        time.sleep(seconds)
        return result

    return wrapper


def dump_grads(grads_dir: str) -> None:
    """Gradients as the optimizer will see them: reduced over the ranks (fsdp: gathered whole, a
    collective every rank makes in the same order), unclipped."""
    import torch

    from hpcrl.rl.loop import RLTrainer

    reduce = RLTrainer._reduce_grads

    @functools.wraps(reduce)
    def dumping(self):
        reduce(self)
        grads = {}
        for name, p in self.model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu().clone()
        k = self.__dict__.get("_grads_k", {}).get(self.step, 0)
        self.__dict__.setdefault("_grads_k", {})[self.step] = k + 1
        if self.dist.is_main:
            torch.save(grads, f"{grads_dir}/grads-{self.step + 1}-{k}.pt")

    RLTrainer._reduce_grads = dumping


def shift_sampler_logprobs(shift: float) -> None:
    import torch

    from hpcrl.rl import policy, rollout

    generate = rollout.HFRollout.generate

    @functools.wraps(generate)
    def wrapper(self, prompts, n=1, greedy=False, generators=None, abort=None):
        batch = generate(self, prompts, n, greedy, generators, abort)
        if batch is not None and not greedy:
            with torch.no_grad():
                own = policy.response_logprobs(self.model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                               batch.response_mask, self.temperature)
            batch.old_logp = (own + shift) * batch.response_mask
        return batch

    rollout.HFRollout.generate = wrapper


def usr1_in_rollout_of_step(k: int) -> None:
    import os
    import signal

    from hpcrl.rl import rollout
    from hpcrl.rl.loop import RLTrainer

    rollout.ABORT_EVERY = 1  # read at each token; how often it asks changes no number
    episodes = RLTrainer._episodes

    @functools.wraps(episodes)
    def wrapper(self, *args, **kwargs):
        if self.step + 1 == k:
            os.kill(os.getpid(), signal.SIGUSR1)  # delivered before kill() returns: the handler has run
        return episodes(self, *args, **kwargs)

    RLTrainer._episodes = wrapper


def install(step_delay_s: float = 0.0, save_pause_s: float = 0.0, eval_delay_s: float = 0.0,
            grads_dir: str | None = None) -> None:
    """Patch this process's trainer: every step and every save take that much longer."""
    if grads_dir:
        dump_grads(grads_dir)
    if step_delay_s:
        from hpcrl.rl.loop import RLTrainer

        RLTrainer._sft_step = delayed(RLTrainer._sft_step, step_delay_s)
        RLTrainer._rl_step = delayed(RLTrainer._rl_step, step_delay_s)
    if save_pause_s:
        from hpcrl.checkpoints.trainer import checkpointer

        checkpointer.write_snapshot = delayed(checkpointer.write_snapshot, save_pause_s)
    if eval_delay_s:
        from hpcrl.rl import rollout

        def slow_eval(generate):
            @functools.wraps(generate)
            def wrapper(self, prompts, n=1, greedy=False, generators=None, abort=None):
                if greedy:  # evaluation decodes greedily: sleep in slices, asking abort() between them
                    for _ in range(20):
                        if abort is not None and abort():
                            return None
                        time.sleep(eval_delay_s / 20)
                return generate(self, prompts, n, greedy, generators, abort)
            return wrapper

        rollout.HFRollout.generate = slow_eval(rollout.HFRollout.generate)


def deadline_from_first_step(seconds: float) -> None:
    """The trainer's deadline (ctx.deadline, which every stop check reads afresh) set when its
    first step, warm-up or RL, begins; printed for the test as HPCRL_DEADLINE=T on stderr."""
    import sys

    from hpcrl import protocol
    from hpcrl.rl.loop import RLTrainer

    def first_sets_it(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            if not self.__dict__.get("_hooked_deadline"):
                self._hooked_deadline = self.ctx.deadline = time.time() + seconds
                print(f"hooked_train: {protocol.ENV_DEADLINE}={self.ctx.deadline!r}", file=sys.stderr, flush=True)
            return fn(self, *args, **kwargs)
        return wrapper

    RLTrainer._sft_step = first_sets_it(RLTrainer._sft_step)
    RLTrainer._rl_step = first_sets_it(RLTrainer._rl_step)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hooked_train.py", add_help=False)
    parser.add_argument("--step-delay-s", type=float, default=0.0)
    parser.add_argument("--save-pause-s", type=float, default=0.0)
    parser.add_argument("--eval-delay-s", type=float, default=0.0)
    parser.add_argument("--deadline-in-s", type=float)
    parser.add_argument("--grads-dir")
    parser.add_argument("--usr1-in-rollout-of-step", type=int)
    parser.add_argument("--ckpt-dir-of-rank")
    parser.add_argument("--sampler-logp-shift", type=float)
    ns, rest = parser.parse_known_args(argv)
    if ns.sampler_logp_shift is not None:
        shift_sampler_logprobs(ns.sampler_logp_shift)
    if ns.ckpt_dir_of_rank:
        import os

        rank, directory = ns.ckpt_dir_of_rank.split("=", 1)
        if os.environ.get("RANK") == rank:
            os.environ["HPCRL_CKPT_DIR"] = directory
    install(ns.step_delay_s, ns.save_pause_s, ns.eval_delay_s, ns.grads_dir)
    if ns.usr1_in_rollout_of_step:
        usr1_in_rollout_of_step(ns.usr1_in_rollout_of_step)
    from hpcrl.rl import train

    if ns.deadline_in_s is not None:
        deadline_from_first_step(ns.deadline_in_s)
    return train.main(rest)


if __name__ == "__main__":
    from hpcrl.rl import train

    train.leave(main())  # as the real entry point leaves: under torchrun without gloo's teardown
