"""`hpcrl samples RUN` for a verl run (issue 41 item 1): verl's own dump of each step
(trainer.rollout_data_dir = RUN/verl/rollouts, set by the adapter) read as hpcrl's sample records,
with the filters of the built-in trainer's samples; the job-side launcher's pruning and thinning
of the dump. The fixtures are verl 0.9.1's real output (tests/data/verl/README.md); a real verl
run's `hpcrl samples` is asserted in tests/test_verl_tier.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl import cli
from hpcrl.job import verl_rollouts

DATA = Path(__file__).resolve().parent / "data" / "verl"
COUNTDOWN = DATA / "rollouts"  # steps 1 and 2 of the verl tier's PPO run on this CPU
CODE = DATA / "rollouts_code"  # step 3: verl's writer, hpcrl's code reward's results


def test_verls_dump_reads_as_sample_records():
    recs = verl_rollouts.read_step(CODE, 3)
    assert [r["sample"] for r in recs] == [0, 1, 2, 3] and {r["step"] for r in recs} == {3}
    first = recs[0]
    assert first["turns"][0]["role"] == "user" and "Write a Python function add(a, b)" in first["turns"][0]["content"]
    assert first["turns"][-1] == {"role": "assistant", "content": "```python\ndef add(a, b):\n    return a + b\n```"}
    assert [r["reward"] for r in recs] == [1.0, 0.5, 0.0, 0.0]
    assert [r["reason"] for r in recs] == ["ok", "wrong_answer", "syntax_error", "syntax_error"]
    # the reward's other keys, verl's own columns left out (score is the reward, reason its own field)
    assert first["extras"] == {"pass_rate": 1.0, "all_passed": 1.0, "judged_inside": 0.0, "extract": "fenced"}
    assert json.loads(first["ground_truth"]) == {"tests": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]}
    assert {r["group"] for r in recs} == {0}  # one prompt, four answers


def test_a_countdown_step_groups_responses_by_their_prompt():
    recs = verl_rollouts.read_step(COUNTDOWN, 2)
    raw = [json.loads(ln) for ln in (COUNTDOWN / "2.jsonl").read_text().splitlines()]
    assert len(recs) == len(raw) == 16
    assert [r["turns"][-1]["content"] for r in recs] == [d["output"] for d in raw]
    assert [r["ground_truth"] for r in recs] == [d["gts"] for d in raw]
    assert all(r["reason"] is None and r["extras"] == {"acc": r["reward"]} for r in recs)  # a float reward
    # verl's batch is reordered (balance_batch): equal prompts share a group, numbered as first seen
    by_group: dict[int, set] = {}
    for r in recs:
        by_group.setdefault(r["group"], set()).add(r["turns"][0]["content"])
    assert sorted(by_group) == [0, 1, 2, 3] and all(len(p) == 1 for p in by_group.values())
    assert len({next(iter(p)) for p in by_group.values()}) == 4


def test_a_torn_last_line_and_foreign_files_are_left_out(tmp_path):
    shutil.copy(CODE / "3.jsonl", tmp_path / "3.jsonl")
    with open(tmp_path / "3.jsonl", "a") as f:
        f.write('{"input": "half a li')  # verl's writer opens the file "w" and writes line by line
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "4.jsonl.tmp").write_text("x")
    assert verl_rollouts.list_steps(tmp_path) == {3: (tmp_path / "3.jsonl").stat().st_size}
    assert len(verl_rollouts.read_step(tmp_path, 3)) == 4
    assert verl_rollouts.read_step(tmp_path, 9) == []


def test_the_launcher_prunes_steps_past_the_checkpoint_and_thins_to_a_budget(tmp_path):
    for step in range(1, 11):
        shutil.copy(COUNTDOWN / "1.jsonl", tmp_path / f"{step}.jsonl")
    # a lost segment trained to 10 past its checkpoint at 7: 8-10 are trained (and dumped) again
    assert verl_rollouts.prune(tmp_path, 7) == [8, 9, 10]
    assert list(verl_rollouts.list_steps(tmp_path)) == list(range(1, 8))
    one = (tmp_path / "1.jsonl").stat().st_size
    # the built-in store's rule: the newest half whole, the older half every 2nd step
    assert verl_rollouts.thin(tmp_path, 5 * one) == [1, 3]
    assert list(verl_rollouts.list_steps(tmp_path)) == [2, 4, 5, 6, 7]
    assert verl_rollouts.prune(tmp_path, None) == [2, 4, 5, 6, 7]  # no checkpoint: the run starts over


# ---------------------------------------------------------------- the command on a verl run


@pytest.fixture
def verl_run(home):
    from hpcrl import control
    from hpcrl.spec import resolve

    args = ["args.model=/m/tiny", "args.train_files=/d/train.parquet", "args.val_files=/d/test.parquet",
            f"site.outputs={os.environ['HPCRL_HOME']}/runs"]
    run = control.create_run(resolve(None, "local", args, {"trainer": "verl"}), "vsm")
    assert run.state()["trainer"] == "verl"
    return run


def _dump(run, source: Path, step: int) -> None:
    dest = verl_rollouts.rollouts_dir(run.dir)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / f"{step}.jsonl", dest / f"{step}.jsonl")


def test_a_verl_run_without_a_dump_is_one_line(verl_run, capsys):
    assert cli.main(["samples", "vsm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hpcrl: error: no samples recorded yet: run 'vsm' has no step of verl's in "
                          f"{verl_run.dir / 'verl' / 'rollouts'}") and err.count("\n") == 1


def test_samples_of_a_verl_run_with_step_worst_best_reason_and_export(verl_run, capsys):
    _dump(verl_run, COUNTDOWN, 1)
    _dump(verl_run, COUNTDOWN, 2)
    _dump(verl_run, CODE, 3)
    assert cli.main(["samples", "vsm"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run vsm, step 3 (kept: 1-3): 4 of 4 samples; reward mean 0.375")
    assert "reason wrong_answer" in out and "    return 5" in out and "extract fenced" in out
    assert cli.main(["samples", "vsm", "--best", "--limit", "1"]) == 0
    best = capsys.readouterr().out
    assert "3 steps" in best and "reward 1.000" in best and "return a + b" in best
    assert cli.main(["samples", "vsm", "--reason", "syntax_error"]) == 0
    out = capsys.readouterr().out
    assert "2 of 2 samples" in out and "The sum of a and b." in out and "return 5" not in out
    assert cli.main(["samples", "vsm", "--step", "1", "--format", "jsonl"]) == 0
    rows = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    raw = [json.loads(ln) for ln in (COUNTDOWN / "1.jsonl").read_text().splitlines()]
    assert [r["turns"][-1]["content"] for r in rows] == [d["output"] for d in raw]
    assert [r["reward"] for r in rows] == [d["score"] for d in raw]
    assert cli.main(["samples", "vsm", "--step", "4"]) == 2
    assert "step 4 has no samples kept in run 'vsm'; kept steps: 1-3" in capsys.readouterr().err
    assert cli.main(["samples", "vsm", "--reason", "timeout"]) == 2
    assert "reasons there: None 32, syntax_error 2, ok 1, wrong_answer 1" in capsys.readouterr().err


def test_samples_of_a_verl_run_load_no_ml_stack(verl_run):
    _dump(verl_run, CODE, 3)
    heavy = ("torch", "transformers", "vllm", "pandas", "pyarrow", "numpy", "verl", "ray")
    code = ("import sys, io, contextlib\nfrom hpcrl.cli import main\nwith contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['samples', 'vsm', '--worst']) == 0\n"
            "print('LOADED=' + ','.join(m for m in %r if m in sys.modules))" % (heavy,))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "LOADED=", out
