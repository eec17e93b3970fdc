"""Streaming safetensors files: written and read in one pass, checksummed on the way.

A checkpoint's manifest needs a digest of every file, and a resume must verify it. Doing that
with separate passes reads every byte twice (and a resume on a new node reads it from disk
twice). Here the digest is computed chunk by chunk while the bytes are written or read, and a
load reads each tensor straight into the memory it ends up in (the model's own parameters).

The files are plain safetensors (8-byte little-endian header length, JSON header with dtype,
shape and data_offsets, then the raw bytes), so `safetensors` and `from_pretrained` read them.
"""

from __future__ import annotations

import json
import os
import struct

import torch

from .. import store

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_TORCH = {v: k for k, v in _DTYPES.items()}
_CHUNK = 1 << 20  # hashed while it is still in cache (L2)


class CorruptFile(Exception):
    """A file that does not match its manifest digest or is not a readable safetensors file."""


class ModelMismatch(ValueError):
    """An intact file whose tensors do not fit the model they are loaded into."""


def _bytes_of(t: torch.Tensor):
    """A flat uint8 numpy view of a contiguous CPU tensor (every dtype, bf16 included)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def write(path, tensors: dict, metadata: dict | None = None) -> dict:
    """Write `tensors` (name -> CPU tensor) as safetensors; return the manifest entry
    {algorithm: digest, "size": bytes} computed from the bytes as they were written."""
    header, offset, order = {}, 0, []
    for name, t in tensors.items():
        t = t.detach().contiguous()
        if t.device.type != "cpu":
            t = t.cpu()
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        order.append(t)
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    h = store.new_hasher()
    size = 0
    with open(path, "wb") as f:
        for piece in (struct.pack("<Q", len(head)), head):
            f.write(piece)
            h.update(piece)
            size += len(piece)
        for t in order:
            data = _bytes_of(t)
            for start in range(0, len(data), _CHUNK):
                chunk = data[start:start + _CHUNK]
                f.write(chunk)
                h.update(chunk)
            size += len(data)
    return {store.digest_algorithm(): h.hexdigest(), "size": size}


def read_header(f, hasher=None) -> tuple[dict, dict, int]:
    """(tensor entries, metadata, data start) from an open file positioned at 0."""
    raw = f.read(8)
    if len(raw) != 8:
        raise CorruptFile("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if n > 100 << 20:
        raise CorruptFile(f"header length {n} is not plausible")
    head = f.read(n)
    if hasher is not None:
        hasher.update(raw)
        hasher.update(head)
    try:
        header = json.loads(head)
    except ValueError as e:
        raise CorruptFile(f"unreadable header ({e})") from None
    meta = header.pop("__metadata__", None) or {}
    return header, meta, 8 + n


def _read_exactly(f, chunk: memoryview, name: str) -> None:
    got = 0
    while got < len(chunk):
        n = f.readinto(chunk[got:])
        if not n:
            raise CorruptFile(f"truncated inside tensor {name}")
        got += n


def load(path, expected: dict | None = None, into: dict | None = None) -> tuple[dict, dict]:
    """Read every tensor of `path` once, checking it against the manifest entry `expected`.

    Tensors named in `into` (name -> existing tensor of the same dtype and shape) are filled in
    place, straight from the file (on CPU: no intermediate copy); the others come back as new
    tensors. Returns (tensors read into new memory, metadata). Raises CorruptFile when the bytes
    do not match `expected` - by then `into` may be partly overwritten, so the caller restores
    from another checkpoint or from the base model.
    """
    into = into or {}
    missing = set(into)
    algo = store.entry_algorithm(expected or {})
    h = store.new_hasher(algo) if algo else None
    fresh, size = {}, 0
    with open(path, "rb", buffering=0) as f:
        if hasattr(os, "posix_fadvise"):  # one front-to-back pass: let the kernel read further ahead
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        header, meta, pos = read_header(f, h)
        size = pos
        for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = entry["data_offsets"]
            if pos + begin != size:
                raise CorruptFile(f"tensor {name} is not where the header puts it")
            dtype, shape = _TORCH.get(entry["dtype"]), torch.Size(entry["shape"])
            if dtype is None:
                raise CorruptFile(f"tensor {name} has unsupported dtype {entry['dtype']}")
            dst = into.get(name)
            if dst is not None and (dst.dtype != dtype or dst.shape != shape):
                raise ModelMismatch(f"{path}: tensor {name} is {entry['dtype']}{list(shape)}, the model has "
                                    f"{dst.dtype}{list(dst.shape)}")
            direct = dst is not None and dst.device.type == "cpu" and dst.is_contiguous()
            buf = dst.detach() if direct else torch.empty(shape, dtype=dtype)
            view = memoryview(_bytes_of(buf))
            if len(view) != end - begin:
                raise CorruptFile(f"tensor {name}: {end - begin} bytes for shape {list(shape)}")
            for start in range(0, len(view), _CHUNK):
                chunk = view[start:start + _CHUNK]
                _read_exactly(f, chunk, name)
                if h is not None:
                    h.update(chunk)
            size += len(view)
            missing.discard(name)
            if dst is None:
                fresh[name] = buf
            elif not direct:
                with torch.no_grad():
                    dst.copy_(buf)
        if h is not None:
            while rest := f.read(_CHUNK):  # trailing bytes count too: the digest covers the file
                h.update(rest)
                size += len(rest)
    if missing:
        raise ModelMismatch(f"{path} lacks {len(missing)} tensors of the model, e.g. {sorted(missing)[0]}")
    if expected is not None:
        if size != expected.get("size"):
            raise CorruptFile(f"{size} bytes, manifest says {expected.get('size')}")
        if h is not None and h.hexdigest() != expected[algo]:
            raise CorruptFile(f"fails its {algo} check")
    return fresh, meta
