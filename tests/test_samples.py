"""The samples of every step (issue 41 item 1): RUN/samples as hpcrl/samplestore.py keeps it (one
file per step, a replayed step replaced, the byte budget kept by thinning old steps) and `hpcrl
samples` reading it (80 columns, exports, one-line errors). The real run through `submit` is
tests/test_samples_run.py."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hpcrl import cli, samplestore
from hpcrl.status import samples as view


def _sample(step: int, i: int, segment: int = 1, reward: float = 0.0, reason: str = "wrong_answer",
            response: str = "a + b", prompt: str = "def f ( a , b ) : return # product") -> dict:
    return {"step": step, "segment": segment, "sample": i, "group": i // 4, "row": 7,
            "turns": [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
            "reward": reward, "terms": {"code": reward}, "reason": reason, "advantage": reward - 0.5,
            "extras": {"pass_rate": reward}, "data_source": "code", "ground_truth": "{}"}


# ---------------------------------------------------------------- the store


def test_thinning_keeps_the_newest_half_whole_and_every_2nd_then_4th_of_the_older():
    sizes = {s: 100 for s in range(1, 9)}
    # 800 bytes over a 700 budget: the older half (1-4) keeps every 2nd step
    assert samplestore.to_thin(sizes, 700) == [1, 3]
    rest = {s: 100 for s in (2, 4, 5, 6, 7, 8)}
    # the older half (2, 4, 5) is every 2nd already but for 5
    assert samplestore.to_thin(rest, 500) == [5]
    # nothing fits: the newest step alone stays (the run never stops for the budget)
    assert samplestore.to_thin({1: 900, 2: 900}, 100) == [1]
    assert samplestore.to_thin({3: 900}, 100) == []
    # with samples every 5 steps, "every 2nd" counts kept steps, not step numbers
    assert samplestore.to_thin({s: 100 for s in (5, 10, 15, 20)}, 300) == [5]


def test_a_tiny_budget_thins_old_steps_and_never_stops_writing(tmp_path):
    one = len(samplestore.encode([_sample(100, i) for i in range(2)]))
    w = samplestore.Writer(tmp_path, max_mb=20 * one / 1e6)  # room for ~20 of 200 steps
    for step in range(1, 201):
        w.write(step, [_sample(step, i) for i in range(2)])
    kept = samplestore.list_steps(tmp_path / samplestore.SAMPLES_DIR)
    assert kept == w.sizes, "the writer's tally is what is on disk"
    assert sum(kept.values()) <= 20 * one
    steps = sorted(kept)
    assert steps[-1] == 200 and len(steps) >= 15
    newest = steps[len(steps) // 2:]
    assert newest == list(range(newest[0], 201)), f"the newest half is kept whole: {steps}"
    older = steps[:len(steps) // 2]
    assert all(s % 2 == 0 for s in older), f"the older ones thinned to every Nth: {steps}"
    assert steps[0] <= 50, f"the start of the run is still represented: {steps}"
    for s in steps:  # a thinned store is still readable, step by step
        assert [r["step"] for r in samplestore.read_step(tmp_path / "samples", s)] == [s, s]


def test_a_step_replayed_after_a_resume_replaces_its_file_and_later_ones_go(tmp_path):
    from hpcrl.rl.samples import Keeper

    one_rank = SimpleNamespace(is_main=True, gather=lambda obj: [obj])
    cfg = SimpleNamespace(samples_every=1, samples_max_mb=200.0)
    first = Keeper(cfg, tmp_path, 1, one_rank)
    for step in range(1, 8):  # segment 1 trains to 7, its checkpoint is at 4, then it is killed
        first.keep(step, [{"turns": [], "reward": 0.0, "advantage": 0.0, "n": 1}])
    (tmp_path / "samples" / ".step-00000008.jsonl.tmp").write_text("torn")  # killed mid-write
    second = Keeper(cfg, tmp_path, 2, one_rank)
    assert not list((tmp_path / "samples").glob(".*")), "the killed writer's temporary is gone"
    second.keep(5, [{"turns": [], "reward": 1.0, "advantage": 0.0, "n": 2}])
    # steps 6 and 7 were the lost segment's: gone until they are trained again
    assert sorted(samplestore.list_steps(tmp_path / "samples")) == [1, 2, 3, 4, 5]
    second.keep(6, [{"turns": [], "reward": 1.0, "advantage": 0.0, "n": 2}])
    got = {s: samplestore.read_step(tmp_path / "samples", s) for s in range(1, 7)}
    assert [len(v) for v in got.values()] == [1] * 6, "one record per sample, none twice"
    assert [got[s][0]["segment"] for s in range(1, 7)] == [1, 1, 1, 1, 2, 2]


def test_samples_every_n_steps_and_none_at_zero(tmp_path):
    from hpcrl.rl.samples import Keeper

    one_rank = SimpleNamespace(is_main=True, gather=lambda obj: [obj])
    k = Keeper(SimpleNamespace(samples_every=3, samples_max_mb=1.0), tmp_path / "a", 1, one_rank)
    assert [s for s in range(1, 10) if k.due(s)] == [3, 6, 9]
    off = Keeper(SimpleNamespace(samples_every=0, samples_max_mb=1.0), tmp_path / "b", 1, one_rank)
    assert not any(off.due(s) for s in range(1, 10)) and off.writer is None


# ---------------------------------------------------------------- the view


LONG_PROMPT = "\n".join(f"line {i} of a C function that the model is asked to translate" for i in range(12))
LONG_RESPONSE = ("def translated(values):\n    total = 0\n    for v in values:\n        total += v\n"
                 + "    return " + " + ".join(f"value_number_{i}" for i in range(40)))


def test_a_sample_reads_at_80_columns_with_the_whole_response_and_a_cut_prompt():
    s = _sample(12, 5, reward=0.333, reason="syntax_error", prompt=LONG_PROMPT, response=LONG_RESPONSE)
    out = view.lines([s], 80)
    assert all(len(line) <= 80 for line, _ in out), [line for line, _ in out if len(line) > 80]
    text = "\n".join(line for line, _ in out)
    assert "step 12" in out[0][0] and "sample 5" in out[0][0]
    assert "reward 0.333" in text and "advantage -0.167" in text and "reason syntax_error" in text
    response = [line for line, kind in out if kind == "response"]
    assert " ".join(response).split() == LONG_RESPONSE.split(), "every word of the response, in order"
    assert response[3] == "          total += v", "the code's indentation kept (under the turn's own)"
    prompt = [line for line, kind in out if kind == "prompt"]
    assert len(prompt) == view.PROMPT_LINES + 1 and prompt[-1] == "  ... 8 more lines"


def test_the_terminal_view_fits_80_columns(monkeypatch):
    from rich.console import Console

    from hpcrl.status import terminal

    buf = io.StringIO()
    out = Console(file=buf, width=80, color_system=None, highlight=False, soft_wrap=False)
    chosen = [_sample(3, i, reward=i / 4, prompt=LONG_PROMPT, response=LONG_RESPONSE) for i in range(3)]
    terminal.samples(chosen, "run r, step 3: 3 of 3 samples", out)
    lines = buf.getvalue().splitlines()
    assert lines[0] == "run r, step 3: 3 of 3 samples"
    assert max(len(line) for line in lines) <= 80
    assert sum(line.startswith("-- step 3") for line in lines) == 3
    assert "value_number_39" in buf.getvalue()


# ---------------------------------------------------------------- the command


@pytest.fixture
def builtin_run(home):
    from hpcrl import control
    from hpcrl.spec import resolve

    resolved = resolve(None, "local", [f"site.outputs={os.environ['HPCRL_HOME']}/runs"], {"trainer": "builtin"})
    return control.create_run(resolved, "smp")


def _fill(run, steps: int = 3, per_step: int = 4) -> None:
    w = samplestore.Writer(run.dir)
    reasons = ["ok", "wrong_answer", "syntax_error", "wrong_answer"]
    for step in range(1, steps + 1):
        w.write(step, [_sample(step, i, reward=(step * per_step + i) / 100, reason=reasons[i % 4],
                               response=f"answer {step}.{i}") for i in range(per_step)])


def test_a_run_with_no_samples_yet_is_one_line(builtin_run, capsys):
    assert cli.main(["samples", "smp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpcrl: error: no samples recorded yet: run 'smp' has none in ") and err.count("\n") == 1


def test_samples_shows_the_newest_step_and_picks_worst_best_reason_and_step(builtin_run, capsys):
    _fill(builtin_run)
    assert cli.main(["samples", "smp"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run smp, step 3 (kept: 1-3): 4 of 4 samples")
    assert [ln.split()[2] for ln in out.splitlines() if ln.startswith("-- step")] == ["3"] * 4
    assert "answer 3.0" in out and "reason syntax_error" in out
    assert cli.main(["samples", "smp", "--worst", "--limit", "2"]) == 0
    worst = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("reward")]
    assert [ln.split()[1] for ln in worst] == ["0.040", "0.050"], "the lowest rewards of every kept step"
    assert cli.main(["samples", "smp", "--best", "--limit", "1"]) == 0
    assert "answer 3.3" in capsys.readouterr().out
    assert cli.main(["samples", "smp", "--reason", "wrong_answer", "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "answer 2.1" in out and "answer 2.3" in out and "answer 2.0" not in out
    assert cli.main(["samples", "smp", "--reason", "timeout"]) == 2
    assert "no sample of run 'smp' (3 steps) has the reason 'timeout'; reasons there: wrong_answer 6" \
        in capsys.readouterr().err
    assert cli.main(["samples", "smp", "--step", "9"]) == 2
    assert "step 9 has no samples kept in run 'smp'; kept steps: 1-3" in capsys.readouterr().err


def test_samples_export_jsonl_and_parquet(builtin_run, tmp_path, capsys):
    _fill(builtin_run)
    assert cli.main(["samples", "smp", "--format", "jsonl"]) == 0
    rows = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [(r["step"], r["sample"]) for r in rows] == [(s, i) for s in (1, 2, 3) for i in range(4)]
    out = tmp_path / "s.parquet"
    assert cli.main(["samples", "smp", "--format", "parquet", "--out", str(out)]) == 0
    import pandas as pd

    frame = pd.read_parquet(out)
    assert len(frame) == 12 and list(frame["response"][:2]) == ["answer 1.0", "answer 1.1"]
    assert set(frame["reason"]) == {"ok", "wrong_answer", "syntax_error"}
    assert cli.main(["samples", "smp", "--format", "parquet"]) == 2
    assert "give --out FILE.parquet" in capsys.readouterr().err


def test_samples_loads_no_ml_stack_or_pandas(builtin_run):
    _fill(builtin_run)
    heavy = ("torch", "transformers", "vllm", "pandas", "pyarrow", "numpy", "rich")
    code = ("import sys, io, contextlib\nfrom hpcrl.cli import main\nwith contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['samples', 'smp', '--worst']) == 0\n"
            "print('LOADED=' + ','.join(m for m in %r if m in sys.modules))" % (heavy,))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "LOADED=", out
