"""The built-in RL trainer: `python -m hpcrl.rl.train --config trainer.json`.

Obeys hpcrl's walltime protocol: checks SIGUSR1 / SIGTERM / the deadline between steps, saves a
checkpoint, exits EXIT_CONTINUE; exits EXIT_COMPLETE once every step, the final checkpoint and the
final evaluation are done. A later segment resumes exactly (model, optimizer, RNGs, data position).

Order of one segment: [prepare model/data] -> load -> resume or evaluate-before -> steps
(supervised warm-up steps first, if any, then RL steps) -> final save -> evaluate-after.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

from .. import protocol

ERROR_FILE = protocol.ERROR_FILE  # the reason of the last failure, for `status`


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcrl.rl.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="trainer.json: the spec's args (see hpcrl/schemas/builtin.py)")
    ns = parser.parse_args(argv)
    ctx = protocol.Context.from_env()
    if (os.environ.get("RANK") or "0") == "0":  # a new attempt: the last failure's reason is history
        try:
            (ctx.run_dir / ERROR_FILE).unlink(missing_ok=True)
        except OSError:
            pass
    # Handlers go in before torch is imported: SIGUSR1's default action would kill the process.
    stop = protocol.StopFlag(ctx)
    from . import config

    try:
        cfg = config.load(ns.config)
    except config.ConfigError as e:
        print(f"hpcrl.rl: error: {e}", file=sys.stderr)
        return 2
    from .loop import RLTrainer
    from .policy import NoGPU

    try:
        trainer = RLTrainer(cfg, ctx, stop)
    except (FileNotFoundError, ValueError) as e:
        print(f"hpcrl.rl: error: {e}", file=sys.stderr)
        return 2
    except NoGPU as e:  # never the CPU in silence where GPUs were given: the reason for `status`
        report_failure(ctx, str(e))
        return 1
    except ImportError as e:  # a reward module (or what it imports) missing from this environment
        report_failure(ctx, f"args.reward {cfg.reward!r}: {e.__class__.__name__}: {e}; install it into the "
                            f"trainer's environment")
        return 2
    from ..checkpoints.trainer.checkpointer import RanksDisagree
    from .loop import SaveFailed
    from ..checkpoints.trainer.tensorfile import ModelMismatch

    try:
        return trainer.run()
    except ModelMismatch as e:
        print(f"hpcrl.rl: error: a checkpoint does not fit the model: {e} "
              "(resume with the model the run started with, or start a new run)", file=sys.stderr)
        return 2
    except SaveFailed as e:
        print(f"hpcrl.rl: error: {e}", file=sys.stderr, flush=True)
        return 1
    except RanksDisagree as e:  # a set-up fault, not a bug: a line for `status`, no traceback
        report_failure(ctx, str(e))
        return 1
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        where = e.filename or ctx.ckpt_dir
        report_failure(ctx, f"disk full at {where} (the previous checkpoint is intact; free space, then resume)")
        return 1


def report_failure(ctx: protocol.Context, reason: str) -> None:
    """One line on stderr (the segment log's last trainer line, which `status` shows for a failed
    segment) and in RUN_DIR/trainer_error.txt, best effort: on a full disk that write may fail too."""
    print(f"hpcrl.rl: error: {reason}", file=sys.stderr, flush=True)
    protocol.report_error(ctx.run_dir, reason)


def leave(code: int) -> None:
    """The process's exit with main()'s code (every entry point that runs main ends here)."""
    if int(os.environ.get("WORLD_SIZE") or 1) > 1:
        # Every rank has passed the final collective (and saved) or is failing anyway. gloo's
        # threads can abort a rank at teardown ("terminate called without an active exception",
        # SIGABRT) when its peer's sockets close first, which torchrun reports as a failed segment
        # (seen in full-suite runs): leave without the interpreter's and C++'s teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    leave(main())
