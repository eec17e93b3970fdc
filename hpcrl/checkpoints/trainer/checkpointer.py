"""Checkpoints of the built-in trainer, sealed by hpcrl.checkpoints.store (manifest, rename, pointer).

Files: model.safetensors (+ config and tokenizer, so a checkpoint loads with from_pretrained, and
the base model's generation_config.json when it has one, as it was),
ref.safetensors when the reference differs from the base model, optimizer.safetensors (the
state tensors; param groups in its metadata), rng.pt and trainer_state.json (step, data
position). A save snapshots every tensor first (cheap copies in memory), so the optional
background thread writes a consistent state while training goes on.

The tensor files are written and read in one streaming pass that computes their manifest digest
on the way (tensorfile.py): a save never reads its files back, and a resume reads every byte
once, straight into the model's parameters, verifying as it goes.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

from .. import store
from . import parts, tensorfile
from .tensorfile import CorruptFile


def _clone(obj, prev=None):
    """A deep copy of obj's tensors, written into prev's tensors where they fit.

    Reusing the last snapshot's buffers matters: fresh memory costs a page fault per 4 KiB,
    which on a VM costs as much as the copy itself.
    """
    if isinstance(obj, torch.Tensor):
        obj = obj.detach()
        if (isinstance(prev, torch.Tensor) and prev.shape == obj.shape and prev.dtype == obj.dtype
                and prev.device.type == "cpu"):
            return prev.copy_(obj)
        return obj.to("cpu", copy=True)
    if isinstance(obj, dict):
        prev = prev if isinstance(prev, dict) else {}
        return {k: _clone(v, prev.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        prev = prev if isinstance(prev, (list, tuple)) and len(prev) == len(obj) else [None] * len(obj)
        return type(obj)(_clone(v, q) for v, q in zip(obj, prev))
    return obj


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuplify(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


def snapshot(model, optimizer, trainer_state: dict, ref_model=None, copy: bool = True, prev: dict | None = None) -> dict:
    """Everything a checkpoint holds. copy=True copies the tensors now (training may change the
    originals while a background thread writes them), into `prev`'s buffers where they fit;
    copy=False references the live tensors (a synchronous save: nothing changes them meanwhile)."""
    take = (lambda obj, old: _clone(obj, old)) if copy else (lambda obj, old: obj)
    prev = prev or {}
    return {
        "model": take(model.state_dict(), prev.get("model")),
        "ref": take(ref_model.state_dict(), prev.get("ref")) if ref_model is not None else None,
        "optimizer": take(optimizer.state_dict(), prev.get("optimizer")),
        "rng": _clone(rng_state()),
        "state": json.loads(json.dumps(trainer_state)),
        "config": model.config,
    }


# Files of the base model a checkpoint carries as they are: the trainer does not write them, but
# they are part of the model (generation_config.json: the sampling defaults, eos ids and all, that
# from_pretrained and vLLM read; `hpcrl export` copies what the checkpoint holds, and dropped it: #41)
MODEL_FILES = ("generation_config.json",)


def base_model_files(model_dir) -> list[Path]:
    """The MODEL_FILES the base model directory has."""
    return [Path(model_dir) / name for name in MODEL_FILES if (Path(model_dir) / name).is_file()]


class _TensorFiles:
    """The files load_into verifies as it reads them (single files and parts alike)."""

    def __contains__(self, rel) -> bool:
        return str(rel).endswith(".safetensors")


TENSOR_FILES = _TensorFiles()


def write_snapshot(snap: dict, directory: Path, tokenizer=None, model_files=()) -> dict:
    """Write a snapshot's files; return the manifest entries computed while writing them."""
    directory = Path(directory)
    known = {"model.safetensors": tensorfile.write(directory / "model.safetensors", snap["model"], {"format": "pt"})}
    tensors, meta = flatten_optimizer(snap["optimizer"])
    known["optimizer.safetensors"] = tensorfile.write(directory / "optimizer.safetensors", tensors, meta)
    known.update(write_common(snap, directory, tokenizer, model_files))
    return known


def write_part(part: dict, directory: Path, rank: int, world: int) -> dict:
    """One rank's files of a checkpoint written in parts (parts.py): its model tensors, the
    optimizer state of the same parameters, already flattened ("state.<index>.<key>"), and the
    reference's tensors of the same names when the part has them."""
    directory = Path(directory)
    model, optim = parts.part_name("model", rank, world), parts.part_name("optimizer", rank, world)
    known = {model: tensorfile.write(directory / model, part["model"], {"format": "pt"}),
             optim: tensorfile.write(directory / optim, part["optimizer"], part["meta"])}
    if part.get("ref") is not None:
        ref = parts.part_name("ref", rank, world)
        known[ref] = tensorfile.write(directory / ref, part["ref"], {"format": "pt"})
    return known


