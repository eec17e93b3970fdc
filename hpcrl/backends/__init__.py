"""Scheduler backends, imported lazily from a registry."""

from __future__ import annotations

import importlib

from ..errors import SiteError, did_you_mean, one_of

_REGISTRY = {
    "local": "hpcrl.backends.local:LocalBackend",
    "slurm": "hpcrl.backends.slurm:SlurmBackend",
    "tpu": "hpcrl.backends.tpu:TpuBackend",
}


def names() -> list[str]:
    return sorted(_REGISTRY)


def backend_class(kind: str):
    target = _REGISTRY.get(str(kind))
    if target is None:
        raise SiteError(f"site scheduler: unknown kind '{kind}'{did_you_mean(kind, _REGISTRY)}; use one of {one_of(_REGISTRY)}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def get_backend(kind: str, site: dict | None = None):
    return backend_class(kind)(site or {})


def for_site(site: dict):
    """The backend of a resolved site profile."""
    return get_backend(site["scheduler"], site)
