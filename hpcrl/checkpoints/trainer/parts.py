"""Checkpoints written in parts, one per rank, by a sharded (fsdp) run.

A sharded run must not funnel a large model through rank 0: each rank gathers the full tensors
it owns (whole tensors, assigned by size so every rank writes about 1/world of the bytes) and
writes them itself:

    model-00001-of-00002.safetensors, model-00002-of-00002.safetensors, model.safetensors.index.json
    optimizer-00001-of-00002.safetensors, ...     (the AdamW state of the same parameters)
    ref-00001-of-00002.safetensors, ...           (the KL reference after a warm-up: the model's
                                                   names, so the model's index places them too)

The model files are Hugging Face's sharded layout (the index's weight_map says which file holds
each tensor), so `from_pretrained` loads a checkpoint as it loads a single model.safetensors;
the optimizer files use the single-file names ("state.<param index>.<key>"), so nothing in a
checkpoint depends on the world size that wrote it: 1 rank, ddp and fsdp of any size read each
other's checkpoints.

The ranks meet in the checkpoint's temporary directory, not in a collective: a background save
runs in a thread while the main threads go on with their own collectives. Each other rank
writes its files, then `.part-RANK.json` with the digests it computed while writing (or its
error); rank 0 writes its own part and the small files, waits for every part file, and only
then publishes the checkpoint (manifest, rename, pointer), so a checkpoint is complete or absent.
A resume reads the same way round: each rank reads and verifies a share of the files.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from .. import store
from . import tensorfile

MODEL_INDEX = "model.safetensors.index.json"
_PART = re.compile(r"^(model|optimizer|ref)-(\d{5})-of-(\d{5})\.safetensors$")
KINDS = ("model", "optimizer", "ref")


def part_name(kind: str, rank: int, world: int) -> str:
    return f"{kind}-{rank + 1:05d}-of-{world:05d}.safetensors"


def weight_map_of(weight_map: dict, kind: str) -> dict:
    """The model index's weight_map for the files of `kind` (the reference's parts hold the
    same names as the model's, in the files of the same ranks)."""
    return {name: kind + file[len("model"):] for name, file in weight_map.items()}


def is_part(name: str, kind: str | None = None) -> bool:
    m = _PART.match(Path(name).name)
    return m is not None and (kind is None or m.group(1) == kind)


def assign(sizes: dict, world: int) -> dict:
    """name -> rank: whole tensors, largest first to the least loaded rank (ties: lowest rank),
    the same on every rank (it depends only on the names and sizes)."""
    load = [0] * world
    owner = {}
    for name, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += size
    return owner


def write_index(directory: Path, weight_map: dict, total_size: int) -> dict:
    """Hugging Face's model.safetensors.index.json; returns its manifest entry."""
    path = Path(directory) / MODEL_INDEX
    path.write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map},
                               indent=1, sort_keys=True))
    return {store.digest_algorithm(): store.file_digest(path), "size": path.stat().st_size}


def _marker(directory: Path, rank: int) -> Path:
    return Path(directory) / f".part-{rank}.json"


def _failed(directory: Path, rank: int) -> list:
    """The empty marker a rank leaves when even its report could not be written (a full disk
    still takes an empty file: it needs an inode, no data block); its name carries the errno."""
    return list(Path(directory).glob(f".part-{rank}.failed-*"))


def report(directory: Path, rank: int, known: dict | None = None, error: BaseException | None = None) -> None:
    """A rank's part is written (its digests) or failed (why): what rank 0 waits for."""
    path = _marker(directory, rank)
    tmp = path.with_name(path.name + ".tmp")
    failed = None if error is None else {"error": f"{type(error).__name__}: {error}",
                                         "errno": getattr(error, "errno", None),
                                         "filename": str(getattr(error, "filename", None) or "") or None}
    try:
        tmp.write_text(json.dumps({"known": known or {}, **(failed or {"error": None})}))
        os.replace(tmp, path)  # rank 0 never reads half a report
    except OSError:
        if error is None:
            raise
        (Path(directory) / f".part-{rank}.failed-{getattr(error, 'errno', None) or 0}").touch()


def collect(directory: Path, world: int, timeout_s: float) -> dict:
    """Every other rank's digests (rank 0's thread, before it publishes); the report files go.
    Raises when a rank failed or did not report within timeout_s (it died: the segment fails)."""
    known, waiting = {}, set(range(1, world))
    end = time.monotonic() + timeout_s
    while waiting:
        for rank in sorted(waiting):
            try:
                got = json.loads(_marker(directory, rank).read_text())
            except (OSError, ValueError):
                failed = _failed(directory, rank)
                if not failed:
                    continue
                code = int(failed[0].name.rsplit("-", 1)[1])
                got = {"error": f"errno {code} ({os.strerror(code)})" if code else "an error",
                       "errno": code or None, "filename": str(directory)}
            if got.get("error"):
                if got.get("errno"):  # an OSError stays one: a full disk is named as such
                    raise OSError(got["errno"], f"rank {rank} failed to write its part: {got['error']}",
                                  got.get("filename"))
                raise RuntimeError(f"rank {rank} failed to write its part: {got['error']}")
            known.update(got["known"])
            waiting.discard(rank)
        if waiting:
            if time.monotonic() > end:
                raise TimeoutError(f"ranks {sorted(waiting)} did not write their checkpoint parts within "
                                   f"{timeout_s:.0f} s")
            time.sleep(0.02)
    for rank in range(1, world):  # not part of the checkpoint
        _marker(directory, rank).unlink()
    return known


def wait_reports(directory: Path, world: int, timeout_s: float) -> None:
    """Until every other rank has reported (or timeout_s): a failed save's directory is removed
    only once no rank still writes into it, so nothing of it is left behind."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and not all(_marker(directory, r).exists() or _failed(directory, r)
                                             for r in range(1, world)):
        time.sleep(0.02)


def files_of(manifest_files, kind: str) -> list:
    """The checkpoint's files of one kind (model, optimizer or ref): its parts, else the single file."""
    parts = sorted(rel for rel in manifest_files if is_part(rel, kind))
    return parts or ([f"{kind}.safetensors"] if f"{kind}.safetensors" in manifest_files else [])


def merge_optimizer_meta(metas: list) -> dict:
    """One optimizer part's metadata per file -> the single-file metadata (param groups are the
    same in each part; the non-tensor state is each part's own parameters')."""
    other = {}
    for meta in metas:
        other.update(json.loads(meta.get("other_state", "{}")))
    return {"param_groups": metas[0]["param_groups"], "other_state": json.dumps(other)}


def read_share(path: Path, files: dict, rank: int, world: int, ref: bool = True) -> tuple[dict, dict, list, dict]:
    """Read and verify this rank's share of a checkpoint's tensor files (the model's, the
    optimizer's and the reference's, dealt round-robin over the ranks): (model tensors, optimizer
    tensors, optimizer metadata of each optimizer file read, reference tensors). ref=False: a run
    without a KL reference reads none of its files. Raises tensorfile.CorruptFile."""
    got, metas = {kind: {} for kind in KINDS}, []
    kinds = KINDS if ref else KINDS[:2]
    for kind, rel in [(kind, rel) for kind in kinds for rel in files_of(files, kind)][rank::world]:
        try:
            tensors, meta = tensorfile.load(Path(path) / rel, files[rel])
        except tensorfile.CorruptFile as e:
            raise tensorfile.CorruptFile(f"file {rel}: {e}") from None
        got[kind].update(tensors)
        if kind == "optimizer":
            metas.append(meta)
    return got["model"], got["optimizer"], metas, got["ref"]