def write_common(snap: dict, directory: Path, tokenizer=None, model_files=()) -> dict:
    """What every checkpoint holds once, whoever wrote the tensors: reference model, RNG,
    config, tokenizer, the base model's own files (model_files), trainer state (and, written in
    parts, the model's index)."""
    directory = Path(directory)
    known = {}
    if snap["ref"] is not None:
        known["ref.safetensors"] = tensorfile.write(directory / "ref.safetensors", snap["ref"], {"format": "pt"})
    if snap.get("index") is not None:
        known[parts.MODEL_INDEX] = parts.write_index(directory, *snap["index"])
    torch.save(snap["rng"], directory / "rng.pt")
    snap["config"].save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    for path in model_files:
        shutil.copyfile(path, directory / Path(path).name)
    (directory / "trainer_state.json").write_text(json.dumps(snap["state"], indent=1, sort_keys=True))
    return known


def flatten_optimizer(state_dict: dict) -> tuple[dict, dict]:
    """An optimizer state_dict as safetensors: tensors "state.<param>.<key>", the rest as JSON
    metadata; optimizer_state_dict puts them back together (fsdp.py writes and reads the same)."""
    tensors, other = {}, {}
    for index, per_param in state_dict["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{key}"] = value
            else:
                other.setdefault(str(index), {})[key] = value
    return tensors, {"param_groups": _to_json(state_dict["param_groups"]), "other_state": _to_json(other)}


def _to_json(obj) -> str:
    """JSON that keeps tuples (AdamW's betas) apart from lists, so state_dict() round-trips."""
    def mark(x):
        if isinstance(x, tuple):
            return {"__tuple__": [mark(v) for v in x]}
        if isinstance(x, list):
            return [mark(v) for v in x]
        if isinstance(x, dict):
            return {k: mark(v) for k, v in x.items()}
        return x
    return json.dumps(mark(obj))


def _from_json(text: str):
    return json.loads(text, object_hook=lambda d: tuple(d["__tuple__"]) if d.keys() == {"__tuple__"} else d)


def optimizer_state_dict(state: dict, meta: dict) -> dict:
    """The optimizer state_dict from its tensors ({param index: {key: tensor}}) and the metadata
    flatten_optimizer wrote beside them (the non-tensor entries and the param groups)."""
    state = {index: dict(values) for index, values in state.items()}
    for index, values in _from_json(meta["other_state"]).items():
        state.setdefault(int(index), {}).update(values)
    return {"state": state, "param_groups": _from_json(meta["param_groups"])}


def _unflatten_optimizer(tensors: dict, meta: dict) -> dict:
    state: dict = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    return optimizer_state_dict(state, meta)


# What the deadline backstop assumes a process writes before it has timed a save of its own: far
# below this VM's local disk (1.6 GB/s, BENCHMARKS.md) and a parallel file system's per-process
# rate, so a large first save is not budgeted at a second.
SAVE_RATE_ESTIMATE_BPS = 200e6


def estimate_save_s(nbytes: int, rate_bps: float = SAVE_RATE_ESTIMATE_BPS) -> float:
    return nbytes / rate_bps


