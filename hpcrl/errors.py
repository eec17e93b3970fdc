"""User-facing errors. The CLI prints these as one line, without a traceback.

Every message names what is wrong (field, flag or file), the bad value, and how to fix it.
Anything that is not an HpcrlError is a bug and keeps its traceback.
"""

from __future__ import annotations


class HpcrlError(Exception):
    """A mistake the user can fix; the message says how."""


class SpecError(HpcrlError):
    """A bad value in a spec, a site profile or a flag."""


class SiteError(HpcrlError):
    """A site profile that is missing, malformed, or lacks a required value."""


class RunError(HpcrlError):
    """An operation that the run's current state does not allow."""


class BackendError(HpcrlError):
    """A scheduler command failed; the message carries its stderr tail."""


def did_you_mean(word: str, choices) -> str:
    """' (did you mean 'x'?)' when a close match exists, else ''."""
    import difflib  # only on the error path

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def one_of(choices) -> str:
    return ", ".join(sorted(str(c) for c in choices))


def not_a_model_dir(key: str, path) -> str:
    """Why `path` (given as `key`) is not a Hugging Face model directory, in one line: that it does
    not exist, the near paths that are models (a mistyped name; a directory above a model), and
    only then how to get one. A mistyped path was answered with a download command into it (#41)."""
    from pathlib import Path

    path = Path(path)
    if path.is_dir():
        what = "is not a Hugging Face model directory (no config.json)"
        near = sorted(str(p.parent) for p in path.glob("*/config.json"))[:3]
        said = f" (models in it: {', '.join(near)})" if near else ""
    else:
        what = "is a file, not a model directory" if path.exists() else "does not exist"
        near = _near_models(path)
        said = f" (did you mean {' or '.join(near)}?)" if near else ""
    return (f"{key}: {path} {what}{said}; to get a model, download it on a login node "
            f"(`huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir DIR`) and give DIR as {key}")


def _near_models(path) -> list:
    """Model directories whose path differs from `path` by a near name in its first missing part."""
    import difflib

    parts = path.parts
    for i in range(len(parts) - 1, 0, -1):
        above = path.parents[len(parts) - 1 - i]  # the path's first i parts
        if above.is_dir():
            break
    else:
        return []
    try:
        names = [p.name for p in above.iterdir()]
    except OSError:
        return []
    rest = parts[i + 1:]
    close = difflib.get_close_matches(parts[i], names, n=3, cutoff=0.6)
    found = [above.joinpath(name, *rest) for name in close]
    return [str(p) for p in found if (p / "config.json").is_file()]
