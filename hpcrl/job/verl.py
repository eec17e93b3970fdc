"""Job-side launcher for verl: decides the run-time overrides, runs verl, stops it after its last save.

Runs in the job as `python -m hpcrl.job.verl` (stdlib only, from the run's lib/ snapshot of
hpcrl, which the segment script puts on PYTHONPATH), so the job needs no shell trick to use values
known only when the segment starts (segment number, deadline, WANDB_API_KEY). The argv the
batch script shows is the whole static verl command line; this module only appends:

    trainer.val_before_train=False      on every segment after the first (verl reruns it on
                                        every restart otherwise)
    trainer.logger=[console,file(,wandb)]  wandb only when WANDB_API_KEY is set
    trainer.save_freq=N                 in `periodic` mode, sized from step times measured in
                                        earlier segments (`--save-every-s`)
    +ray_kwargs.ray_init.runtime_env.env_vars.*   the deadline as verl's ESI expiration timestamp,
                                        the per-segment metrics file, wandb's run id/resume/dir
                                        (every segment logs to one wandb run) and this segment's
                                        process tag, so they reach the Ray actors that read them
                                        (the driver's env does not, when the Ray cluster was
                                        started before it). Never a secret: the argv is logged.

verl handles no signal, so this module is what talks the walltime protocol, through the one
supervisor of hpcrl/job/supervisor.py: verl exiting 0 by itself means training is complete
(exit 0); once verl has saved a checkpoint and another step plus a save would not fit before the
deadline, it stops verl and exits EXIT_CONTINUE. What is verl's alone: its tracker file, its
FileLogger metrics, its ESI deadline window, its Ray actors outliving the driver.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

from hpcrl.job.supervisor import Supervisor, deadline_of, log, segment_of
from hpcrl.protocol import ENV_METRICS, next_save_fits
from hpcrl.samplestore import DEFAULT_MAX_MB
from hpcrl.job import verl_rollouts

TRACKER = "latest_checkpointed_iteration.txt"
ESI_ENV = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"
ESI_SAVE_S = 60  # verl's should_save_ckpt_esi(save_ckpt_duration=60) default
METRICS_DIR = "verl-metrics"
# verl dumps every step's generations (trainer.rollout_data_dir): older steps are thinned past this,
# at each segment's start and end (the built-in trainer's default budget for its samples)
ROLLOUTS_BUDGET = int(DEFAULT_MAX_MB * 1e6)
# In every process of this segment's verl (driver, local Ray, the job's Ray workers): the launcher
# waits for them all to be gone before it reads the final tracker and records.
TAG_ENV = "HPCRL_VERL_SEGMENT_TAG"
# verl's should_save_ckpt_esi adds this much to its window; the launcher moves the timestamp it
# feeds verl by as much, so the window is only the slowest step + save_time_s + STOP_MARGIN_S
STOP_MARGIN_S = 10.0  # a stop (SIGTERM, the driver and its actors exiting) takes a few seconds
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


# ------------------------------------------------------------------ pure decisions


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


def step_times(records, skip_first: bool = False) -> list[float]:
    """Seconds of each trained step. skip_first: drop the segment's first one, verl's warm-up
    (~20 x a later step here), when later ones exist: it says nothing about the next step."""
    out = []
    for rec in records:
        value = rec["data"].get("timing_s/step")
        if isinstance(value, (int, float)) and value > 0:
            out.append(float(value))
    return out[1:] if skip_first and len(out) > 1 else out


def past_step_times(run_dir: Path, segment: int) -> list[float]:
    times = []
    for seg in range(1, segment):
        records, _ = read_verl_metrics(metrics_path(run_dir, seg))
        times += step_times(records, skip_first=True)
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
    for key, value in actor_env(opts, env, run_dir).items():
        out.append(f"+ray_kwargs.ray_init.runtime_env.env_vars.{key}={hydra_str(value)}")
    return out


def wandb_run_id(run_dir: Path) -> str:
    """The run's id, as the built-in trainer names its wandb run (hpcrl/rl/metrics.py): the run
    directory's name, less what wandb forbids in an id."""
    return re.sub(r"[/\\#?%:]", "-", Path(run_dir).resolve().name) or "hpcrl"


def esi_timestamp(opts, deadline: float) -> int:
    """What verl reads as its expiration time: the deadline moved by verl's fixed 60 s less our stop
    margin, so verl's window (60 s + slowest step + esi_redundant_time) becomes slowest step +
    save_time_s + STOP_MARGIN_S before the deadline: a save that fits, then the stop."""
    return int(deadline + ESI_SAVE_S - STOP_MARGIN_S)


