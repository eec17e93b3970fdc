"""Metrics as JSON lines (what `hpcrl status` reads), on stdout, and to wandb when configured."""

from __future__ import annotations

import os
import sys
import time

from .. import protocol


class MetricsLog:
    def __init__(self, path, run_dir, segment: int, wandb_project: str | None = None):
        self.path, self.segment = path, segment
        self._wandb = _start_wandb(wandb_project, run_dir) if wandb_project else None

    def write(self, record: dict) -> None:
        # "time": when the step ended, for the launcher's steps/s, ETA and wall-time columns
        record = {**record, "segment": self.segment, "time": round(time.time(), 3)}
        protocol.append_metrics(self.path, record)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])

    def log_samples(self, step: int, samples: list[dict]) -> None:
        """A step's kept samples as a wandb table (TRL's completions table), when wandb is on."""
        if self._wandb is None:
            return
        import wandb

        cols = ["step", "group", "prompt", "response", "reward", "reason", "advantage"]
        rows = [[s["step"], s["group"], "\n".join(str(t.get("content", "")) for t in s["turns"][:-1]),
                 s["turns"][-1].get("content", ""), s["reward"], s.get("reason") or "", s["advantage"]]
                for s in samples]
        self._wandb.log({"samples": wandb.Table(columns=cols, data=rows)}, step=step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports KiB, macOS bytes)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024, 1)


def say(msg: str) -> None:
    print(f"hpcrl.rl: {msg}", flush=True)


def _start_wandb(project: str, run_dir):
    """wandb only when importable; offline unless an API key is in the environment.

    The key is never written anywhere by hpcrl: wandb reads it from the environment itself.
    """
    try:
        import wandb
    except ImportError:
        print("hpcrl.rl: wandb_project is set but wandb is not installed; logging to metrics.jsonl only",
              file=sys.stderr)
        return None
    mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    run_name = os.path.basename(os.path.normpath(str(run_dir)))
    return wandb.init(project=project, name=run_name, id=run_name, resume="allow", mode=mode, dir=str(run_dir))
