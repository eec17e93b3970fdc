"""Starter specs shipped with hpcrl; `hpcrl init --recipe NAME` writes one out, comments and all."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import HpcrlError, did_you_mean, one_of

_DIR = Path(__file__).resolve().parent


def available() -> dict[str, str]:
    """name -> its title (the first comment line of the recipe)."""
    out = {}
    for p in sorted(_DIR.glob("*.yaml")):
        first = p.read_text(encoding="utf-8").splitlines()[0] if p.stat().st_size else ""
        out[p.stem] = first.lstrip("# ").strip()
    return out


def write(name: str, out: str, force: bool = False) -> Path:
    names = available()
    if name not in names:
        raise HpcrlError(f"--recipe {name}: unknown recipe{did_you_mean(name, names)}; available: {one_of(names)}")
    dest = Path(out)
    if dest.exists() and not force:
        raise HpcrlError(f"{dest} already exists; pass --force to overwrite it or --out to write elsewhere")
    text = (_DIR / f"{name}.yaml").read_text(encoding="utf-8")
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, dest)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise HpcrlError(f"cannot write {dest}: {e.strerror}") from None
    return dest