def actor_env(opts, env, run_dir: Path) -> dict[str, str]:
    """Environment verl's Ray actors need from this segment (through Ray's runtime env)."""
    segment = segment_of(env)
    out = {"VERL_FILE_LOGGER_PATH": str(metrics_path(run_dir, segment)), TAG_ENV: segment_tag(env, run_dir)}
    deadline = deadline_of(env)
    if opts.save_mode == "deadline" and deadline is not None:
        out[ESI_ENV] = str(esi_timestamp(opts, deadline))
    # one wandb run for all segments (resume=allow: the first creates it); verl's wandb.init
    # passes no id, so wandb reads these. The API key stays in the job's environment only.
    out.update({"WANDB_RUN_ID": wandb_run_id(run_dir), "WANDB_RESUME": "allow",
                "WANDB_DIR": env.get("WANDB_DIR") or str(run_dir)})
    return out


def segment_tag(env, run_dir: Path) -> str:
    return f"{Path(run_dir).resolve()}#{segment_of(env)}#{os.getpid()}"


def should_stop(opts, seconds_left: float, times: list[float]) -> bool:
    """After a save: stop verl when the next save could not complete before the deadline."""
    if not times:
        return False  # no step measured yet: nothing to size the decision with
    steps_to_next_save = 1 if opts.save_mode == "deadline" else max(1, opts.save_freq)
    return not next_save_fits(seconds_left, steps_to_next_save * max(times), opts.save_time_s, STOP_MARGIN_S)


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


def unsaved_reason(trained: int | None, saved: int | None) -> str | None:
    """verl exited 0: complete only if its last trained step is in a checkpoint. When
    trainer.total_training_steps exceeds epochs x batches verl's loop ends by running out of
    epochs, skips its is_last_step save and still exits 0: the end of training would be lost."""
    if trained is None or (saved is not None and saved >= trained):
        return None
    return (f"verl ended at step {trained} but its newest checkpoint is step {saved}: the last "
            f"{trained - (saved or 0)} steps are not saved (its loop ran out of epochs before "
            f"total_training_steps; set args.total_training_steps to at most epochs x batches per epoch, "
            f"or leave it null)")


def hpcrl_record(rec: dict, segment: int | None = None, now: float | None = None) -> dict:
    """A verl FileLogger record as a metrics.jsonl record: the segment and the time the launcher
    read it (within POLL_S of verl logging it) give `status` its goodput and ETA, as the built-in
    trainer's records do; a record without a step time is verl's validation."""
    out = {"step": rec.get("step"), "trainer": "verl"}
    if segment is not None:
        out["segment"] = segment
    if now is not None:
        out["time"] = round(now, 3)
    if isinstance(rec["data"].get("timing_s/step"), (int, float)):
        out["step_time_s"] = rec["data"]["timing_s/step"]  # the built-in trainer's name (status.metrics.segment_timings)
    else:
        out["phase"] = "eval"
    for src, dst in METRIC_KEYS.items():
        if isinstance(rec["data"].get(src), (int, float)):
            out[dst] = rec["data"][src]
    return out


# ------------------------------------------------------------------ process supervision


