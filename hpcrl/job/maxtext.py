"""Job-side launcher for MaxText's RL trainer: runs it, stops it right after a committed save.

Runs in the job as `python -m hpcrl.job.maxtext` (stdlib only, from the run's lib/ snapshot of
hpcrl on PYTHONPATH: the job's interpreter, a Python >= 3.12 venv on the TPU VM, needs no hpcrl
installed), under the one supervisor of hpcrl/job/supervisor.py. The argv the batch script shows
is the whole static MaxText command line; this module only appends, per segment:

    num_test_batches=0    on every segment after the first with --eval first (MaxText has no key
                          that skips only the pre-training evaluation; it reruns it on every
                          resume otherwise: num_test_batches x eval batch x num_eval_passes
                          greedy generations per segment)

Why it exists (measured, /work/shared/notes/maxtext-cpu.md): MaxText's RL path (MaxText and
Tunix) handles no signal. SIGTERM ends it with no save; SIGUSR1 kills it, also in the middle of
a save, leaving `<step>.orbax-checkpoint-tmp*`. Its saves come at step 1, every
checkpoint_period steps and at the last step, into <base>/<run>/checkpoints/actor/<step>/.
So this module speaks the walltime protocol for it:

- a save is committed when `<step>/` exists (Orbax renames its temporary directory); on GCS,
  where nothing is renamed, when `<step>/commit_success.txt` does (listed with `gcloud storage`
  every GCS_POLL_S);
- it never lets a signal land during a save: it freezes MaxText's process group (SIGSTOP, which
  nothing can handle or delay), looks for a temporary directory, and only then kills it
  (SIGKILL: there is nothing left to save); a save caught in progress is resumed (SIGCONT) and
  waited for;
- after each committed save it asks whether the next one (checkpoint_period steps at the
  slowest measured pace, plus the slowest save) would finish before the deadline; if not, it
  stops MaxText at once and exits EXIT_CONTINUE (85). TERM does the same at the first safe
  point; USR1 (walltime near) too, unless the next save still fits before the deadline: then
  right after that save;
- before starting MaxText it deletes the temporary directories an interrupted save left (MaxText
  ignores them on resume and leaves them on disk);
- MaxText exiting 0 is the run's end (exit 0) only if the last step it was asked for is saved.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpcrl.job.supervisor import Supervisor, log, segment_of
from hpcrl.protocol import ENV_METRICS, next_save_fits

MODULE = "maxtext.trainers.post_train.rl.train_rl"
TMP_MARK = ".orbax-checkpoint-tmp"  # Orbax's temporary step directory: <step>.orbax-checkpoint-tmp[-<ts>]
COMMIT_FILE = "commit_success.txt"  # Orbax's commit marker, what tells a finished save on GCS
GCS_POLL_S = 15.0
SAVES_FILE = "maxtext-saves.jsonl"  # in RUN_DIR: one line per committed save this launcher saw
SEGMENTS_FILE = "maxtext-segments.jsonl"  # in RUN_DIR: per segment, what was run (start) and how it ended (end)
POLL_S = 0.5
MARGIN_S = 10.0  # slack for the stop itself and the poll interval
# The next interval is sized at this multiple of the slowest pace seen: a shared node's steps
# vary (on the 2-core test machine two steps once took 26 s after a run of 6.5 s pairs), and
# stopping one save early costs one interval while stopping one late loses it
PACE_SAFETY = 2.0
# Tunix writes a step's scalars only about one step after its save (measured: loss logged up to
# step 11 when step 12's save committed): a stop the moment the save commits lost the saved step's
# metrics. The stop decision reserves one more step for them and waits this long at most, or two
# steps at the slowest pace seen when that is longer (under load a step took 26 s here), while the
# deadline allows; the segment's end record says which step's metrics were the last written.
METRICS_WAIT_S = 30.0


# ------------------------------------------------------------------ pure decisions


def runtime_keys(opts, env) -> list[str]:
    out = []
    if opts.eval == "first" and segment_of(env) > 1:
        out.append("num_test_batches=0")
    return out


def committed_steps(root: Path) -> list[int]:
    """Steps whose save is complete, oldest first."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    out = []
    for p in entries:
        if p.name.isdigit() and p.is_dir():
            out.append(int(p.name))
    return sorted(out)


def temporary_dirs(root: Path) -> list[Path]:
    try:
        return sorted(p for p in root.iterdir() if TMP_MARK in p.name)
    except OSError:
        return []


def clean_temporary(root: Path) -> list[Path]:
    """Temporary step directories of interrupted saves (MaxText skips them and leaves them)."""
    doomed = temporary_dirs(root)
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return doomed


