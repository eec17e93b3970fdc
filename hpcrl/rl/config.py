"""The built-in trainer's arguments, as the trainer reads them: one frozen, typed object. Stdlib only.

The table itself (every key, its default, bounds and meaning) and the algorithm registry live in
hpcrl/schemas/builtin.py, which the launcher's adapter checks the spec with too: one schema,
two users. `TrainerConfig` is made from that table (a field per row, typed by its kind), so a key
is declared once; `resolve` is the one place a dict becomes one, through the schema's checks (a
wrong key fails there, with the schema's one-line message).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..schemas import ArgError
from ..schemas.builtin import ALGORITHMS, SCHEMA


class ConfigError(ValueError):
    """A bad trainer argument; the message names the key."""


_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "list": list, "map": object, "choice": object}


class _Keys:
    """Read access by key as well as by attribute: the reward, data and engine modules (and their
    tests, which pass plain dicts) take the arguments as a mapping."""

    __slots__ = ()

    def __getitem__(self, key: str):
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def get(self, key: str, default=None):
        return getattr(self, key, default)

    def __contains__(self, key: str) -> bool:
        return key in _NAMES

    def keys(self):
        return _NAMES

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# frozen: a segment's arguments never change under it; one field per row of SCHEMA, in table order
TrainerConfig = dataclasses.make_dataclass(
    "TrainerConfig",
    [(f.name, _TYPES[f.kind] if not f.nullable else object) for f in SCHEMA.fields.values()],
    bases=(_Keys,), frozen=True)
TrainerConfig.__module__ = __name__
TrainerConfig.__doc__ = "The built-in trainer's arguments (hpcrl/schemas/builtin.py's SCHEMA), checked."
_NAMES = tuple(f.name for f in dataclasses.fields(TrainerConfig))


def resolve(args: dict) -> TrainerConfig:
    """Defaults merged with `args`, every value checked by the schema (ConfigError names the field);
    a null loss_agg becomes the algorithm's own."""
    try:
        cfg = SCHEMA.validate(args)
    except ArgError as e:
        raise ConfigError(str(e)) from None
    cfg["loss_agg"] = cfg["loss_agg"] or ALGORITHMS[cfg["algorithm"]].loss_agg
    return TrainerConfig(**cfg)


def load(path) -> TrainerConfig:
    """The trainer.json written by the launcher (or by hand), resolved."""
    try:
        args = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read trainer config {path}: {e}") from None
    if not isinstance(args, dict):
        raise ConfigError(f"{path}: expected a JSON object of trainer arguments")
    return resolve(args)
