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