class LocalStore:
    """A local (or mounted) checkpoint root: Orbax writes <step>.orbax-checkpoint-tmp*/ and renames it."""

    poll_s = POLL_S

    def __init__(self, root: str):
        self.root = Path(root)

    def committed(self) -> list[int]:
        return committed_steps(self.root)

    def in_progress(self) -> list[str]:
        return [p.name for p in temporary_dirs(self.root)]

    def clean(self) -> list[str]:
        return [p.name for p in clean_temporary(self.root)]


class GcsStore:
    """A gs:// checkpoint root, listed with `gcloud storage` (HPCRL_GS overrides the command, as in
    the TPU startup script). Orbax renames nothing on GCS: it writes <step>/ in place and commits
    it with <step>/commit_success.txt last, so a step directory without that file is a save in
    progress (or one a kill tore). Listing costs a request: polled every GCS_POLL_S."""

    poll_s = GCS_POLL_S

    def __init__(self, url: str, env=None):
        self.url = url.rstrip("/")
        self.gs = (env or os.environ).get("HPCRL_GS", "gcloud storage").split()

    def _ls(self, pattern: str) -> list[str]:
        try:
            out = subprocess.run([*self.gs, "ls", pattern], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            return []
        return out.stdout.splitlines() if out.returncode == 0 else []

    def committed(self) -> list[int]:
        tail = "/" + COMMIT_FILE
        names = [ln.strip()[len(self.url) + 1:-len(tail)] for ln in self._ls(f"{self.url}/*{tail}")
                 if ln.strip().startswith(self.url + "/") and ln.strip().endswith(tail)]
        return sorted(int(n) for n in names if n.isdigit())

    def in_progress(self) -> list[str]:
        done = set(self.committed())
        names = [ln.strip()[len(self.url) + 1:].rstrip("/") for ln in self._ls(self.url + "/")
                 if ln.strip().startswith(self.url + "/") and ln.strip().endswith("/")]
        return sorted(n for n in names if TMP_MARK in n or (n.isdigit() and int(n) not in done))

    def clean(self) -> list[str]:
        doomed = self.in_progress()
        for name in doomed:
            subprocess.run([*self.gs, "rm", "-r", f"{self.url}/{name}"], capture_output=True, timeout=600)
        return doomed


# ------------------------------------------------------------------ metrics (Tunix's tensorboard events)

# Tunix tag -> hpcrl metrics.jsonl key (what `status`, `metrics` and `plot` read)
METRIC_TAGS = {"actor/train/loss": "loss", "rewards/train/mean": "reward_mean", "actor/train/kl": "kl",
               "actor/train/grad_norm": "grad_norm", "completions/train/mean_length": "response_len"}
# Tunix logs a step's rewards (from its rollout) under the step before its loss's: measured,
# rewards/train/* at 0..N-1 and actor/train/loss at 1..N in an N-step run
REWARD_TAGS = ("rewards/train/mean", "completions/train/mean_length")


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        b = buf[i]
        i += 1
        out |= (b & 0x7F) << shift
        if b < 0x80:
            return out, i
        shift += 7


def _fields(buf: bytes):
    """(field number, wire type, value) of one protobuf message; bytes for length-delimited."""
    import struct

    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            val, i = _varint(buf, i)
        elif wt == 1:
            val, i = struct.unpack_from("<d", buf, i)[0], i + 8
        elif wt == 2:
            n, i = _varint(buf, i)
            val, i = buf[i:i + n], i + n
        elif wt == 5:
            val, i = struct.unpack_from("<f", buf, i)[0], i + 4
        else:
            return
        yield num, wt, val


def read_events(data: bytes) -> tuple[list[tuple[int, float, str, float]], int]:
    """(step, wall time, tag, simple value) of the complete TFRecord-framed Event records in
    `data`, and how many bytes they took (a torn last record is read on the next poll)."""
    import struct

    out, i = [], 0
    while i + 12 <= len(data):
        n = struct.unpack_from("<Q", data, i)[0]
        if i + 16 + n > len(data):
            break
        step, wall = 0, 0.0
        values = []
        for num, _, val in _fields(data[i + 12:i + 12 + n]):
            if num == 1:
                wall = val
            elif num == 2:
                step = val
            elif num == 5:  # Summary: repeated Value (tag = 1, simple_value = 2)
                for vnum, _, v in _fields(val):
                    if vnum == 1:
                        tag = simple = None
                        for fnum, fwt, f in _fields(v):
                            if fnum == 1 and fwt == 2:
                                tag = f.decode("utf-8", "replace")
                            elif fnum == 2 and fwt == 5:
                                simple = f
                        if tag is not None and simple is not None:
                            values.append((tag, simple))
        out += [(step, wall, tag, v) for tag, v in values]
        i += 16 + n
    return out, i


class MetricsBridge:
    """Turns the tensorboard events MaxText writes in this segment into hpcrl metric records."""

    def __init__(self, tb_dir: Path, sink: str | None):
        self.tb_dir, self.sink = tb_dir, sink
        self.before = set(self._files())  # earlier segments' files are theirs
        self.offsets: dict[Path, int] = {}
        self.pending: dict[int, dict] = {}  # step -> its values so far
        self.newest: int | None = None  # the newest step whose loss was logged

    def _files(self) -> list[Path]:
        try:
            return sorted(self.tb_dir.glob("events.out.tfevents.*"))
        except OSError:
            return []

    def poll(self, final: bool = False) -> list[dict]:
        """Records of the steps whose values are all in (a later step's loss has been logged);
        final: every step seen."""
        for path in self._files():
            if path in self.before:
                continue
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets.get(path, 0))
                    data = f.read()
            except OSError:
                continue
            events, used = read_events(data)
            self.offsets[path] = self.offsets.get(path, 0) + used
            for step, wall, tag, value in events:
                if tag not in METRIC_TAGS:
                    continue
                if tag in REWARD_TAGS:
                    step += 1
                rec = self.pending.setdefault(step, {"step": step, "trainer": "maxtext"})
                rec[METRIC_TAGS[tag]] = value
                if tag == "actor/train/loss":
                    rec["time"] = round(wall, 3)
        trained = [s for s, r in self.pending.items() if "loss" in r]
        self.newest = max([self.newest or 0, *trained]) or None
        done = sorted(s for s in trained if final or s < max(trained))
        records = [self.pending.pop(s) for s in done]
        if self.sink and records:
            try:
                with open(self.sink, "a", encoding="utf-8") as f:
                    for rec in records:
                        f.write(json.dumps(rec, sort_keys=True) + "\n")
            except OSError:
                pass
        return records


