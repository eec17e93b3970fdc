"""The built-in trainer's arguments, as the trainer reads them. Stdlib only.

The table itself (every key, its default, bounds and meaning) and the algorithm registry live in
hpcrl/schemas/builtin.py, which the launcher's adapter checks the spec with too: one schema,
two users.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..schemas import ArgError
from ..schemas.builtin import ALGORITHMS, SCHEMA


class ConfigError(ValueError):
    """A bad trainer argument; the message names the key."""


def resolve(args: dict) -> dict:
    """Defaults merged with `args`, every value checked by the schema (ConfigError names the field);
    a null loss_agg becomes the algorithm's own."""
    try:
        cfg = SCHEMA.validate(args)
    except ArgError as e:
        raise ConfigError(str(e)) from None
    cfg["loss_agg"] = cfg["loss_agg"] or ALGORITHMS[cfg["algorithm"]].loss_agg
    return cfg


def load(path) -> dict:
    """The trainer.json written by the launcher (or by hand), resolved."""
    try:
        args = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read trainer config {path}: {e}") from None
    if not isinstance(args, dict):
        raise ConfigError(f"{path}: expected a JSON object of trainer arguments")
    return resolve(args)
