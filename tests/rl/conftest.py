"""On a host where the code sandbox can only be 'plain' (no root, no unprivileged user namespaces)
the sandbox refuses unless allowed (issue 28): the tests allow it there, so they still exercise
that level (tests/rl/test_sandbox_privilege.py checks the refusal with its own environment)."""

import os
import sys

from hpcrl.rewards import sandbox

if sandbox._probe(os.path.realpath(sys.executable)) == "plain":
    os.environ.setdefault("HPCRL_SANDBOX_PLAIN", "1")
