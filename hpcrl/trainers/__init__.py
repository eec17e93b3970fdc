"""Launcher-side trainer adapters: command line, checkpoint discovery, stop method. No torch."""

from __future__ import annotations

import importlib

from ..errors import SpecError, did_you_mean, one_of

# name -> "module:Class"; imported lazily so `hpcrl --help` loads none of them.
_REGISTRY = {
    "smoke": "hpcrl.trainers.smoke:SmokeTrainer",
    "builtin": "hpcrl.trainers.builtin:BuiltinTrainer",
    "verl": "hpcrl.trainers.verl:VerlTrainer",
    "maxtext": "hpcrl.trainers.maxtext:MaxTextTrainer",
}


def names() -> list[str]:
    return sorted(_REGISTRY)


def get_trainer(name: str):
    """The adapter instance for `name`, or a SpecError listing the known trainers."""
    target = _REGISTRY.get(str(name))
    if target is None:
        raise SpecError(
            f"trainer: unknown trainer '{name}'{did_you_mean(name, _REGISTRY)}; use one of {one_of(_REGISTRY)}"
        )
    module, cls = target.split(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            raise SpecError(f"trainer: '{name}' is not available in this hpcrl build") from None
        raise
    return getattr(mod, cls)()
