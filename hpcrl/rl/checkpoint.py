"""Checkpoints of the built-in trainer, sealed with hpcrl.protocol (manifest, rename, pointer).

Files: model.safetensors (+ config and tokenizer, so a checkpoint loads with from_pretrained),
ref.safetensors when the reference differs from the base model, optimizer.pt, rng.pt and
trainer_state.json (step, data position). A save snapshots every tensor first (cheap copies in
memory), so the optional background thread writes a consistent state while training goes on.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .. import protocol

# Test hook: seconds to pause inside a save, between the files and the seal, so a test can
# kill -9 the process while a checkpoint is half written.
_TEST_PAUSE_ENV = "HPCRL_RL_TEST_SAVE_PAUSE_S"


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
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


def snapshot(model, optimizer, trainer_state: dict, ref_model=None) -> dict:
    """Everything a checkpoint holds, copied now (training may change the originals next)."""
    return {
        "model": _clone(model.state_dict()),
        "ref": _clone(ref_model.state_dict()) if ref_model is not None else None,
        "optimizer": _clone(optimizer.state_dict()),
        "rng": _clone(rng_state()),
        "state": json.loads(json.dumps(trainer_state)),
        "config": model.config,
    }


def write_snapshot(snap: dict, directory: Path, tokenizer=None) -> None:
    directory = Path(directory)
    save_file({k: v.contiguous() for k, v in snap["model"].items()}, directory / "model.safetensors",
              metadata={"format": "pt"})
    if snap["ref"] is not None:
        save_file({k: v.contiguous() for k, v in snap["ref"].items()}, directory / "ref.safetensors")
    torch.save(snap["optimizer"], directory / "optimizer.pt")
    torch.save(snap["rng"], directory / "rng.pt")
    snap["config"].save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    pause = float(os.environ.get(_TEST_PAUSE_ENV) or 0)
    if pause:
        time.sleep(pause)
    (directory / "trainer_state.json").write_text(json.dumps(snap["state"], indent=1, sort_keys=True))


class Checkpointer:
    """Saves (optionally in a background thread, at most one in flight) and loads checkpoints."""

    def __init__(self, ckpt_dir, keep_last: int = 3, async_save: bool = True, tokenizer=None):
        self.ckpt_dir = Path(ckpt_dir)
        self.keep_last, self.async_save, self.tokenizer = keep_last, async_save, tokenizer
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_save_s = 0.0  # wall time of the last save, to budget the final one

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

    def _write(self, step: int, snap: dict) -> None:
        t0 = time.monotonic()
        try:
            tmp = protocol.new_checkpoint_dir(self.ckpt_dir)
            write_snapshot(snap, tmp, self.tokenizer)
            protocol.publish_checkpoint(self.ckpt_dir, tmp, step, keep_last=self.keep_last)
        except BaseException as e:  # surfaced on the main thread by wait()
            self._error = e
        self.last_save_s = time.monotonic() - t0

    def wait(self) -> None:
        """Block until a background save has been sealed; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_pending()

    def _raise_pending(self):
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"checkpoint save failed: {err}") from err

    def latest(self):
        """(step, path) of the newest intact checkpoint, or None; corrupt ones are skipped."""
        return protocol.find_latest_checkpoint(
            self.ckpt_dir, warn=lambda m: print(f"hpcrl.rl: warning: {m}", file=sys.stderr, flush=True))


def load_into(path, model, optimizer, ref_model=None) -> dict:
    """Restore model, optimizer, reference and every RNG from `path`; return trainer_state."""
    path = Path(path)
    model.load_state_dict(load_file(path / "model.safetensors", device=str(_device_of(model))))
    if ref_model is not None and (path / "ref.safetensors").exists():
        ref_model.load_state_dict(load_file(path / "ref.safetensors", device=str(_device_of(ref_model))))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=_device_of(model), weights_only=True))
    set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    return json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))


def _device_of(model):
    return next(model.parameters()).device
