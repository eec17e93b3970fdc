"""The one helper that runs external commands (scheduler CLIs, gcloud, storage listings): a
timeout, no stdin, and a one-line BackendError with the command and its stderr tail. Stdlib only."""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from .errors import BackendError


@dataclass
class CommandResult:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


def run_command(argv: list[str], timeout_s: float = 60, check: bool = True, input_text: str | None = None,
                env: dict | None = None) -> CommandResult:
    """Run a scheduler command; on failure raise BackendError with argv and the stderr tail."""
    exe = argv[0]
    if shutil.which(exe) is None and "/" not in exe:
        raise BackendError(f"'{exe}' is not on PATH; run hpcrl where the scheduler's commands are installed (a login node)")
    import subprocess  # here: render and status load this module and never run a command

    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, input=input_text,
                              env=env, stdin=None if input_text is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise BackendError(f"'{' '.join(argv[:3])} ...' did not answer within {timeout_s:.0f} s; is the scheduler up?") from None
    result = CommandResult(argv, proc.returncode, proc.stdout, proc.stderr)
    if check and proc.returncode != 0:
        raise BackendError(f"{' '.join(argv[:2])} failed: {stderr_tail(result)}")
    return result


def stderr_tail(result: CommandResult) -> str:
    """One line for the user: the last two non-empty stderr lines (or the exit code)."""
    lines = [ln.strip() for ln in (result.stderr or "").splitlines() if ln.strip()]
    return " ".join(lines[-2:])[:400] or f"exit code {result.returncode}"
