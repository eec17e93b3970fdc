"""Starter specs shipped with hpcrl; `hpcrl init --recipe NAME` writes one out, comments and all."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import HpcrlError, did_you_mean, one_of

_DIR = Path(__file__).resolve().parent


def available() -> dict[str, str]:
    """name -> its title: the first sentence of the recipe's opening comment (whole, though it
    may run over a few lines)."""
    return {p.stem: _title(p.read_text(encoding="utf-8")) for p in sorted(_DIR.glob("*.yaml"))}


def _title(text: str) -> str:
    import re

    words = []
    for line in text.splitlines()[:4]:
        body = line[1:].strip() if line.startswith("#") else ""
        if not body or line.startswith("#  "):  # a blank comment, YAML, or an indented example
            break
        words.append(body)
        sentence = re.match(r"^(.*?[.!?])(\s|$)", " ".join(words))
        if sentence:
            return sentence.group(1)
    return " ".join(words)


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
