"""What a name of a run (or site) may look like: the one rule, used before a name touches a path."""

from __future__ import annotations

import re

# \Z, not $: `$` also matches before a trailing newline ("run\n" would pass).
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
# A run id is a name, or a default id: a name plus "-YYYYmmdd-HHMMSS" (16 more characters).
RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}\Z")
