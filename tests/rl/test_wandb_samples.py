"""MetricsLog.log_samples: a step's kept samples reach wandb as a table (TRL's completions table),
written by the real wandb (the test extra's), offline, in its own process as the trainer's rank 0
would: wandb.init starts its service and hooks the console, which the test process keeps out of."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from helpers import ROOT

# two samples of step 3 as hpcrl/rl/samples.py builds them: a two-turn prompt (its turns joined
# into the table's prompt cell), one answer with a reason and one without (an empty cell)
SAMPLES = [
    {"step": 3, "segment": 1, "sample": 0, "group": 0, "row": 7, "reward": 0.25, "advantage": -0.5,
     "reason": "wrong_answer", "terms": {"code": 0.25}, "extras": {},
     "turns": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add 2 and 3"},
               {"role": "assistant", "content": "def f(): return 6"}]},
    {"step": 3, "segment": 1, "sample": 1, "group": 0, "row": 7, "reward": 1.0, "advantage": 0.5,
     "reason": None, "terms": {"code": 1.0}, "extras": {},
     "turns": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add 2 and 3"},
               {"role": "assistant", "content": "def f(): return 5"}]},
]


def test_a_steps_samples_become_a_wandb_table_offline(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = textwrap.dedent(f"""
        import json, sys
        from hpcrl.rl.metrics import MetricsLog
        log = MetricsLog({str(run_dir / "metrics.jsonl")!r}, {str(run_dir)!r}, 1, wandb_project="hpcrl-test")
        assert log._wandb is not None, "wandb did not start"
        log.write({{"step": 3, "reward": 0.625}})
        log.log_samples(3, json.loads(sys.stdin.read()))
        log.close()
    """)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
           "WANDB_CONFIG_DIR": str(tmp_path / "config"), "WANDB_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT)}
    env.pop("WANDB_API_KEY", None)  # offline whatever the developer's shell holds
    proc = subprocess.run([sys.executable, "-c", script], input=json.dumps(SAMPLES), env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    # MetricsLog hands wandb the run directory (dir=RUN): its offline run lands in RUN/wandb
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert [r.name.rsplit("-", 1)[-1] for r in runs] == ["run"], runs  # one run, its id the run's name
    tables = list((runs[0] / "files" / "media" / "table").glob("samples_*.table.json"))
    assert len(tables) == 1, sorted(p.name for p in runs[0].rglob("*"))
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["step", "group", "prompt", "response", "reward", "reason", "advantage"]
    assert table["data"] == [
        [3, 0, "be brief\nadd 2 and 3", "def f(): return 6", 0.25, "wrong_answer", -0.5],
        [3, 0, "be brief\nadd 2 and 3", "def f(): return 5", 1.0, "", 0.5],
    ]