def store_for(root: str, env=None):
    return GcsStore(root, env) if root.startswith("gs://") else LocalStore(root)


def should_stop(opts, seconds_left: float, step_s: float | None, save_s: float | None, poll_s: float = 0.0) -> bool:
    """Right after a committed save: stop when the next one could not be committed before the deadline."""
    if not step_s:
        return False  # nothing measured yet: nothing to size the decision with
    work_s = PACE_SAFETY * opts.period * step_s + step_s  # one more step: Tunix logs a step's metrics after it
    return not next_save_fits(seconds_left, work_s, max(save_s or 0.0, 1.0), MARGIN_S + poll_s)


def pace(saves: list[tuple[int, float]]) -> float | None:
    """Slowest seconds per step between consecutive saves seen (a save's own time included).
    The first save of a segment comes after start-up and compilation: it starts the clock only."""
    rates = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(saves, saves[1:]) if s1 > s0]
    return max(rates) if rates else None


# ------------------------------------------------------------------ process supervision


class MaxTextSupervisor(Supervisor):
    """MaxText's knowledge: its checkpoint root (local or gs://), Orbax's commit, a kill that must
    never land in a save (SIGSTOP, look, SIGKILL), Tunix's metrics a step late. TERM and USR1
    become a stop at the first safe point (USR1 waits for the next save while it still fits)."""

    name = "MaxText"

    @classmethod
    def add_arguments(cls, p) -> None:
        p.add_argument("--ckpt-root", required=True, help="<base_output_directory>/<run_name>/checkpoints/actor")
        p.add_argument("--period", type=int, required=True, help="checkpoint_period: steps between saves")
        p.add_argument("--total-steps", type=int, default=0, help="steps of the whole run (0: unknown)")
        p.add_argument("--save-time-s", type=float, default=60.0, help="what one save may take before one is measured")
        p.add_argument("--step-time-s", type=float, default=0.0, help="a step's time before one is measured (0: unknown)")
        p.add_argument("--eval", choices=("first", "every"), default="first",
                       help="pre-training evaluation in the first segment only, or in every one")

    def setup(self) -> None:
        self.store = store_for(self.opts.ckpt_root, self.env)
        self.poll_s = self.store.poll_s
        self.saves: list[tuple[int, float]] = []  # (step, when seen committed) in this segment
        self.save_started: dict[str, float] = {}
        self.save_s: float | None = None
        self.requested_at = None
        self.metrics = None
        self.cleaned: list[str] = []  # temporary directories of interrupted saves removed at start

    def command(self) -> list[str]:
        return [self.opts.python, "-m", MODULE, *self.opts.args, *runtime_keys(self.opts, self.env)]

    def prepare(self) -> None:
        self.known = set(self.store.committed())
        # <base>/<run>/checkpoints/actor -> <base>/<run>/tensorboard (types.py); local roots only
        if not self.opts.ckpt_root.startswith("gs://"):
            self.metrics = MetricsBridge(Path(self.opts.ckpt_root).parent.parent / "tensorboard",
                                         self.env.get(ENV_METRICS))
        for name in self.store.clean():
            log(f"removed {self.opts.ckpt_root.rstrip('/')}/{name} (a save interrupted in an earlier segment)")
            self.cleaned.append(name)

    def safe_kill(self) -> bool:
        """Kill MaxText if no save is in progress; False (and it keeps running) when one is."""
        self.signal_group(signal.SIGSTOP)  # frozen: no save can start or finish while we look
        if self.store.in_progress():
            self.signal_group(signal.SIGCONT)
            return False
        self.signal_group(signal.SIGKILL)
        self.signal_group(signal.SIGCONT)
        self.proc.wait()
        return True

    def see_saves(self) -> list[int]:
        """The saves committed since the last poll, recorded (SAVES_FILE) and timed."""
        now = time.time()
        for name in self.store.in_progress():
            self.save_started.setdefault(name.split(".")[0], now)
        new = [s for s in self.store.committed() if s not in self.known]
        for step in new:
            self.known.add(step)
            self.saves.append((step, now))
            began = self.save_started.pop(str(step), None)
            if began is not None:
                self.save_s = max(self.save_s or 0.0, now - began)
            self.append(SAVES_FILE, {"step": step, "time": round(now, 3), "segment": self.segment})
        return new

    def poll_once(self) -> None:
        if self.metrics is not None:
            self.metrics.poll()
        new = self.see_saves()
        if self.stopped_for_continue or self.proc.poll() is not None:
            return
        step_s = pace(self.saves) or self.opts.step_time_s or None
        save_s = self.save_s or self.opts.save_time_s
        if new and self.request is None and self.deadline is not None and (
                self.opts.total_steps <= 0 or max(new) < self.opts.total_steps) and \
                should_stop(self.opts, self.seconds_left(), step_s, save_s, self.store.poll_s):
            self.request = "deadline"
        if self.request == "usr1" and not new and self.deadline is not None and not should_stop(
                self.opts, self.seconds_left(), step_s, save_s, self.store.poll_s):
            return  # walltime near, yet the next save still fits: stop right after it rather than lose its steps
        if self.request is not None and self.requested_at is None:
            self.requested_at = time.monotonic()
        if self.request in ("deadline", "usr1") and self._metrics_pending(step_s):
            return  # the saved step's metrics are not written yet: give Tunix a moment
        if self.request is not None and self.safe_kill():
            last = max(self.known) if self.known else None
            why = {"deadline": "the next save would not finish before the deadline",
                   "usr1": "USR1 (walltime near)", "term": "TERM"}[self.request]
            log(f"stopped MaxText after its committed save of step {last}: {why}")
            self.stopped_for_continue = True

    def _metrics_pending(self, step_s: float | None) -> bool:
        wait_s = max(METRICS_WAIT_S, PACE_SAFETY * (step_s or 0.0))
        return (self.metrics is not None and bool(self.known) and (self.metrics.newest or 0) < max(self.known)
                and time.monotonic() - self.requested_at < wait_s and self.seconds_left() > MARGIN_S)

    def append(self, name: str, record: dict) -> None:
        try:
            with open(self.run_dir / name, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        except OSError:
            pass

    def run(self) -> int:
        self.append(SEGMENTS_FILE, {"segment": self.segment, "event": "start", "argv": self.argv, "cleaned": self.cleaned})
        rc = super().run()
        self.append(SEGMENTS_FILE, {
            "segment": self.segment, "event": "end", "rc": rc, "first_save": self.saves[0][0] if self.saves else None,
            "last_save": self.saves[-1][0] if self.saves else None,
            "stopped_for": self.request if self.stopped_for_continue else None,
            "metrics_through": self.metrics.newest if self.metrics is not None else None})
        return rc

    def finish(self) -> None:
        self.poll_once()
        if self.metrics is not None:
            self.metrics.poll(final=True)

    def unsaved_reason(self) -> str | None:
        """MaxText exited 0: complete only when the last step is saved (it saves it itself)."""
        total, saved = self.opts.total_steps, max(self.known) if self.known else None
        if total <= 0 or (saved is not None and saved >= total):
            return None
        return (f"MaxText exited 0 but its newest checkpoint is step {saved} of {total}: "
                f"the run would read COMPLETED without its last steps")


parse_args = MaxTextSupervisor.parse_args
main = MaxTextSupervisor.main

if __name__ == "__main__":
    sys.exit(main())