class VerlSupervisor(Supervisor):
    """verl's knowledge: its command line, its tracker and FileLogger, its deadline window (ESI),
    its Ray actors that outlive the driver. TERM goes to verl at once (it saves nothing on TERM,
    but a walltime or preemption wants a prompt exit); USR1 is not needed: verl saves inside its
    deadline window by itself, and this supervisor stops it after that save."""

    name = "verl"
    poll_s = POLL_S
    stop_grace_s = STOP_GRACE_S
    metrics_wait_s = METRICS_WAIT_S
    start_after_term = False

    @classmethod
    def add_arguments(cls, p) -> None:
        p.add_argument("--ckpt-dir", required=True, help="trainer.default_local_dir")
        p.add_argument("--save-mode", choices=("deadline", "periodic"), default="deadline")
        p.add_argument("--save-freq", type=int, required=True, help="steps between regular saves")
        p.add_argument("--save-every-s", type=float, default=0.0, help="periodic: target seconds between saves")
        p.add_argument("--save-time-s", type=float, default=300.0, help="what one save may take")
        p.add_argument("--logger", default="auto", help="auto | console | wandb")
        p.add_argument("--keep", type=int, default=0, help="checkpoints to keep across segments (0: all)")

    @classmethod
    def default_run_dir(cls, opts) -> Path:
        return Path(opts.ckpt_dir).parent

    def setup(self) -> None:
        self.ckpt_dir = Path(self.opts.ckpt_dir)
        self.times = past_step_times(self.run_dir, self.segment)  # earlier segments' steps
        self.metrics_file = metrics_path(self.run_dir, self.segment)
        self.offset = 0
        self.last_ckpt = None  # the tracker's step when last read (prepare reads it)
        self.stop_after = None  # (saved step, when decided): stop once its metrics are logged
        self.last_logged = None  # the highest step verl logged a training record for
        self.warmup_s = None  # the segment's first step (verl's warm-up): a step time only while alone

    def command(self) -> list[str]:
        argv = [self.opts.python, "-m", "verl.trainer.main_ppo", *expand_paths(self.opts.args, self.env),
                *runtime_overrides(self.opts, self.env, self.run_dir, self.times)]
        self.env.update(actor_env(self.opts, self.env, self.run_dir))  # a Ray started by the driver inherits these
        return argv

    def dry_run_view(self) -> dict:
        shown = ("VERL_FILE_LOGGER_PATH", ESI_ENV, "WANDB_RUN_ID", "WANDB_RESUME")
        return {"argv": self.argv, "env": {k: self.env[k] for k in shown if k in self.env}}

    def prepare(self) -> None:
        # a segment that ended without settling (killed, or its actors ran on another node)
        align_tracker(self.ckpt_dir, recorded_step(self.run_dir, self.segment - 1))
        prune_checkpoints(self.ckpt_dir, self.opts.keep)
        self.last_ckpt = read_tracker(self.ckpt_dir)
        self.metrics_file.parent.mkdir(parents=True, exist_ok=True)
        # verl's dumps of steps past the checkpoint are a lost segment's: they are trained again
        verl_rollouts.prune(verl_rollouts.rollouts_dir(self.run_dir), self.last_ckpt)
        verl_rollouts.thin(verl_rollouts.rollouts_dir(self.run_dir), ROLLOUTS_BUDGET)

    def on_term(self) -> None:
        self.request = "term"
        self.signal_group(signal.SIGTERM)

    def on_usr1(self) -> None:
        pass  # verl saves by the deadline itself (ESI)

    def poll_once(self) -> None:
        records, self.offset = read_verl_metrics(self.metrics_file, self.offset)
        times = step_times(records)
        if times and self.warmup_s is None:
            self.warmup_s, times = times[0], times[1:]
        self.times += times
        for rec in records:
            if isinstance(rec.get("step"), int) and "timing_s/step" in rec["data"]:
                self.last_logged = max(rec["step"], self.last_logged or 0)
        sink = self.env.get(ENV_METRICS)
        if sink and records:
            now = time.time()
            with open(sink, "a", encoding="utf-8") as f:
                for rec in records:
                    f.write(json.dumps(hpcrl_record(rec, self.segment, now), sort_keys=True) + "\n")
        step = read_tracker(self.ckpt_dir)
        if step is not None and step != self.last_ckpt:
            self.last_ckpt = step
            if (self.stop_after is None and self.deadline is not None
                    and should_stop(self.opts, self.seconds_left(), self.times or ([self.warmup_s] if self.warmup_s else []))):
                self.stop_after = (step, time.monotonic())
        if self.stop_after is not None and not self.stopped_for_continue:
            self._stop_once_logged()

    def _stop_once_logged(self) -> None:
        """verl logs a step's metrics after its save: stop once they came, or METRICS_WAIT_S on."""
        saved, since = self.stop_after
        logged = self.last_logged is not None and self.last_logged >= saved
        late = time.monotonic() - since > self.metrics_wait_s or self.seconds_left() < STOP_MARGIN_S
        if logged or late:
            log(f"verl saved step {saved}; the next save would not fit before the deadline: stopping verl "
                f"for continuation{'' if logged else f' (its metrics for step {saved} did not come)'}")
            self.stopped_for_continue = True
            self.stop_group(self.stop_grace_s)

    def last_trained_step(self) -> int | None:
        """The highest step verl logged a training step for in this segment (step 0 = validation)."""
        records, _ = read_verl_metrics(self.metrics_file)
        steps = [r["step"] for r in records if isinstance(r.get("step"), int) and "timing_s/step" in r["data"]]
        return max(steps) if steps else None

    def finish(self) -> None:
        if self.stopped_for_continue:
            self.settle()
        else:  # a TERM from outside (walltime, preemption) wants a prompt exit: the next segment aligns
            self.poll_once()
        verl_rollouts.thin(verl_rollouts.rollouts_dir(self.run_dir), ROLLOUTS_BUDGET)

    def settle(self) -> None:
        """After verl's driver exited: wait for the rest of this segment's verl (its Ray actors
        outlive the driver by seconds and keep training and saving), then make the tracker name a
        step whose record was logged (align_tracker)."""
        # never past the deadline (the walltime's TERM and KILL follow it closely: the batch shell
        # must still record the segment's end), nor past a TERM: the next segment aligns then
        limit = self.stop_grace_s if self.deadline is None else min(self.stop_grace_s, self.seconds_left() - 1.0)
        tag = self.env.get(TAG_ENV)
        left = wait_gone(tag, limit, lambda: self.request == "term") if tag else []
        if left and self.request != "term":
            log(f"{len(left)} verl process(es) still running at the deadline: killing them")
            kill_pids(left)
            left = tagged_pids(tag)
        self.poll_once()
        if not left:  # with a writer still alive the next segment's start aligns instead
            align_tracker(self.ckpt_dir, recorded_step(self.run_dir, self.segment))

    def unsaved_reason(self) -> str | None:
        return unsaved_reason(self.last_trained_step(), read_tracker(self.ckpt_dir))


