"""The reward side moved from hpcrl/rl to hpcrl/rewards (issue 40, item 5). What was written
before the move names the old places and must still score: a spec's `args.reward:
hpcrl.rl.rewards:compute_score`, a reward file's `from hpcrl.rl import rewards, sandbox`, and a verl
override `reward.custom_reward_function.path=<...>/hpcrl/rl/rewards.py` that verl loads by path,
in a worker where hpcrl itself may not be importable."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from hpcrl.rewards import mix, sandbox, score

REPO = Path(__file__).resolve().parents[2]
CODE_GT = json.dumps({"tests": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]})
GOOD = "```python\ndef add(a, b):\n    return a + b\n```"


def test_the_old_module_names_are_the_new_modules():
    import hpcrl.rl.rewards
    import hpcrl.rl.sandbox
    from hpcrl.rl import rewards as old_rewards, sandbox as old_sandbox

    # the same objects, not copies: a monkeypatch, the fork server and the clean-value cache are shared
    assert hpcrl.rl.rewards is score and old_rewards is score
    assert hpcrl.rl.sandbox is sandbox and old_sandbox is sandbox


def test_a_spec_naming_the_old_module_scores_through_the_trainers_reward():
    # a frozen trainer.json of a run created before the move: args.reward names hpcrl.rl.rewards
    from hpcrl.rl.config import resolve

    cfg = resolve({"reward": "hpcrl.rl.rewards:compute_score"})
    rows = [{"data_source": "code", "ground_truth": CODE_GT, "extra_info": {}, "messages": []},
            {"data_source": "countdown", "ground_truth": {"target": 6, "numbers": [2, 3]}, "extra_info": {},
             "messages": []}]
    scores, metrics = mix.Reward(cfg)(rows, [GOOD, "<answer>2 * 3</answer>"])
    assert scores == [1.0, 1.0], (scores, metrics)


def test_verls_path_to_the_old_file_loads_without_hpcrl_importable(tmp_path):
    # hpcrl as installed (site-packages/hpcrl/...), loaded by path the way verl's load_extern_object
    # does, by an interpreter that cannot import hpcrl (-I -S: no site, no editable install)
    site = tmp_path / "site-packages" / "hpcrl"
    (site / "rl").mkdir(parents=True)
    shutil.copy(REPO / "hpcrl" / "rl" / "rewards.py", site / "rl" / "rewards.py")
    shutil.copytree(REPO / "hpcrl" / "rewards", site / "rewards", ignore=shutil.ignore_patterns("__pycache__"))
    script = (
        "import importlib.util, json, sys\n"
        "try:\n    import hpcrl\n    sys.exit('hpcrl is importable here: the test would prove nothing')\n"
        "except ImportError:\n    pass\n"
        f"spec = importlib.util.spec_from_file_location('custom_module', {str(site / 'rl' / 'rewards.py')!r})\n"
        "mod = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(mod)\n"
        f"good = mod.compute_score('code', {GOOD!r}, {CODE_GT!r})\n"
        f"batch = mod.compute_score_batch(['code', 'code'], [{GOOD!r}, 'def add(a, b): return 5'], [{CODE_GT!r}] * 2)\n"
        "print(json.dumps([good['score'], [b['score'] for b in batch], mod.countdown_score('<answer>2*3</answer>', "
        "{'target': 6, 'numbers': [2, 3]})]))\n"
    )
    out = subprocess.run([sys.executable, "-I", "-S", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [1.0, [1.0, 0.5], 1.0], out.stdout
