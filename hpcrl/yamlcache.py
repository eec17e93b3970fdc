"""Parsed YAML kept between commands. Reading a site profile or a spec with PyYAML costs more than
the rest of `hpcrl render` (importing yaml alone is a third of it), and every command reads the
same few files: their parsed form is kept by the hash of their text under HPCRL_HOME/cache/yaml,
as JSON, only where JSON gives it back unchanged (no dates, no non-string keys). A home that
cannot hold it means no cache, never an error."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .atomicio import atomic_write_text
from .paths import hpcrl_home


def _path(text: str) -> Path:
    return hpcrl_home() / "cache" / "yaml" / f"{hashlib.sha256(text.encode('utf-8')).hexdigest()}.json"


def get(text: str) -> dict | None:
    """The mapping `text` parsed to before, or None (not kept, or unreadable)."""
    try:
        data = json.loads(_path(text).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def put(text: str, data: dict) -> None:
    """Keep `data` (what yaml.safe_load made of `text`) when JSON round-trips it exactly."""
    try:
        encoded = json.dumps(data)
    except (TypeError, ValueError):  # a date, a set, binary: not JSON's
        return
    if json.loads(encoded) != data:  # e.g. an integer key would come back a string
        return
    path = _path(text)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, encoded)
    except OSError:
        pass
