"""The built-in trainer with test-only delays, for tests that race it with signals or kill -9.

    python tests/rl/hooked_train.py [--step-delay-s S] [--save-pause-s S] --config trainer.json

--step-delay-s  sleep S inside every training step (counted in its step time), so a signal
                test is not a race with a fast loop
--save-pause-s  sleep S inside every checkpoint save, once its files are written and before it
                is sealed (manifest, rename, pointer), so a test can kill -9 a half-written save
--eval-delay-s  sleep S inside every evaluation batch's decoding (a long evaluation, so a stop
                arrives in the middle of one)

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


def install(step_delay_s: float = 0.0, save_pause_s: float = 0.0, eval_delay_s: float = 0.0) -> None:
    """Patch this process's trainer: every step and every save take that much longer."""
    if step_delay_s:
        from hpcrl.rl.loop import RLTrainer

        RLTrainer._sft_step = delayed(RLTrainer._sft_step, step_delay_s)
        RLTrainer._rl_step = delayed(RLTrainer._rl_step, step_delay_s)
    if save_pause_s:
        from hpcrl.rl import checkpoint

        checkpoint.write_snapshot = delayed(checkpoint.write_snapshot, save_pause_s)
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hooked_train.py", add_help=False)
    parser.add_argument("--step-delay-s", type=float, default=0.0)
    parser.add_argument("--save-pause-s", type=float, default=0.0)
    parser.add_argument("--eval-delay-s", type=float, default=0.0)
    ns, rest = parser.parse_known_args(argv)
    install(ns.step_delay_s, ns.save_pause_s, ns.eval_delay_s)
    from hpcrl.rl import train

    return train.main(rest)


if __name__ == "__main__":
    from hpcrl.rl import train

    train.leave(main())  # as the real entry point leaves: under torchrun without gloo's teardown
