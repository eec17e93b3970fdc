"""Shell text: the one quoting path for every value that reaches bash. Stdlib only.

The segment script (render.py), the TPU startup script (backends/tpu.py) and the adapters that
build shell text (trainers/verl.py) all quote through `q`.
"""

from __future__ import annotations

import shlex

# The job's trainer interpreter, chosen at run time (venv or hpcrl's own): adapters put it in
# argv as ctx.python; it is the one value `q` leaves as a shell variable.
TRAINER_PY = '"$trainer_py"'


class Word(str):
    """A shell word hpcrl writes itself, such as a backend's '"$hpcrl_rdzv_host:$hpcrl_rdzv_port"':
    `q` leaves it as it is. Never made from a user's string (those are plain str, always quoted)."""


def q(value) -> str:
    """Quote one value for bash. The only quoting function that user strings go through."""
    if isinstance(value, Word):
        return str.__str__(value)
    value = str(value)
    return value if value == TRAINER_PY else shlex.quote(value)


def comment(value) -> str:
    """A value shown in a `#` comment line: control characters (a newline would end the comment
    and make the rest a command) are written as escapes."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(value))


def command_line(argv: list[str]) -> str:
    """An argv as one bash command line, every word quoted by `q`."""
    return " ".join(q(a) for a in argv)
