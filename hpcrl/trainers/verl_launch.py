"""Job-side launcher for verl: decides the run-time overrides, runs verl, stops it after its last save.

Stdlib only, and standalone on purpose: the adapter copies this file into the run directory
(`verl/launch.py`), so the job needs neither hpcrl in its venv nor a shell trick to use values
known only when the segment starts (segment number, deadline, WANDB_API_KEY). The argv the
batch script shows is the whole static verl command line; this script only appends:

    trainer.val_before_train=False      on every segment after the first (verl reruns it on
                                        every restart otherwise)
    trainer.logger=[console,file(,wandb)]  wandb only when WANDB_API_KEY is set
    trainer.save_freq=N                 in `periodic` mode, sized from step times measured in
                                        earlier segments (`--save-every-s`)
    +ray_kwargs.ray_init.runtime_env.env_vars.*   the deadline as verl's ESI expiration timestamp
                                        and the per-segment metrics file, so they reach the Ray
                                        actors that read them (the driver's env does not,
                                        when the Ray cluster was started before it)

verl handles no signal, so this script is what talks the walltime protocol: verl exiting 0 by
itself means training is complete (exit 0); once verl has saved a checkpoint and another step
plus a save would not fit before the deadline, the script stops verl and exits EXIT_CONTINUE.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

# The walltime protocol's names (hpcrl/protocol.py), repeated: this file runs in the job's own
# interpreter, which may not have hpcrl; tests/test_verl.py keeps them equal.
EXIT_CONTINUE = 85
EXIT_UNSAVED_END = 1  # a failure: the run must not read COMPLETED without its last steps saved
ENV_RUN_DIR, ENV_SEGMENT, ENV_DEADLINE, ENV_METRICS = "HPCRL_RUN_DIR", "HPCRL_SEGMENT", "HPCRL_DEADLINE", "HPCRL_METRICS"
ERROR_FILE = "trainer_error.txt"  # protocol.ERROR_FILE (this file is standalone: tests check they agree)
TRACKER = "latest_checkpointed_iteration.txt"
ESI_ENV = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"
ESI_SAVE_S = 60  # verl's should_save_ckpt_esi(save_ckpt_duration=60) default
METRICS_DIR = "verl-metrics"
# Inside its deadline window verl force-saves at EVERY step (checkpoint_manager.py
# should_save_ckpt_esi is not one-shot), so each poll interval past the first deadline save costs
# a whole checkpoint write per step: poll often (a stat and a small read).
POLL_S = 1.0
STOP_GRACE_S = 60.0
# verl logs a step's metrics after its save (ray_trainer.fit: _save_checkpoint, then logger.log):
# a stop sent the moment the tracker moves can lose the saved step's record. Wait this long for it.
METRICS_WAIT_S = 30.0
# verl metric -> hpcrl metrics.jsonl key (what `status` shows)
METRIC_KEYS = {
    "critic/score/mean": "reward",
    "timing_s/step": "step_s",
    "actor/pg_loss": "pg_loss",
    "response_length/mean": "response_len",
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="verl/launch.py", description=__doc__.splitlines()[0])
    p.add_argument("--python", required=True, help="interpreter that runs verl.trainer.main_ppo")
    p.add_argument("--ckpt-dir", required=True, help="trainer.default_local_dir")
    p.add_argument("--save-mode", choices=("deadline", "periodic"), default="deadline")
    p.add_argument("--save-freq", type=int, required=True, help="steps between regular saves")
    p.add_argument("--save-every-s", type=float, default=0.0, help="periodic: target seconds between saves")
    p.add_argument("--save-time-s", type=float, default=300.0, help="what one save may take")
    p.add_argument("--logger", default="auto", help="auto | console | wandb")
    p.add_argument("--keep", type=int, default=0, help="checkpoints to keep across segments (0: all)")
    p.add_argument("--dry-run", action="store_true", help="print the verl argv and env, run nothing")
    p.add_argument("overrides", nargs="*", help="the static Hydra overrides (after --)")
    return p.parse_args(argv)


# ------------------------------------------------------------------ pure decisions


def segment_of(env) -> int:
    try:
        return max(1, int(env.get(ENV_SEGMENT) or 1))
    except ValueError:
        return 1


def deadline_of(env) -> float | None:
    try:
        return float(env[ENV_DEADLINE])
    except (KeyError, ValueError):
        return None


def metrics_path(run_dir: Path, segment: int) -> Path:
    # verl's FileLogger opens its file with "wb": one file per segment, or a resume erases history
    return run_dir / METRICS_DIR / f"segment-{segment:03d}.jsonl"


def read_verl_metrics(path: Path, offset: int = 0) -> tuple[list[dict], int]:
    """Complete JSON lines of verl's FileLogger ({"step": N, "data": {...}}) from `offset` on."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except OSError:
        return [], offset
    end = chunk.rfind(b"\n") + 1  # a torn last line is read on the next poll
    records = []
    for line in chunk[:end].splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("data"), dict):
            records.append(rec)
    return records, offset + end


