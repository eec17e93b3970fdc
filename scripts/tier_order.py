#!/usr/bin/env python3
"""Which order of the tier files (tests/conftest.py TIERS) ends the tiers phase first, simulated.

    scripts/tier_order.py            (every order of the six files, the best first, and TIERS's own)

xdist's loadfile scheduler gives each worker one file in order, then hands a worker the next file
whenever it has two tests or fewer left, running or queued (xdist/scheduler/loadscope.py,
`_reschedule`): a file of one or two tests takes its successor at once, onto the same worker. The
simulation replays that rule with each file's tests' seconds (the slow test first, as conftest
orders them), measured in a full quiet run (session 16's q2; relative figures only).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

TESTS = {  # file -> its tests' seconds, slow first (q2, scripts/suite_times.py)
    "test_demo.py": [100], "test_smollm2.py": [480, 3, 3, 3, 3], "test_verl_tier.py": [830, 10],
    "test_maxtext_tier.py": [770, 5, 5], "test_vllm_tier.py": [140, 140], "test_verl_tier_slurm.py": [700],
    "test_llm_judge_tier.py": [150], "test_smollm2_code.py": [300, 1],  # session 19, measured loaded
}


def simulate(order, workers=3):
    queue, work = list(order), {w: [] for w in range(workers)}
    clock, got = dict.fromkeys(work, 0.0), {w: [] for w in work}

    def hand(w):
        name = queue.pop(0)
        work[w] += TESTS[name]
        got[w].append(name)

    for w in work:
        hand(w)
    for w in work:
        if queue and len(work[w]) <= 2:
            hand(w)
    while any(work.values()):
        w = min((w for w in work if work[w]), key=lambda w: clock[w] + work[w][0])
        clock[w] += work[w].pop(0)
        if queue and len(work[w]) <= 2:
            hand(w)
    return max(clock.values()), got


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import TIERS

    ranked = sorted((simulate(p)[0], p) for p in itertools.permutations(TESTS))
    for end, order in ranked[:5]:
        print(f"{end:6.0f} s  {' '.join(order)}")
    print(f"{simulate(TIERS)[0]:6.0f} s  TIERS (tests/conftest.py): {simulate(TIERS)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
