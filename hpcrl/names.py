"""What a name of a run (or site) may look like: the one rule, used before a name touches a path."""

from __future__ import annotations

import re

# \Z, not $: `$` also matches before a trailing newline ("run\n" would pass).
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
# A run id is a name, or a default id: a name plus "-YYYYmmdd-HHMMSS" (16 more characters).
RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}\Z")


# A Cloud Storage URL hpcrl can hand to gcloud and MaxText: a bucket name as Google allows it
# (3-63 lowercase letters, digits, '-', '_' and '.' per dot-separated part, up to 222 in all;
# starting and ending with a letter or digit), then an object path without spaces or quotes.
GS_URL_RE = re.compile(r"gs://([a-z0-9][a-z0-9._-]{1,220}[a-z0-9])(/[^\s'\"\\]*)?\Z")
PLACEHOLDERS = ("YOUR_", "<", ">", "{", "}")  # what a recipe's or a doc's example path looks like


def gs_url_problem(url: str) -> str | None:
    """Why `url` cannot be a real gs:// path (a placeholder or an invalid bucket name), or None."""
    if any(p in url for p in PLACEHOLDERS):
        return "is a placeholder; put your own bucket's path there"
    m = GS_URL_RE.match(url)
    if not m or any(len(part) > 63 for part in m.group(1).split(".")):
        return "is not a valid gs:// path (bucket names: 3-63 lowercase letters, digits, '-', '_', '.')"
    return None
