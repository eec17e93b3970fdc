"""Issue 41 item 4, `hpcrl eval`: a finished run's checkpoint evaluated again on its val split gives
the run's own final evaluation (metrics.jsonl's eval_after), figure for figure, exactly; so does
the model `hpcrl export` wrote from it. pass@k (the Codex paper's unbiased estimator) on known
values and recomputed from the answers the evaluation kept, which `hpcrl samples --eval` shows.
Bad inputs are one line each."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from helpers import ROOT, hpcrl, log_tails, read_metrics, run_dir, wait_for_run
from test_cli import HEAVY

# code-tiny, shrunk: a 1-layer model, 2 format warm-up steps and 2 RL steps; a length term so
# that every answer's reward is its own number (the tiny model rarely passes a test yet), and
# evaluation batches of 3 over 10 rows, so padding and a short last batch are reproduced too.
# code_allow_plain: the sandbox's level is probed in each process, and a probe that failed under
# load in the job (plain, every answer 'refused') while the evaluation's passed gave other verdicts
ARGS = ["code_allow_plain=true", "tiny_hidden_size=32", "tiny_layers=1", "tiny_heads=2", "sft_steps=2", "total_steps=2", "batch_size=2",
        "group_size=4", "code_tiny_train_size=32", "code_tiny_test_size=10", "eval_before=false",
        "eval_after=true", "eval_every=0", "eval_size=20", "eval_batch_size=3", "save_every=0",
        "async_save=false", "threads=1", "reward=code + 0.1*length", "length_norm_chars=10"]


def test_pass_at_k_is_the_codex_estimator_on_known_values():
    from hpcrl.rl.heldout import pass_at_k, pass_at_ks

    assert pass_at_k(10, 0, 1) == 0.0 and pass_at_k(10, 10, 5) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the share of passing answers
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # C(3,2)/C(5,2) = 3/10 of the pairs fail
    assert pass_at_k(4, 1, 3) == pytest.approx(0.75)  # 1 - C(3,3)/C(4,3)
    assert pass_at_k(4, 2, 3) == 1.0  # n - c < k: every 3 of 4 hold one of the 2
    # the Codex paper's numerically stable form, 1 - prod(1 - k / i, i = n-c+1 .. n)
    for n, c, k in [(20, 7, 5), (100, 1, 10), (200, 37, 100)]:
        stable = 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
        assert pass_at_k(n, c, k) == pytest.approx(stable, rel=1e-12)
    assert pass_at_ks([0, 1, 4], 4, [1, 2]) == {"pass@1": round((0 + 0.25 + 1) / 3, 6),
                                                "pass@2": round((0 + 0.5 + 1) / 3, 6)}
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def _greedy_equal(own: dict, got: dict) -> None:
    ours = {k: v for k, v in own.items() if k.startswith("eval/")}
    assert got == ours and len(ours) > 3, (own, got)


@pytest.mark.slow
def test_eval_of_a_finished_run_equals_its_final_evaluation(fast_local, tmp_path):
    import pandas as pd

    sets = [a for kv in ARGS for a in ("--set", f"args.{kv}")]
    hpcrl("submit", ROOT / "hpcrl" / "recipes" / "code-tiny.yaml", "--site", fast_local, "--hours", "0.2",
          "--name", "ev", *sets)
    rdir = run_dir("ev")
    state = wait_for_run("ev", timeout=600)
    assert state["state"] == "COMPLETED", log_tails(rdir)
    own = [m for m in read_metrics(rdir) if m.get("phase") == "eval_after"]
    assert len(own) == 1 and own[0]["step"] == 4 and own[0]["eval/n"] == 10
    assert own[0]["eval/reward_mean"] != 0.0  # the length term: a real number to reproduce

    # the final checkpoint on the run's val split, the run's settings: its own figures, exactly;
    # torch loads in the evaluation's process, never in the CLI's
    code = ("import sys\nfrom hpcrl.cli import main\nrc = main(['eval', 'ev'])\nsys.stdout.flush()\n"
            "print('HEAVY=' + ','.join(m for m in %r if m in sys.modules), rc)" % (HEAVY,))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600).stdout
    assert out.strip().splitlines()[-1] == "HEAVY= 0", out
    result = json.loads((rdir / "evals" / "val-step4" / "eval.json").read_text())
    _greedy_equal(own[0], result["greedy"])
    assert result["step"] == 4 and result["rows"] == 10 and result["reward"] == "code + 0.1*length"
    assert "the run's own eval_after at step 4" in out and "(the same)" in out, out

    # its answers, through `hpcrl samples`: one greedy answer a row, scored as the figures say
    shown = hpcrl("samples", "ev", "--eval", "val-step4", "--limit", "0").stdout
    assert shown.startswith("run ev eval val-step4, step 4 (kept: 4): 10 of 10 samples"), shown[:200]
    assert shown.count("assistant:") == 10 and "decoding greedy" in shown and "advantage" not in shown
    kept = [json.loads(line) for line in
            hpcrl("samples", "ev", "--eval", "val-step4", "--format", "jsonl").stdout.splitlines()]
    assert [r["row"] for r in kept] == list(range(10))
    assert round(sum(r["reward"] for r in kept) / 10, 6) == own[0]["eval/reward_mean"]

    # the model `hpcrl export` wrote from that checkpoint, its run found from the export record
    model = tmp_path / "exported"
    hpcrl("export", "ev", "--out", model)
    out = hpcrl("eval", "--model", model, "--out", tmp_path / "of-export", timeout=600).stdout
    assert "the run's own eval_after at step 4" in out and "(the same)" in out, out
    _greedy_equal(own[0], json.loads((tmp_path / "of-export" / "eval.json").read_text())["greedy"])

    # pass@k on a held-out parquet of two sources: the val split's rows (real tests, which this
    # model does not pass yet) and rows whose one test any answer that compiles passes; from 8
    # sampled answers a prompt, what the kept answers give by the estimator, overall and per source
    from hpcrl.rl import data

    easy = []
    for i, task in enumerate(list(data.CODE_TINY_TASKS) * 2):
        row = data.code_row(f"def f ( a , b ) : return # {task}", ["assert True"], "test", i,
                            prefix=data.CODE_TINY_PREFIX)
        easy.append({**row, "data_source": "code-easy"})
    held_out = tmp_path / "held-out.parquet"
    data.write_parquet(pd.read_parquet(rdir / "data" / "test.parquet").to_dict("records") + easy, held_out)
    hpcrl("eval", "ev", "--data", held_out, "--rows", "0", "--samples", "8", "--k", "1", "--k", "3",
          "--out", tmp_path / "pk", timeout=600)
    result = json.loads((tmp_path / "pk" / "eval.json").read_text())
    sampled = result["sampled"]
    assert result["rows"] == 20 and sampled["n"] == 8 and sampled["seed"] == 5  # the recipe's seed
    answers = [json.loads(line) for line in hpcrl("samples", "ev", "--eval", str(tmp_path / "pk"),
                                                   "--format", "jsonl").stdout.splitlines()]
    drawn = [r for r in answers if r["decoding"] == "sampled"]
    assert len(drawn) == 160 and [r["row"] for r in drawn] == [i // 8 for i in range(160)]
    passing = [sum(r["terms"]["code"] >= 1.0 for r in drawn if r["row"] == i) for i in range(20)]
    assert sum(passing[10:]) > 0, "some answers compile: the estimator is checked on counts other than 0"
    for k in (1, 3):
        def want(counts):
            return round(sum(1 - math.comb(8 - c, k) / math.comb(8, k) for c in counts) / len(counts), 6)
        assert sampled[f"pass@{k}"] == want(passing), (k, passing, sampled)
        assert sampled[f"pass@{k}/code"] == want(passing[:10]) and sampled[f"pass@{k}/code-easy"] == want(passing[10:])

    # a run on a cluster: the command for a compute node is printed, and run as printed it gives
    # the same figures (the site is made a cluster's in the run's frozen spec)
    spec = json.loads((rdir / "spec.json").read_text())
    (rdir / "spec.json").write_text(json.dumps({**spec, "site": {**spec["site"], "scheduler": "slurm"}}))
    printed = hpcrl("eval", "ev", "--out", tmp_path / "on-node").stdout.splitlines()
    assert printed[0].startswith("# run 'ev' is on site ") and "--local" in printed[0] and len(printed) == 2
    assert not (tmp_path / "on-node").exists()
    subprocess.run(["bash", "-c", printed[1]], check=True, capture_output=True, timeout=600)
    _greedy_equal(own[0], json.loads((tmp_path / "on-node" / "eval.json").read_text())["greedy"])
    (rdir / "spec.json").write_text(json.dumps(spec))

    # bad inputs: one line each, no traceback
    wrong = tmp_path / "wrong.parquet"
    pd.DataFrame({"question": ["1+1"], "answer": ["2"]}).to_parquet(wrong)
    text = tmp_path / "notes.parquet"
    text.write_text("not a parquet file\n")
    for args, says in [
        (["--data", tmp_path / "missing.parquet"], "--data"),
        (["--data", wrong], "not verl's schema (docs/adapt.md section 1): no column prompt, reward_model, "
                            "data_source; it has answer, question"),
        (["--data", text], "cannot read it"),
        (["--checkpoint", "99"], "--checkpoint 99: run 'ev' has checkpoints at steps 4"),
        (["--checkpoint", "last"], "--checkpoint last: give a step number or 'latest'"),
        (["--model", tmp_path / "nowhere"], "not a Hugging Face model directory"),
        (["--samples", "2", "--k", "3"], "--k 3: pass@k needs 1 <= k <= --samples (2)"),
        (["--out", ROOT / "hpcrl"], "exists and holds no earlier evaluation"),
        (["--model", model, "--checkpoint", "4"], "--checkpoint and --model: give one"),
        (["--rows", "-1"], "--rows -1: give a number of rows (0: every row)"),
    ]:
        got = hpcrl("eval", "ev", *args, check=False, timeout=600)
        errors = [ln for ln in got.stderr.splitlines() if "error" in ln]
        assert got.returncode == 2 and len(errors) == 1 and says in errors[0], (args, got.stdout, got.stderr)
        assert "Traceback" not in got.stderr
    # a run with no checkpoint (its checkpoints removed)
    import shutil

    shutil.rmtree(rdir / "checkpoints")
    got = hpcrl("eval", "ev", check=False)
    assert got.returncode == 2 and got.stderr.strip() == \
        f"hpcrl: error: run 'ev' has no checkpoint yet in {rdir / 'checkpoints'}", got.stderr
