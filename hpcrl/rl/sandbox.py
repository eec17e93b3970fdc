"""Moved to hpcrl/rewards/sandbox.py (issue 40). This name stays because reward files written
before the move import it (`from hpcrl.rl import rewards, sandbox`, docs/adapt.md's example)."""

import sys

from ..rewards import sandbox as _moved

sys.modules[__name__] = _moved  # one module under both names: its fork server and caches are shared
