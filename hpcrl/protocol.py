"""The walltime protocol: the one contract between the launcher and a trainer. Stdlib only.

The segment script gives the trainer, in its environment:

    HPCRL_RUN_DIR      the run directory (metrics go to HPCRL_METRICS inside it)
    HPCRL_CKPT_DIR     where checkpoints live (one sub-directory per checkpoint)
    HPCRL_SEGMENT      the segment number, 1-based
    HPCRL_DEADLINE     absolute unix time (float seconds) by which the trainer must have
                       saved and exited
    HPCRL_METRICS      the JSON-lines file for metrics (one object per line, with "step")

Before the deadline the trainer also gets SIGUSR1 ("checkpoint now, then exit for
continuation"). SIGTERM means "you are being killed or preempted: save if you can, exit".
Exit codes: EXIT_COMPLETE (0) when training is done, EXIT_CONTINUE when it stopped to be
continued by the next segment; anything else is a failure.

Checkpoints: each is a directory CKPT_DIR/step-<N:08d>/ holding its files and a MANIFEST.json
(a digest - xxh3_128 when the xxhash package is installed, else sha256 - and the size of
every file), written as CKPT_DIR/.tmp-*/ then fsync'ed and renamed; the
pointer file CKPT_DIR/LATEST names the newest complete one and is replaced atomically last.
`publish_checkpoint` and `find_latest_checkpoint` implement this for every trainer in hpcrl.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

# hashlib, shutil and tempfile are imported where used: `hpcrl status` reads this module and
# must start fast.

EXIT_COMPLETE = 0
EXIT_CONTINUE = 85  # stopped for continuation (like Slurm's "requeue" convention of a named code)
EXIT_NOTHING_TO_DO = 3  # `hpcrl _segment begin`: the run needs no more segments (the script exits 0)

ENV_RUN_DIR = "HPCRL_RUN_DIR"
ENV_CKPT_DIR = "HPCRL_CKPT_DIR"
ENV_SEGMENT = "HPCRL_SEGMENT"
ENV_DEADLINE = "HPCRL_DEADLINE"
ENV_METRICS = "HPCRL_METRICS"

METRICS_FILE = "metrics.jsonl"
POINTER_FILE = "LATEST"
MANIFEST_FILE = "MANIFEST.json"
_CKPT_RE = re.compile(r"^step-(\d{8,})$")


# ---------------------------------------------------------------- environment


class Context:
    """What the segment script told the trainer (or sensible stand-ins when run by hand)."""

    def __init__(self, run_dir, ckpt_dir, segment: int, deadline: float | None, metrics):
        self.run_dir = Path(run_dir)
        self.ckpt_dir = Path(ckpt_dir)
        self.segment = segment
        self.deadline = deadline
        self.metrics_path = Path(metrics)

    @classmethod
    def from_env(cls, env=None, default_run_dir: str | os.PathLike = ".") -> "Context":
        env = os.environ if env is None else env
        run_dir = Path(env.get(ENV_RUN_DIR) or default_run_dir)
        deadline = env.get(ENV_DEADLINE)
        return cls(
            run_dir=run_dir,
            ckpt_dir=env.get(ENV_CKPT_DIR) or run_dir / "checkpoints",
            segment=int(env.get(ENV_SEGMENT) or 1),
            deadline=float(deadline) if deadline else None,
            metrics=env.get(ENV_METRICS) or run_dir / METRICS_FILE,
        )

    def seconds_left(self, now: float | None = None) -> float:
        if self.deadline is None:
            return float("inf")
        return self.deadline - (time.time() if now is None else now)


class StopFlag:
    """Records SIGUSR1/SIGTERM so the training loop can stop at a safe point.

    The handlers only set flags: saving from inside a signal handler could interrupt a
    half-written step. The loop calls `should_stop(next_step_s)` between steps.
    """

    def __init__(self, ctx: Context, margin_s: float = 5.0, install: bool = True):
        self.ctx = ctx
        self.margin_s = margin_s
        self.usr1 = False
        self.term = False
        if install:
            signal.signal(signal.SIGUSR1, self._on_usr1)
            signal.signal(signal.SIGTERM, self._on_term)
            import atexit

            atexit.register(ignore_late_signals)

    def _on_usr1(self, signum, frame):
        self.usr1 = True

    def _on_term(self, signum, frame):
        self.term = True

    @property
    def reason(self) -> str | None:
        if self.term:
            return "SIGTERM"
        if self.usr1:
            return "SIGUSR1"
        if self.ctx.seconds_left() <= self.margin_s:
            return "deadline"
        return None

    def should_stop(self, next_step_s: float = 0.0, save_s: float = 0.0) -> bool:
        """True when a signal came, or the next step plus a save would overrun the deadline."""
        if self.usr1 or self.term:
            return True
        return self.ctx.seconds_left() <= self.margin_s + next_step_s + save_s


def ignore_late_signals() -> None:
    """Ignore USR1/TERM from now on (registered at exit by StopFlag).

    Python resets handled signals to their default action while it shuts down, and a large
    process (torch) takes a while to: a USR1 forwarded just as the trainer exits for
    continuation would then kill it, turning a clean 85 into a failed segment (138). A trainer
    that is exiting has already saved; an ignored signal stays ignored through finalization.
    """
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


# ---------------------------------------------------------------- metrics


def append_metrics(path, record: dict) -> None:
    """Append one JSON object as a line, written through at once so `status` and `logs` see it.

    Not fsync'ed: a metrics line is a report, not state (the checkpoint is the state, and steps
    after it are redone on resume), and an fsync per step cost ~10% of a small model's step time
    here (more on a parallel filesystem).
    """
    line = json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)


def read_last_metrics(path, max_bytes: int = 65536, key: str | None = None) -> dict | None:
    """The newest complete metrics record (optionally the newest that has `key`)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line or the cut first line of the tail
        if isinstance(rec, dict) and (key is None or key in rec):
            return rec
    return None


