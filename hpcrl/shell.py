"""Shell text: the one quoting path for every value that reaches bash. Stdlib only.

The segment script (render.py), the TPU startup script (backends/tpu.py) and the adapters that
build shell text (trainers/verl.py) all quote through `q`.
"""

from __future__ import annotations

import re
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


_VAR_RE = re.compile(r"\$(?:[A-Za-z_][A-Za-z0-9_]*|\{[A-Za-z_][A-Za-z0-9_]*\})")


def expandable(value) -> str:
    """A site profile's value whose $NAME and ${NAME} the job's shell expands, and nothing else
    (no command substitution, globbing or word splitting): double-quoted, with every other
    `$`, backquote, backslash and double quote escaped."""
    value, out, pos = str(value), [], 0
    for m in _VAR_RE.finditer(value):
        out += [_dq_escape(value[pos:m.start()]), m.group(0)]
        pos = m.end()
    return '"' + "".join([*out, _dq_escape(value[pos:])]) + '"'


def expandable_vars(value) -> list[str]:
    """The variables `expandable(value)` leaves for the job's shell."""
    return [m.group(0).strip("${}") for m in _VAR_RE.finditer(str(value))]


def _dq_escape(text: str) -> str:
    return re.sub(r'([$`"\\])', r"\\\1", text)


def comment(value) -> str:
    """A value shown in a `#` comment line: control characters (a newline would end the comment
    and make the rest a command) are written as escapes."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(value))


def command_line(argv: list[str]) -> str:
    """An argv as one bash command line, every word quoted by `q`."""
    return " ".join(q(a) for a in argv)
