"""What a name of a run (or site) may look like: the one rule, used before a name touches a path."""

from __future__ import annotations

import re

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