def step_times(records) -> list[float]:
    out = []
    for rec in records:
        value = rec["data"].get("timing_s/step")
        if isinstance(value, (int, float)) and value > 0:
            out.append(float(value))
    return out


def past_step_times(run_dir: Path, segment: int) -> list[float]:
    times = []
    for seg in range(1, segment):
        records, _ = read_verl_metrics(metrics_path(run_dir, seg))
        times += step_times(records)
    return times


def sized_save_freq(opts, times: list[float]) -> int:
    """periodic mode: the save interval in steps that matches --save-every-s at the slowest step seen."""
    if opts.save_mode != "periodic" or opts.save_every_s <= 0 or not times:
        return opts.save_freq
    return max(1, int(opts.save_every_s // max(times)))


def hydra_str(value: str) -> str:
    """A Hydra override value that stays one string (quoted; verl needs env_vars as str)."""
    # Hydra's quoted strings: a backslash is literal unless it precedes a quote or ends the string
    escaped = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, str(value))
    return "'" + escaped.replace("'", "\\'") + "'"


def hydra_unquote(quoted: str) -> str:
    """The inverse of hydra_str: a quote is preceded by 2R+1 backslashes, the end by 2R."""
    body = quoted[1:-1]
    return re.sub(r"(\\*)('|$)", lambda m: "\\" * ((len(m.group(1)) - bool(m.group(2))) // 2) + m.group(2), body)


def runtime_overrides(opts, env, run_dir: Path, times: list[float]) -> list[str]:
    """The overrides only the running segment can know; appended after the static ones."""
    segment = segment_of(env)
    out = []
    if segment > 1:
        out.append("trainer.val_before_train=False")
    loggers = ["console", "file"]
    if opts.logger == "wandb" or (opts.logger == "auto" and env.get("WANDB_API_KEY")):
        loggers.append("wandb")
    out.append(f"trainer.logger=[{','.join(loggers)}]")
    out.append(f"trainer.save_freq={sized_save_freq(opts, times)}")
    env_vars = {"VERL_FILE_LOGGER_PATH": str(metrics_path(run_dir, segment))}
    deadline = deadline_of(env)
    if opts.save_mode == "deadline" and deadline is not None:
        env_vars[ESI_ENV] = str(int(deadline))
    for key, value in env_vars.items():
        out.append(f"+ray_kwargs.ray_init.runtime_env.env_vars.{key}={hydra_str(value)}")
    return out


def should_stop(opts, seconds_left: float, times: list[float]) -> bool:
    """After a save: stop verl when the next save could not complete before the deadline."""
    if not times:
        return False  # no step measured yet: nothing to size the decision with
    steps_to_next_save = 1 if opts.save_mode == "deadline" else max(1, opts.save_freq)
    need_s = steps_to_next_save * max(times) + opts.save_time_s + ESI_SAVE_S
    return seconds_left < need_s


def read_tracker(ckpt_dir: Path) -> int | None:
    try:
        text = (ckpt_dir / TRACKER).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return int(text) if re.fullmatch(r"\d+", text) else None


PATH_KEYS = ("data.train_files", "data.val_files", "actor_rollout_ref.model.path", "critic.model.path")


def expand_paths(overrides: list[str], env) -> list[str]:
    """$VAR and ~ in model/data paths are expanded here, in the job, where $SCRATCH etc. are set
    (the batch script passes every argv element quoted, so the shell never expands them)."""
    out = []
    for ov in overrides:
        key, sep, value = ov.partition("=")
        if sep and key in PATH_KEYS and ("$" in value or "~" in value):
            if len(value) >= 2 and value[0] == value[-1] == "'":
                value = hydra_unquote(value)
            expanded = os.path.expanduser(_expandvars(value, env))
            ov = f"{key}={hydra_str(expanded)}"
        out.append(ov)
    return out


def _expandvars(text: str, env) -> str:
    return re.sub(r"\$(\w+)|\$\{(\w+)\}", lambda m: env.get(m.group(1) or m.group(2), m.group(0)), text)


def prune_checkpoints(ckpt_dir: Path, keep: int) -> list[Path]:
    """verl rotates only the saves of its own process, so segments pile up global_step_* dirs:
    keep the `keep` newest up to the tracker's step, drop torn ones above it (verl rewrites them)."""
    latest = read_tracker(ckpt_dir)
    if latest is None or keep < 1:
        return []
    found = sorted((int(p.name[12:]), p) for p in ckpt_dir.glob("global_step_*") if p.name[12:].isdigit())
    kept = [s for s, _ in found if s <= latest][-keep:]
    doomed = [p for s, p in found if s not in kept]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def unsaved_end(trained: int | None, saved: int | None, run_dir: Path | None = None) -> int:
    """verl exited 0: complete only if its last trained step is in a checkpoint. When
    trainer.total_training_steps exceeds epochs x batches verl's loop ends by running out of
    epochs, skips its is_last_step save and still exits 0: the end of training would be lost.
    The reason goes to the log and, for `status`, to RUN_DIR/ERROR_FILE (hpcrl/protocol.py)."""
    if trained is None or (saved is not None and saved >= trained):
        return 0
    reason = (f"verl ended at step {trained} but its newest checkpoint is step {saved}: the last "
              f"{trained - (saved or 0)} steps are not saved (its loop ran out of epochs before "
              f"total_training_steps; set args.total_training_steps to at most epochs x batches per epoch, "
              f"or leave it null)")
    print(f"hpcrl: {reason}", file=sys.stderr, flush=True)
    if run_dir is not None:
        try:
            (Path(run_dir) / ERROR_FILE).write_text(reason + "\n", encoding="utf-8")
        except OSError:
            pass
    return EXIT_UNSAVED_END


def hpcrl_record(rec: dict) -> dict:
    out = {"step": rec.get("step"), "trainer": "verl"}
    for src, dst in METRIC_KEYS.items():
        if isinstance(rec["data"].get(src), (int, float)):
            out[dst] = rec["data"][src]
    return out


# ------------------------------------------------------------------ process supervision


class Supervisor:
    """Runs verl in its own process group and watches its metrics and checkpoints."""

    def __init__(self, opts, argv, env, run_dir: Path, times: list[float]):
        self.opts, self.argv, self.env, self.run_dir = opts, argv, env, run_dir
        self.times = list(times)
        self.metrics_file = metrics_path(run_dir, segment_of(env))
        self.offset = 0
        self.last_ckpt = read_tracker(Path(opts.ckpt_dir))
        self.proc = None
        self.stopped_for_continue = False
        self.stop_after = None  # (saved step, when decided): stop once its metrics are logged
        self.last_logged = None  # the highest step verl logged a training record for

    def forward(self, signum, frame):
        if signum == signal.SIGTERM and self.proc is not None:
            self._signal_group(signal.SIGTERM)

    def _signal_group(self, sig):
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self):
        self._signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self.proc.wait()

    def poll_once(self) -> None:
        records, self.offset = read_verl_metrics(self.metrics_file, self.offset)
        self.times += step_times(records)
        for rec in records:
            if isinstance(rec.get("step"), int) and "timing_s/step" in rec["data"]:
                self.last_logged = max(rec["step"], self.last_logged or 0)
        sink = self.env.get(ENV_METRICS)
        if sink and records:
            with open(sink, "a", encoding="utf-8") as f:
                for rec in records:
                    f.write(json.dumps(hpcrl_record(rec), sort_keys=True) + "\n")
        step = read_tracker(Path(self.opts.ckpt_dir))
        deadline = deadline_of(self.env)
        if step is not None and step != self.last_ckpt:
            self.last_ckpt = step
            if (self.stop_after is None and deadline is not None
                    and should_stop(self.opts, deadline - time.time(), self.times)):
                self.stop_after = (step, time.monotonic())
        if self.stop_after is not None and not self.stopped_for_continue:
            saved, since = self.stop_after
            logged = self.last_logged is not None and self.last_logged >= saved
            late = time.monotonic() - since > METRICS_WAIT_S or (
                deadline is not None and deadline - time.time() < STOP_GRACE_S)
            if logged or late:
                print(f"hpcrl: verl saved step {saved}; the next save would not fit before the "
                      f"deadline: stopping verl for continuation"
                      f"{'' if logged else f' (its metrics for step {saved} did not come)'}", file=sys.stderr, flush=True)
                self.stopped_for_continue = True
                self.stop()

    def last_trained_step(self) -> int | None:
        """The highest step verl logged a training step for in this segment (step 0 = validation)."""
        records, _ = read_verl_metrics(self.metrics_file)
        steps = [r["step"] for r in records if isinstance(r.get("step"), int) and "timing_s/step" in r["data"]]
        return max(steps) if steps else None

    def run(self) -> int:
        Path(self.metrics_file).parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.argv, env=self.env, start_new_session=True)
        signal.signal(signal.SIGTERM, self.forward)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # verl saves by the deadline itself (ESI)
        while self.proc.poll() is None:
            time.sleep(POLL_S)
            self.poll_once()
        self.poll_once()
        if self.stopped_for_continue:
            return EXIT_CONTINUE
        if self.proc.returncode == 0:
            return unsaved_end(self.last_trained_step(), read_tracker(Path(self.opts.ckpt_dir)), self.run_dir)
        return self.proc.returncode if self.proc.returncode >= 0 else 128 - self.proc.returncode


def main(argv=None) -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    run_dir = Path(env.get(ENV_RUN_DIR) or Path(opts.ckpt_dir).parent)
    times = past_step_times(run_dir, segment_of(env))
    if not opts.dry_run:
        prune_checkpoints(Path(opts.ckpt_dir), opts.keep)
    verl_argv = [opts.python, "-m", "verl.trainer.main_ppo", *expand_paths(opts.overrides, env),
                 *runtime_overrides(opts, env, run_dir, times)]
    env["VERL_FILE_LOGGER_PATH"] = str(metrics_path(run_dir, segment_of(env)))
    if opts.save_mode == "deadline" and deadline_of(env) is not None:
        env[ESI_ENV] = str(int(deadline_of(env)))  # Ray started by the driver inherits this
    print("hpcrl: running " + " ".join(verl_argv), file=sys.stderr, flush=True)
    if opts.dry_run:
        print(json.dumps({"argv": verl_argv, "env": {k: env[k] for k in ("VERL_FILE_LOGGER_PATH", ESI_ENV) if k in env}}))
        return 0
    return Supervisor(opts, verl_argv, env, run_dir, times).run()


if __name__ == "__main__":
    sys.exit(main())