class Checkpointer:
    """Saves (optionally in a background thread, at most one in flight) and loads checkpoints."""

    def __init__(self, ckpt_dir, keep_last: int = 3, async_save: bool = True, tokenizer=None, model_files=()):
        self.ckpt_dir = Path(ckpt_dir)
        self.keep_last, self.async_save, self.tokenizer = keep_last, async_save, tokenizer
        self.model_files = list(model_files)  # base_model_files: copied into every checkpoint
        self.store = store.CheckpointStore(self.ckpt_dir, keep_last, warn=self._warn)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: dict | None = None  # the last background snapshot, reused by the next
        self.last_save_s = 0.0  # wall time of the last save, to budget the final one

    def save_now(self, step: int, model, optimizer, trainer_state: dict, ref_model=None,
                 background: bool | None = None) -> None:
        """Snapshot and save. In the background: tensors copied into the buffers of the last
        background snapshot (its write has finished: at most one save is in flight); else
        written straight from the live tensors, with no copy at all."""
        self.wait()
        background = self.async_save if background is None else background
        snap = snapshot(model, optimizer, trainer_state, ref_model, copy=background, prev=self._buffers)
        if background:
            self._buffers = snap
        self.save(step, snap, background)

    def save(self, step: int, snap: dict, background: bool | None = None) -> None:
        self.wait()  # one save at a time: publish prunes stray temp dirs of earlier saves
        background = self.async_save if background is None else background
        if background:
            self._thread = threading.Thread(target=self._write, args=(step, snap), daemon=True,
                                            name=f"ckpt-{step}")
            self._thread.start()
        else:
            self._write(step, snap)
            self._raise_pending()

    def save_part(self, step: int, tmp, part: dict, rank: int, world: int, common: dict | None = None,
                  background: bool | None = None, wait_s: float = 300.0) -> None:
        """This rank's part of a checkpoint that `world` ranks write into `tmp`, the temporary
        directory rank 0 made (parts.py). Rank 0 passes `common` (write_common's snapshot: ref,
        rng, state, config, index), writes it too, waits up to wait_s for the other ranks' parts
        and publishes; wait() on every rank then says whether its part (rank 0: the whole) is in."""
        self.wait()
        background = self.async_save if background is None else background
        args = (step, Path(tmp), part, rank, world, common, wait_s)
        if background:
            self._thread = threading.Thread(target=self._write_part, args=args, daemon=True, name=f"ckpt-{step}")
            self._thread.start()
        else:
            self._write_part(*args)
            self._raise_pending()

    def _write_part(self, step, tmp: Path, part, rank, world, common, wait_s) -> None:
        t0 = time.monotonic()
        try:
            known = write_part(part, tmp, rank, world)
            if rank:
                parts.report(tmp, rank, known)
            else:
                known.update(write_common(common, tmp, self.tokenizer, self.model_files))
                known.update(parts.collect(tmp, world, wait_s))
                self.store.publish(tmp, step, known=known, prune_in_background=True)
        except BaseException as e:  # surfaced on the main thread by wait()
            if rank:
                try:  # rank 0 stops waiting at once, and removes the directory
                    parts.report(tmp, rank, error=e)
                except OSError:
                    pass
            else:  # the others first finish (or fail) writing into it; a missing rank is not waited for twice
                parts.wait_reports(tmp, world, 0.0 if isinstance(e, TimeoutError) else wait_s)
                shutil.rmtree(tmp, ignore_errors=True)
            self._error = e
        self.last_save_s = time.monotonic() - t0

    def _write(self, step: int, snap: dict) -> None:
        t0 = time.monotonic()
        tmp = None
        try:
            tmp = self.store.new_tmp_dir()
            known = write_snapshot(snap, tmp, self.tokenizer, self.model_files)
            # old checkpoints are deleted in the background: the walltime stop's save is done
            # (and the trainer may exit) as soon as the pointer names the new one
            self.store.publish(tmp, step, known=known, prune_in_background=True)
        except BaseException as e:  # surfaced on the main thread by wait()
            # the half-written directory goes at once: on a full disk it holds the space a
            # rerun needs, and the previous checkpoint (untouched) stays the newest
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            self._error = e
        self.last_save_s = time.monotonic() - t0

    def wait(self) -> None:
        """Block until a background save has been sealed; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_pending()

    def close(self, timeout: float | None = None) -> None:
        """Wait for the pending save and for old checkpoints being deleted (before exiting)."""
        self.wait()
        self.store.wait_for_pruning(timeout)

    def _raise_pending(self):
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, OSError):
                raise err  # the caller names a full disk; an OSError stays one
            raise RuntimeError(f"checkpoint save failed: {err}") from err

    def _warn(self, message: str) -> None:
        print(f"hpcrl.rl: warning: {message}", file=sys.stderr, flush=True)

    def latest(self):
        """(step, path) of the newest intact checkpoint, or None; corrupt ones are skipped."""
        return self.store.find_latest()

    def restore(self, model, optimizer, ref_model=None):
        """Load the newest intact checkpoint into model/optimizer/ref: (step, path, trainer_state).

        Returns (None, None, touched) when there is none; touched=True means a damaged
        checkpoint was partly read into the model first (the caller restores the base weights).
        The small files are verified first; the tensor files as they are read.
        """
        touched = False
        for step, path in self.store.newest_first(skip=TENSOR_FILES):
            try:
                return step, path, load_into(path, model, optimizer, ref_model)
            except CorruptFile as e:
                touched = True
                self._warn(f"checkpoint {path.name}: {e}; falling back to an older one")
        return None, None, touched


class RanksDisagree(RuntimeError):
    """The ranks of a sharded resume found different newest checkpoints: the run directory is not
    one file system for all of them. Every rank raises it at the same point (from one gather)."""


def restore_share(ckpt: "Checkpointer", rank: int, world: int, gather, ref: bool = True):
    """A sharded resume (fsdp): the newest checkpoint whose share every rank read intact, as
    (step, path, (model tensors, optimizer tensors, optimizer metadata, reference tensors)) -
    this rank's share of parts.read_share - or (None, None, None). gather(obj) -> every rank's
    obj (a collective): the ranks agree on each checkpoint, so a file one rank finds damaged
    sends all to the next. ref=False: the run has no KL reference; its files are not read."""
    for step, path in ckpt.store.newest_first(skip=TENSOR_FILES):
        share, error = None, None
        try:
            share = parts.read_share(path, _manifest_files(path), rank, world, ref)
        except (CorruptFile, OSError) as e:
            error = str(e)
        seen = gather((step, error))
        if len({s for s, _ in seen}) > 1:
            raise RanksDisagree(f"the ranks see different newest checkpoints (steps {sorted({s for s, _ in seen})}): "
                               "the run directory must be on a file system every node shares")
        errors = [e for _, e in seen if e]
        if not errors:
            return step, path, share
        ckpt._warn(f"checkpoint {path.name}: {errors[0]}; falling back to an older one")
    gather((None, None))  # the ranks leave the search together
    return None, None, None


def load_into(path, model, optimizer, ref_model=None) -> dict:
    """Restore model, optimizer, reference and every RNG from `path`; return trainer_state.

    Parameters are filled in place from the file; the optimizer is only touched once its file
    has passed its check. Raises CorruptFile when a file fails the manifest's digest.
    """
    path, files = Path(path), _manifest_files(path)
    tensors = _reader(path, files)
    _load_model(path, files, tensors, model)
    optim_files = parts.files_of(files, "optimizer")
    if optim_files:
        got, metas = {}, []
        for name in optim_files:
            part, meta = tensors(name)
            got.update(part)
            metas.append(meta)
        optimizer.load_state_dict(_unflatten_optimizer(got, parts.merge_optimizer_meta(metas)))
    else:  # written before optimizer.safetensors existed
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=_device_of(model), weights_only=True))
    return load_common(path, ref_model)


def load_model(path, model) -> None:
    """The policy's weights alone from the checkpoint `path`, read in place and checked against its
    manifest as they are read (`hpcrl eval`: the weights as a resume loads them, no optimizer)."""
    path = Path(path)
    files = _manifest_files(path)
    _load_model(path, files, _reader(path, files), model)


def _load_model(path: Path, files: dict, tensors, model) -> None:
    model_files = parts.files_of(files, "model")
    if len(model_files) == 1:
        _load_module(model, tensors, model_files[0])
    elif model_files:  # written in parts (fsdp): each file fills the parameters the index puts in it
        _load_parts(model, tensors, model_files, path)
    else:
        raise CorruptFile("no model tensors in the manifest")


def load_common(path, ref_model=None) -> dict:
    """The reference model (when it was saved: one file, or in parts), every RNG and the trainer
    state from `path`."""
    path = Path(path)
    files = _manifest_files(path)
    ref_files = parts.files_of(files, "ref")
    if ref_model is not None and ref_files == ["ref.safetensors"]:
        _load_module(ref_model, _reader(path, files), "ref.safetensors")
    elif ref_model is not None and ref_files:
        _load_parts(ref_model, _reader(path, files), ref_files, path, "ref")
    set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    return json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))


def _manifest_files(path) -> dict:
    manifest = store.read_manifest(path)
    if manifest is None:
        raise CorruptFile(f"missing or unreadable {store.MANIFEST_FILE}")
    return manifest["files"]


def _reader(path: Path, files: dict):
    def tensors(name: str, into=None):
        if name not in files:
            raise CorruptFile(f"{name} is not in the manifest")
        try:
            return tensorfile.load(path / name, files[name], into)
        except CorruptFile as e:
            raise CorruptFile(f"file {name}: {e}") from None
    return tensors


def _load_module(module, tensors, name: str) -> None:
    """Every entry of module's state_dict, read in place; the file must hold exactly those."""
    targets = module.state_dict()  # detached views of the parameters and persistent buffers
    extra, _ = tensors(name, into=targets)
    if extra:
        raise CorruptFile(f"file {name} has tensors the model does not: {sorted(extra)[:3]}")


def _load_parts(module, tensors, names: list, path: Path, kind: str = "model") -> None:
    """Parts of `kind` into an unsharded module: each file fills the entries the model's index
    puts in it (the reference's parts follow the model's index)."""
    try:
        weight_map = json.loads((path / parts.MODEL_INDEX).read_text(encoding="utf-8"))["weight_map"]
        weight_map = parts.weight_map_of(weight_map, kind)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptFile(f"{parts.MODEL_INDEX}: {e}") from None
    targets = module.state_dict()
    if set(weight_map) != set(targets) or not set(weight_map.values()) <= set(names):
        raise CorruptFile(f"{parts.MODEL_INDEX} does not name the model's tensors in its files")
    for name in names:
        extra, _ = tensors(name, into={k: v for k, v in targets.items() if weight_map[k] == name})
        if extra:
            raise CorruptFile(f"file {name} has tensors its index does not put there: {sorted(extra)[:3]}")


def _device_of(model):
    return next(model.parameters()).device
