"""verl 0.9.1's own code, in the verl tier's venv (scripts/verl-venv), where hpcrl's files meet it
without Ray or a model: verl's custom-reward loader on the shipped reward file, and verl's tracking
(wandb, offline) under the environment the launcher gives verl's actors, segment after segment.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest

from helpers import ROOT
from hpcrl.job import verl as verl_launch
from hpcrl.trainers.verl import VerlTrainer
from test_verl_tier import verl_python  # noqa: F401 (fixture)

pytestmark = [pytest.mark.slow]


def in_verl_venv(python, code: str, env: dict | None = None, cwd=None) -> str:
    proc = subprocess.run([python, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": "", **(env or {})}, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_code_reward_through_verls_own_reward_loader(verl_python, tmp_path):
    from hpcrl.rl.data import code_row
    from test_verl import base_args, ctx_for

    _, ctx = ctx_for(base_args(), run_dir=tmp_path)
    for rel, text in VerlTrainer().files(ctx).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    row = code_row("add", ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert set([add(1, 1)]) == {2}"],
                   "test", 0)
    overrides = [o for o in VerlTrainer().overrides(ctx) if o.startswith("reward.custom_reward_function.")]
    # verl's get_custom_reward_fn (trainer/ppo/reward.py): load_extern_object on the composed config's
    # path and name, wrapped with reward_kwargs; then called as its reward managers call it
    out = in_verl_venv(verl_python, f"""
        import json, os
        from hydra import compose, initialize_config_dir
        import verl
        from verl.trainer.ppo.reward import get_custom_reward_fn
        config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = compose(config_name="ppo_trainer", overrides={overrides!r})
        fn = get_custom_reward_fn(cfg)
        row = json.loads({json.dumps(json.dumps(row))})
        def call(response):
            return fn(data_source=row["data_source"], solution_str=response,
                      ground_truth=row["reward_model"]["ground_truth"], extra_info=row["extra_info"])
        print(json.dumps([call("```python\\ndef add(a, b):\\n    return a + b\\n```"),
                          call("```python\\ndef add(a, b):\\n    return 5\\n```"),
                          call("no code"),
                          call("```python\\nclass set:\\n    __eq__ = lambda s, o: True\\n    def __init__(s, *a): pass\\n"
                               "def add(a, b):\\n    return 5\\n```")]))
    """)
    good, third, none, rebound = json.loads(out)
    assert good["score"] == 1.0 and good["all_passed"] == 1.0, good
    assert third["score"] == pytest.approx(1 / 3, abs=1e-6), third
    assert none["score"] == 0.0, none
    # issue 40, class 1 through verl's loader: the program's own `set` is not the test's
    assert rebound["score"] == pytest.approx(1 / 3, abs=1e-6) and rebound["judged_inside"] == 0.0, rebound


def test_segments_log_to_one_wandb_run(verl_python, tmp_path):
    run_dir = tmp_path / "r-wandb"
    run_dir.mkdir()
    opts = verl_launch.parse_args(["--python", "py", "--ckpt-dir", str(run_dir / "checkpoints"), "--save-freq", "5"])
    for segment in (1, 2):
        env = verl_launch.actor_env(opts, {"HPCRL_SEGMENT": str(segment)}, run_dir)
        # verl's Tracking calls wandb.init(project, name, entity, config) with no id: the env decides
        in_verl_venv(verl_python, f"""
            from verl.utils.tracking import Tracking
            t = Tracking("hpcrl", "exp", ["wandb"], config={{"trainer": {{}}}})
            t.log({{"critic/score/mean": 0.{segment}}}, step={segment})
            t.logger["wandb"].finish()
            print("ok")
        """, env={**env, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}, cwd=tmp_path)
    dirs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(dirs) == 2, dirs
    assert {d.name.split("-", 3)[-1] for d in dirs} == {"r-wandb"}  # one run id: the run's