# ------------------------------------------------------------------ the segment boundary


def tagged_pids(tag: str) -> list[int]:
    """Processes on this node whose environment carries `tag` (TAG_ENV), this one excepted."""
    needle = f"{TAG_ENV}={tag}\0".encode()
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []  # no /proc: nothing to wait for
    for name in entries:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read():
                    out.append(int(name))
        except OSError:
            continue
    return out


def wait_gone(tag: str, limit_s: float, cut_short=lambda: False) -> list[int]:
    """Wait up to limit_s (or until cut_short()) for this segment's processes to exit; the pids
    still there."""
    end = time.monotonic() + limit_s
    while True:
        left = tagged_pids(tag)
        if not left or time.monotonic() >= end or cut_short():
            return left
        time.sleep(0.5)


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    time.sleep(1.0)


def recorded_step(run_dir: Path, upto_segment: int) -> int | None:
    """The highest step any segment up to `upto_segment` logged a training record for."""
    steps = []
    for seg in range(1, upto_segment + 1):
        records, _ = read_verl_metrics(metrics_path(run_dir, seg))
        steps += [r["step"] for r in records if isinstance(r.get("step"), int) and "timing_s/step" in r["data"]]
    return max(steps) if steps else None


def align_tracker(ckpt_dir: Path, recorded: int | None) -> int | None:
    """The segment boundary race (issue 23): verl saves a step before it logs it (ray_trainer.fit:
    _save_checkpoint, update_weights, then logger.log), and a stopped verl's actors keep training
    for seconds after its driver is gone, saving every step inside the deadline window. Stopped
    between a save and its log, the tracker names a step that was trained but has no record, and
    the next segment starts one past it (records ...121, 123...). Point the tracker back at the
    newest checkpoint whose step was recorded and drop the newer ones: the next segment trains
    that step again (one step of compute) instead of leaving a hole in the run's history.
    Returns the step the tracker now names when it moved it."""
    tracker = read_tracker(ckpt_dir)
    if tracker is None or recorded is None or tracker <= recorded:
        return None
    if not (ckpt_dir / f"global_step_{recorded}").is_dir():
        log(f"verl saved step {tracker} but logged no record for steps {recorded + 1}-{tracker}, and "
            f"step {recorded} has no checkpoint to fall back to: keeping step {tracker}")
        return None
    tmp = ckpt_dir / (TRACKER + ".hpcrl-tmp")
    tmp.write_text(str(recorded), encoding="utf-8")
    os.replace(tmp, ckpt_dir / TRACKER)  # the tracker first: a crash here leaves extra dirs, not a hole
    for step in range(recorded + 1, tracker + 1):
        shutil.rmtree(ckpt_dir / f"global_step_{step}", ignore_errors=True)
    log(f"verl saved step {tracker} but its record was lost when it stopped: the checkpoint of "
        f"step {recorded} is the resume point (step {recorded + 1} is trained again)")
    return recorded


parse_args = VerlSupervisor.parse_args
main = VerlSupervisor.main

if __name__ == "__main__":
    sys.exit(main())
