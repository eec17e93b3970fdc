"""Where hpcrl's shipped data and the user's state live."""

from __future__ import annotations

import os
from pathlib import Path

_PKG = Path(__file__).resolve().parent


def _data_dir(top_level: str, package: str) -> Path:
    # In a checkout the data sits beside the package (the design's top-level layout; the links
    # hpcrl/_<name> -> ../<name> are there for the wheel's package discovery, see pyproject.toml);
    # in an installed wheel it is the data package hpcrl._<name>.
    beside = _PKG.parent / top_level
    if beside.is_dir():
        return beside
    import importlib.util

    # A data package without __init__.py is a namespace package: ask for its directory.
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else beside


def templates_dir() -> Path:
    return _data_dir("templates", "hpcrl._templates")


def site_configs_dir() -> Path:
    return _data_dir("site_configs", "hpcrl._site_configs")


def recipes_dir() -> Path:
    return _PKG / "recipes"


def hpcrl_home() -> Path:
    """The registry and local state: $HPCRL_HOME, else ~/.local/share/hpcrl."""
    env = os.environ.get("HPCRL_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".local" / "share" / "hpcrl"


def user_sites_dir() -> Path:
    """The user's own site profiles: $HPCRL_SITES_DIR, else ~/.config/hpcrl/sites."""
    env = os.environ.get("HPCRL_SITES_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".config" / "hpcrl" / "sites"
