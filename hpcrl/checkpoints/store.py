"""The checkpoint store of hpcrl's own trainers (built-in and smoke). Stdlib only.

Not part of the walltime protocol (protocol.py): the launcher learns a trainer's progress
through its adapter (`Trainer.checkpoint_step`), and only the adapters of hpcrl's own trainers
read this layout. verl and MaxText keep their own.

Layout inside a checkpoint directory (HPCRL_CKPT_DIR):

    step-<N:08d>/        one sealed checkpoint: its files and MANIFEST.json (a digest - xxh3_128
                         when the xxhash package is installed, else sha256 - and the size of
                         every file, plus "step", "time" and the writer's extras)
    LATEST               the name of the newest sealed checkpoint; replaced atomically, last
    .tmp-*/              a checkpoint being written (or left by a killed save), or an old one
                         renamed aside to be deleted; never read as a checkpoint

A save writes into `new_tmp_dir()`, then `publish` writes the manifest, fsyncs, renames the
directory to step-N, replaces LATEST and prunes all but the newest keep_last.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import time
from pathlib import Path

from ..atomicio import atomic_write_json, atomic_write_text, fsync_dir

# hashlib, shutil, tempfile and threading are imported where used: `hpcrl status` reads the
# pointer through this module and must start fast.

POINTER_FILE = "LATEST"
MANIFEST_FILE = "MANIFEST.json"
TMP_PREFIX = ".tmp-"
_CKPT_RE = re.compile(r"^step-(\d{8,})$")


# ---------------------------------------------------------------- names


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoint_step_of(path) -> int | None:
    m = _CKPT_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------- digests and manifests


@functools.lru_cache(maxsize=None)
def digest_algorithm() -> str:
    """The manifest digest: xxh3_128 (~10x sha256's speed; integrity against torn and corrupt
    files, not against an attacker who can write the checkpoint) when xxhash is installed (the
    built-in trainer's stack has it), else sha256."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "sha256"
    return "xxh3_128"


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


def entry_algorithm(meta: dict) -> str | None:
    """The digest algorithm a manifest entry names (its one key besides size)."""
    return next((k for k in meta if k != "size"), None)


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


def _warn_stderr(message: str) -> None:
    print(f"hpcrl: warning: {message}", file=sys.stderr)


# ---------------------------------------------------------------- the store


class CheckpointStore:
    """The checkpoints in one directory: write, seal, list, find, prune (see the module's doc).

    One process writes a store at a time (the segment's trainer), one save after another; any
    number may read it. `warn` receives a one-line message for every checkpoint a reader skips
    (default: stderr). Background deletions started by `prune` belong to this instance and are
    joined by `wait_for_pruning`.
    """

    def __init__(self, ckpt_dir, keep_last: int = 3, warn=None):
        self.dir = Path(ckpt_dir)
        self.keep_last = keep_last
        self.warn = warn or _warn_stderr
        self._pruners: list = []  # background deletions (threads) of this store

    def __repr__(self) -> str:
        return f"CheckpointStore({str(self.dir)!r}, keep_last={self.keep_last})"

    # ------------------------------------------------------------ writing

    def new_tmp_dir(self) -> Path:
        """A fresh temporary directory inside the store to write a checkpoint into."""
        import tempfile

        self.dir.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=self.dir))

    def publish(self, tmp_dir, step: int, extra: dict | None = None, known: dict | None = None,
                prune_in_background: bool = False) -> Path:
        """Seal a fully written temporary checkpoint: manifest, fsync, rename, pointer, prune.

        `known`: digests the writer computed on the way (see write_manifest)."""
        import tempfile

        write_manifest(tmp_dir, {"step": step, "time": time.time(), **(extra or {})}, known)
        fsync_dir(tmp_dir)
        final = self.dir / checkpoint_name(step)
        if final.exists():
            # A re-save of the same step (e.g. after a resume): move the old one aside first, so
            # a crash in between never leaves LATEST naming a missing directory for long (the
            # old copy is a .tmp-* that the next prune removes).
            os.replace(final, Path(tempfile.mkdtemp(prefix=TMP_PREFIX + "old-", dir=self.dir)) / "old")
        os.replace(tmp_dir, final)
        fsync_dir(self.dir)
        atomic_write_text(self.dir / POINTER_FILE, final.name + "\n")
        self.prune(background=prune_in_background)
        return final

    def prune(self, keep_last: int | None = None, background: bool = False) -> None:
        """Remove all but the newest keep_last checkpoints (default: the store's), and leftovers
        of killed saves.

        Each doomed checkpoint is first renamed to a .tmp-old-* name (atomic: a kill mid-delete
        never leaves a half-deleted step-N that looks like a checkpoint); with background=True
        the deleting then happens in a daemon thread, off the save's critical path. Only the
        directories listed here are deleted there: a later save's temporary directory is never
        touched.
        """
        import shutil
        import tempfile

        keep = self.keep_last if keep_last is None else keep_last
        ckpts = self.list()
        for _, path in ckpts[: max(0, len(ckpts) - max(1, keep))]:
            aside = Path(tempfile.mkdtemp(prefix=TMP_PREFIX + "old-", dir=self.dir))
            os.replace(path, aside / path.name)
        # leftovers of a save that was killed, and the renamed ones; only ever the writer's own,
        # as one process saves and no save of its is in progress while it publishes
        doomed = list(self.dir.glob(TMP_PREFIX + "*"))

        def delete():
            for path in doomed:
                shutil.rmtree(path, ignore_errors=True)

        if background and doomed:
            import threading

            thread = threading.Thread(target=delete, daemon=True, name="ckpt-prune")
            thread.start()
            self._pruners.append(thread)
        else:
            delete()

    def wait_for_pruning(self, timeout: float | None = None) -> bool:
        """Join this store's background deletions (a trainer does before it exits, so no old
        checkpoint outlives the segment); False when time ran out first (the next save's prune
        finishes the job)."""
        end = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while self._pruners:
            thread = self._pruners[0]
            thread.join(None if end is None else max(0.0, end - time.monotonic()))
            if thread.is_alive():
                return False
            self._pruners.pop(0)
        return True

    # ------------------------------------------------------------ reading

    def list(self) -> list[tuple[int, Path]]:
        """(step, path) of every sealed checkpoint directory, oldest first (not verified)."""
        try:
            entries = list(self.dir.iterdir())
        except OSError:
            return []
        found = [(checkpoint_step_of(p), p) for p in entries if p.is_dir()]
        return sorted((s, p) for s, p in found if s is not None)

    def newest_first(self, deep: bool = True, skip=()):
        """Yield (step, path) of every checkpoint that passes verify_checkpoint, newest first,
        warning about each one that does not (a reader that finds more damage asks for the next)."""
        for step, path in reversed(self.list()):
            problem = verify_checkpoint(path, deep=deep, skip=skip)
            if problem is None:
                yield step, path
            else:
                self.warn(f"checkpoint {problem}; falling back to an older one")

    def find_latest(self, deep: bool = True, skip=()) -> tuple[int, Path] | None:
        """The newest intact checkpoint; a torn or corrupt one is skipped with a warning."""
        for step, path in self.newest_first(deep, skip):
            return step, path
        return None

    def latest_step(self) -> int | None:
        """Cheap read for `status`: the step the pointer names (no checksum pass)."""
        try:
            name = (self.dir / POINTER_FILE).read_text(encoding="utf-8").strip()
        except OSError:
            ckpts = self.list()
            return ckpts[-1][0] if ckpts else None
        return checkpoint_step_of(name)
