"""code-tiny with another seed: the test's shortened recipe (tests/rl/test_code_tiny.py), printing the pass
rate before -> after RL (greedy eval, 5 tasks) and the train-phase share of samples passing every test in
the first 25 vs the last 50 RL steps (what the test asserts on).
Usage: PYTHONPATH=. python scripts/code_tiny_seed.py SEED [STEPS]"""
import json
import pathlib
import sys
import tempfile

import yaml

sys.path[:0] = ["tests/rl", "tests"]
from rl_helpers import REPO, code_tiny_train_windows, run_trainer, write_config
seed = int(sys.argv[1]); steps = int(sys.argv[2]) if len(sys.argv) > 2 else 250
recipe = yaml.safe_load((REPO / "hpcrl" / "recipes" / "code-tiny.yaml").read_text())["args"]
run = pathlib.Path(tempfile.mkdtemp()) / "run"

write_config(run, **{**recipe, "seed": seed, "total_steps": steps, "eval_every": 0, "save_every": 0, "threads": 1,
                     "code_tiny_train_size": 256, "ppo_epochs": 1, "mini_batches": 1, "keep_last": 2})
rc, out, err = run_trainer(run, timeout=900)
rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
first, last = code_tiny_train_windows(rows)
print(seed, steps, rc, [l for l in (out+err).splitlines() if "pass rate" in l],
      f"train all_passed first 25 steps {first:.3f} -> last 50 {last:.3f}", run)