# ---------------------------------------------------------------- atomic files


def fsync_dir(path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def atomic_write_text(path, text: str, mode: int | None = None) -> None:
    """Write via a temporary file in the same directory, fsync, rename over `path`."""
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_json(path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


# ---------------------------------------------------------------- checkpoints


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoint_step_of(path) -> int | None:
    m = _CKPT_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


_DIGEST = None


def digest_algorithm() -> str:
    """The manifest digest: xxh3_128 (~10x sha256's speed; integrity against torn and corrupt
    files, not against an attacker who can write the checkpoint) when xxhash is installed (the
    built-in trainer's stack has it), else sha256."""
    global _DIGEST
    if _DIGEST is None:
        try:
            import xxhash  # noqa: F401

            _DIGEST = "xxh3_128"
        except ImportError:
            _DIGEST = "sha256"
    return _DIGEST


def new_hasher(algorithm: str | None = None):
    """A hashlib-style object (update, hexdigest) for `algorithm` (default: digest_algorithm())."""
    algorithm = algorithm or digest_algorithm()
    if algorithm == "sha256":
        import hashlib

        return hashlib.sha256()
    if algorithm == "xxh3_128":
        try:
            import xxhash
        except ImportError:
            raise ValueError("xxh3_128 digests need the xxhash package: pip install xxhash") from None
        return xxhash.xxh3_128()
    raise ValueError(f"unknown digest algorithm {algorithm!r}")


def file_digest(path, algorithm: str | None = None, bufsize: int = 1 << 22) -> str:
    h = new_hasher(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory, extra: dict | None = None, known: dict | None = None) -> dict:
    """Checksum every file in `directory` (recursively) into MANIFEST.json; fsync each file.

    `known` maps relative paths to entries ({algorithm: digest, "size": n}) that the writer
    computed while writing, so those files are not read back.
    """
    directory = Path(directory)
    known = known or {}
    files = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MANIFEST_FILE:
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            rel = str(p.relative_to(directory))
            files[rel] = known.get(rel) or {digest_algorithm(): file_digest(p), "size": p.stat().st_size}
    manifest = {"files": files, **(extra or {})}
    atomic_write_json(directory / MANIFEST_FILE, manifest)
    return manifest


def read_manifest(directory) -> dict | None:
    try:
        manifest = json.loads((Path(directory) / MANIFEST_FILE).read_text(encoding="utf-8"))
        return manifest if isinstance(manifest.get("files"), dict) else None
    except (OSError, ValueError, AttributeError):
        return None


def entry_algorithm(meta: dict) -> str | None:
    """The digest algorithm a manifest entry names (its one key besides size)."""
    return next((k for k in meta if k != "size"), None)


def verify_checkpoint(directory, deep: bool = True, skip=()) -> str | None:
    """None when the checkpoint is complete and intact, else what is wrong with it.

    deep=False checks presence and sizes only; files in `skip` get no digest pass (their reader
    verifies them as it loads them).
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        return f"{directory.name}: missing or unreadable {MANIFEST_FILE}"
    for rel, meta in manifest["files"].items():
        p = directory / rel
        try:
            size = p.stat().st_size
        except OSError:
            return f"{directory.name}: file {rel} is missing"
        if size != meta.get("size"):
            return f"{directory.name}: file {rel} has {size} bytes, manifest says {meta.get('size')}"
        if deep and rel not in skip:
            algorithm = entry_algorithm(meta)
            try:
                ok = file_digest(p, algorithm) == meta.get(algorithm)
            except ValueError as e:
                return f"{directory.name}: file {rel} cannot be checked: {e}"
            if not ok:
                return f"{directory.name}: file {rel} fails its {algorithm} check"
    return None


def new_checkpoint_dir(ckpt_dir) -> Path:
    """A fresh temporary directory inside ckpt_dir to write a checkpoint into."""
    import tempfile

    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".tmp-", dir=ckpt_dir))


def publish_checkpoint(ckpt_dir, tmp_dir, step: int, keep_last: int = 3, extra: dict | None = None,
                       known: dict | None = None, prune_in_background: bool = False) -> Path:
    """Seal a fully written temporary checkpoint: manifest, fsync, rename, pointer, prune.

    `known`: digests the writer computed on the way (see write_manifest)."""
    import tempfile

    ckpt_dir = Path(ckpt_dir)
    write_manifest(tmp_dir, {"step": step, "time": time.time(), **(extra or {})}, known)
    fsync_dir(tmp_dir)
    final = ckpt_dir / checkpoint_name(step)
    if final.exists():
        # A re-save of the same step (e.g. after a resume): move the old one aside first, so a
        # crash in between never leaves LATEST naming a missing directory for long (the old copy
        # is a .tmp-* that the next prune removes).
        os.replace(final, Path(tempfile.mkdtemp(prefix=".tmp-old-", dir=ckpt_dir)) / "old")
    os.replace(tmp_dir, final)
    fsync_dir(ckpt_dir)
    atomic_write_text(ckpt_dir / POINTER_FILE, final.name + "\n")
    prune_checkpoints(ckpt_dir, keep_last, background=prune_in_background)
    return final


def list_checkpoints(ckpt_dir) -> list[tuple[int, Path]]:
    """(step, path) of every sealed checkpoint directory, oldest first."""
    try:
        entries = list(Path(ckpt_dir).iterdir())
    except OSError:
        return []
    found = [(checkpoint_step_of(p), p) for p in entries if p.is_dir()]
    return sorted((s, p) for s, p in found if s is not None)


def prune_checkpoints(ckpt_dir, keep_last: int, background: bool = False) -> None:
    """Remove all but the newest keep_last checkpoints, and leftovers of killed saves.

    Each doomed checkpoint is first renamed to a .tmp-old-* name (atomic: a kill mid-delete never
    leaves a half-deleted step-N that looks like a checkpoint); with background=True the deleting
    then happens in a daemon thread, off the save's critical path. Only the directories listed
    here are deleted there: a later save's temporary directory is never touched.
    """
    import shutil
    import tempfile

    ckpt_dir = Path(ckpt_dir)
    ckpts = list_checkpoints(ckpt_dir)
    doomed = []
    for _, path in ckpts[: max(0, len(ckpts) - max(1, keep_last))]:
        aside = Path(tempfile.mkdtemp(prefix=".tmp-old-", dir=ckpt_dir))
        os.replace(path, aside / path.name)
    # leftovers of a save that was killed, and the renamed ones; only ever the writer's own, as
    # one process saves and no save of its is in progress while it publishes
    doomed.extend(ckpt_dir.glob(".tmp-*"))

    def delete():
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)

    if background and doomed:
        import threading

        thread = threading.Thread(target=delete, daemon=True, name="ckpt-prune")
        thread.start()
        _PRUNERS.append(thread)
    else:
        delete()


_PRUNERS: list = []  # background deletions of this process (see wait_for_pruning)


def wait_for_pruning(timeout: float | None = None) -> bool:
    """Join this process's background checkpoint deletions (a trainer does before it exits, so
    no old checkpoint outlives the segment); False when time ran out first (the next save's
    prune finishes the job)."""
    end = None if timeout is None else time.monotonic() + max(0.0, timeout)
    while _PRUNERS:
        thread = _PRUNERS[0]
        thread.join(None if end is None else max(0.0, end - time.monotonic()))
        if thread.is_alive():
            return False
        _PRUNERS.pop(0)
    return True


def find_latest_checkpoint(ckpt_dir, deep: bool = True, warn=None, skip=()) -> tuple[int, Path] | None:
    """The newest intact checkpoint, newest first; a torn or corrupt one is skipped with a warning.

    `warn` receives a one-line message for every checkpoint skipped (default: stderr).
    """
    for step, path in checkpoints_newest_first(ckpt_dir, deep, warn, skip):
        return step, path
    return None


def checkpoints_newest_first(ckpt_dir, deep: bool = True, warn=None, skip=()):
    """Yield (step, path) of every checkpoint that passes verify_checkpoint, newest first,
    warning about each one that does not (a reader that finds more damage asks for the next)."""
    warn = warn or (lambda msg: print(f"hpcrl: warning: {msg}", file=sys.stderr))
    for step, path in reversed(list_checkpoints(ckpt_dir)):
        problem = verify_checkpoint(path, deep=deep, skip=skip)
        if problem is None:
            yield step, path
        else:
            warn(f"checkpoint {problem}; falling back to an older one")


def latest_checkpoint_step(ckpt_dir) -> int | None:
    """Cheap read for `status`: the step the pointer names (no checksum pass)."""
    try:
        name = (Path(ckpt_dir) / POINTER_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        ckpts = list_checkpoints(ckpt_dir)
        return ckpts[-1][0] if ckpts else None
    return checkpoint_step_of(name)
