"""#41 item 7: every environment variable a user may set for hpcrl is documented (HPCRL_CACHE was
only in the source). The variables hpcrl sets for itself inside its jobs are listed here instead,
each with who sets it, so a new user-facing one cannot slip by undocumented."""

from __future__ import annotations

import re

from helpers import ROOT

# set by hpcrl's own job scripts and backends, or a test hook: not for users
INTERNAL = {
    "HPCRL_GPUS_REQUIRED": "the segment script, where it checks the GPUs",
    "HPCRL_JOB_ID": "the local backend, for its job's script",
    "HPCRL_JOB_END_TIME": "the local backend and the TPU startup script",
    "HPCRL_GS": "the TPU startup script's gcloud command (tests replace it with a double)",
}


def test_every_hpcrl_variable_the_code_reads_is_documented_or_internal():
    read = set()
    for path in (ROOT / "hpcrl").rglob("*.py"):
        read.update(re.findall(r"environ(?:\.get)?\(?\[?\"(HPCRL_[A-Z0-9_]+)", path.read_text(encoding="utf-8")))
    assert "HPCRL_CACHE" in read and "HPCRL_HOME" in read  # the scan finds what it is meant to
    docs = (ROOT / "README.md").read_text(encoding="utf-8") + "".join(
        p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    undocumented = sorted(v for v in read - set(INTERNAL) if f"${v}" not in docs and f"`{v}" not in docs)
    assert undocumented == [], f"say in README.md or docs/ what these do: {undocumented}"
    assert "`$HPCRL_CACHE` if set" in docs
