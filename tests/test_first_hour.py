"""A newcomer's first hour (issue #22): --help everywhere, ids by unique prefix, reward mistakes
refused at submit, the README's recipe list, a truthful status after resume --hours."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

from helpers import ROOT, hpcrl


# ---------------------------------------------------------------- --help everywhere


def _commands(parser: argparse.ArgumentParser, prefix=()):
    """Every command path of the parser (sub-commands of sub-commands too), hidden ones left out."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                if name.startswith("_"):
                    continue
                yield (*prefix, name)
                yield from _commands(child, (*prefix, name))


def test_every_command_and_sub_command_answers_help_and_h(home, capsys):
    from hpcrl.cli import FORWARDED, build_parser, main

    paths = [p for p in _commands(build_parser()) if p[0] not in FORWARDED]
    assert ("submit",) in paths and ("status",) in paths
    for path in paths:
        for flag in ("--help", "-h"):
            with pytest.raises(SystemExit) as e:
                main([*path, flag])
            out = capsys.readouterr()
            assert e.value.code == 0 and out.out.startswith(f"usage: hpcrl {' '.join(path)}"), (path, flag, out)
            assert "error" not in out.err


def _forwarded_subcommands(name: str) -> list[str]:
    out = hpcrl(name, "--help").stdout
    return re.search(r"\{([^}]*)\}", out).group(1).split(",")


@pytest.mark.parametrize("name", ["data", "model"])
def test_data_and_model_help_list_their_sub_commands_and_the_top_level_names_them(home, name):
    subs = _forwarded_subcommands(name)
    assert hpcrl(name, "-h").stdout == hpcrl(name, "--help").stdout
    bare = hpcrl(name)  # alone: its sub-commands, not an error
    assert bare.returncode == 0 and all(s in bare.stdout for s in subs)
    top = hpcrl("--help", env={"COLUMNS": "300"}).stdout  # one line per command
    line = next(ln for ln in top.splitlines() if ln.strip().startswith(name + " "))
    missing = [s for s in subs if s not in line.split(":", 1)[-1].replace(",", " ").split()]
    assert not missing, f"`hpcrl --help` does not name {missing} for {name}: {line}"
    for sub in subs:
        r = hpcrl(name, sub, "--help")
        assert r.returncode == 0 and r.stdout.startswith(f"usage: hpcrl {name} {sub}"), r.stderr


def test_a_bad_flag_names_the_program_once(home):
    r = hpcrl("--bogus", check=False)
    assert r.returncode == 2 and r.stderr.startswith("hpcrl: error: unrecognized arguments: --bogus"), r.stderr
    assert "hpcrl: error: hpcrl" not in r.stderr


# ---------------------------------------------------------------- reward mistakes at submit


def _no_run_left(home):
    from hpcrl.runs import registered_ids

    runs_dir = home / "runs"
    return registered_ids() == [] and (not runs_dir.exists() or not any(runs_dir.iterdir()))


@pytest.mark.parametrize("reward, said", [
    ("countdwn + 0.1*length", "unknown reward 'countdwn' (did you mean 'countdown'?)"),
    ("countdown + 0.1*lenght", "unknown reward 'lenght' (did you mean 'length'?)"),
    ("{missing}", "does not exist"),
    ("{file}:scor", "defines no function 'scor' (did you mean 'score'?)"),
    ("my_reward.py", "is a relative path"),
    ("countdown + nosuchpkg_f22.rewards:score", "module 'nosuchpkg_f22.rewards' is not importable by the trainer's python"),
])
def test_a_reward_mistake_is_refused_at_submit_with_no_run_left(home, tmp_path, reward, said):
    file = tmp_path / "my_reward.py"
    file.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    reward = reward.format(file=file, missing=tmp_path / "my_rewrd.py")
    r = hpcrl("submit", "--trainer", "builtin", "--hours", "0.01", "--name", "typo", "--set", f"args.reward={reward}",
              check=False, cwd=tmp_path)
    assert r.returncode == 2 and said in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert _no_run_left(home)
    if "countdwn" in reward:  # a name is known without any file: render refuses it too
        assert said in hpcrl("render", "--trainer", "builtin", "--set", f"args.reward={reward}", check=False).stderr


def test_an_importable_module_reward_is_accepted_at_submit(fast_local, tmp_path):
    """The module is found where the job will run: the spec's env.PYTHONPATH counts, the directory
    submit was run from does not (the job runs in its run directory)."""
    from helpers import wait_for_run

    pkg = tmp_path / "lib" / "myrewards_f22"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                     "    return 0.0\n")
    argv = ["submit", "--site", fast_local, "--trainer", "builtin", "--hours", "0.01", "--name", "mod",
            "--set", "args.reward=myrewards_f22:score"]
    r = hpcrl(*argv, check=False, cwd=tmp_path / "lib")
    assert r.returncode == 2 and "'myrewards_f22' is not importable" in r.stderr, r.stderr
    hpcrl(*argv, "--set", f"env.PYTHONPATH={tmp_path / 'lib'}")
    hpcrl("cancel", "mod")
    # A trainer still loading torch on a busy machine ends when loaded. A job the cancel killed
    # before its end hook ran leaves its segment RUNNING until `status` asks the scheduler (as a
    # user's next command would; control.refresh): one CI-shaped run's job was killed 3.5 s in.
    from helpers import wait_until

    from hpcrl import control
    from hpcrl.runs import Run

    def closed():
        return not any(s["state"] in ("RUNNING", "QUEUED") for s in control.refresh(Run.by_id("mod"))["segments"])
    wait_until(closed, 400, "the cancelled run's segments to close")
    wait_for_run("mod", timeout=60)


def test_reward_names_of_the_schema_are_the_trainers():
    from hpcrl.rewards import score as rewards
    from hpcrl.schemas.builtin import REWARD_NAMES

    assert set(REWARD_NAMES) == set(rewards.BUILTIN) | {"length"}


def test_a_reward_file_with_its_function_passes_the_submit_check(tmp_path):
    from hpcrl.trainers.builtin import BuiltinTrainer

    file = tmp_path / "r.py"
    file.write_text("from x import y as compute_score\ndef other(a, b, c, d=None):\n    return 0\n")
    BuiltinTrainer().check_submit({"reward": f"0.5*{file} + 0.5*{file}:other + length"}, 1)


# ---------------------------------------------------------------- ids by a unique prefix


def test_every_command_takes_a_unique_prefix_and_an_ambiguous_one_lists_the_runs(fast_local):
    from helpers import wait_for_run

    for name in ("prefix-alpha-1", "prefix-alpha-2", "prefix-beta"):
        hpcrl("submit", "--site", fast_local, "--trainer", "smoke", "--hours", "0.01", "--name", name,
              "--set", "args.steps=3", "--set", "args.step_time_s=0.01")
    for name in ("prefix-alpha-1", "prefix-alpha-2", "prefix-beta"):
        wait_for_run(name, timeout=120)
    assert json.loads(hpcrl("status", "prefix-b", "--json").stdout)[0]["id"] == "prefix-beta"
    assert "smoke" in hpcrl("logs", "prefix-alpha-2").stdout
    assert hpcrl("metrics", "prefix-alpha-1", "--format", "jsonl").returncode == 0
    for argv in (["status", "prefix-a"], ["logs", "prefix-a"], ["resume", "prefix-al"], ["cancel", "prefix-"],
                 ["plot", "prefix-a"], ["metrics", "prefix-a"], ["export", "prefix-a", "--out", "x"]):
        r = hpcrl(*argv, check=False)
        assert r.returncode == 2 and "runs start with it (prefix-alpha-1, prefix-alpha-2" in r.stderr, (argv, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1
    r = hpcrl("status", "prefix-gamma", check=False)
    assert r.returncode == 2 and "no such run" in r.stderr
    # a whole id that is also the start of another id is that run, not ambiguous
    hpcrl("submit", "--site", fast_local, "--trainer", "smoke", "--hours", "0.01", "--name", "prefix-beta-2",
          "--set", "args.steps=3", "--set", "args.step_time_s=0.01")
    wait_for_run("prefix-beta-2", timeout=120)
    assert json.loads(hpcrl("status", "prefix-beta", "--json").stdout)[0]["id"] == "prefix-beta"
    r = hpcrl("cancel", "prefix-beta-", check=False)  # the one run starting with it: it is meant
    assert "prefix-beta-2" in r.stderr + r.stdout


# ---------------------------------------------------------------- status after resume --hours


def test_each_segment_keeps_what_it_was_queued_with_pure():
    from hpcrl.status import eta as status_eta

    T = 1_000_000.0
    segs = [{"k": 1, "job_id": "1", "state": "CONTINUE", "started": T, "ended": T + 36,
             "asked": {"hours": 0.01, "nodes": 2, "gpus_per_node": 4}},
            {"k": 2, "job_id": "2", "state": "RUNNING", "started": T + 40,
             "asked": {"hours": 0.1, "nodes": 1, "gpus_per_node": 4}}]
    state = {"run_id": "r", "state": "RUNNING", "segments": segs,
             "budget": {"hours": 0.1, "total_hours": 1.5, "max_segments": 100}}
    facts = status_eta.RunFacts(total_steps=None, walltime_s=360, stop_lead_s=4, nodes=1, gpus_per_node=4)
    cost = status_eta.cost(state, facts, now=T + 100, wall_s_left=None)
    assert cost["node_hours"] == round((36 * 2 + 60 * 1) / 3600, 4)  # segment 1 held two nodes
    assert cost["gpu_hours"] == round((36 * 8 + 60 * 4) / 3600, 4)
    from hpcrl.status import text as status_text

    assert status_text.cost_line({"state": "RUNNING", "cost": cost}).startswith("0.0267 h wall on 1-2 nodes = 0.0367 node-h")
    from hpcrl.status.metrics import segment_timings

    timings = segment_timings([{"step": s, "segment": 1, "time": T + 6 + s} for s in range(1, 27)])
    good = status_eta.goodput(state, timings, facts, now=T + 100)
    assert good[0]["goodput"] == pytest.approx(26 / 36, abs=0.01)  # its own 36 s, not today's 360
    # SEG k/N: 1 segment ran, (1.5 h - 36 s) / 0.1 h -> 15 more, the running one among them
    assert status_eta.planned_segments(state, T + 100) == 1 + 15


def test_status_stays_truthful_after_resume_changes_the_walltime(fast_local):
    from helpers import run_state, started, wait_for_run, wait_until

    name = "resume-hours"
    hpcrl("submit", "--site", fast_local, "--trainer", "smoke", "--hours", "0.003", "--max-segments", "3",
          "--name", name, "--set", "args.steps=100000", "--set", "args.step_time_s=0.05")
    state = wait_for_run(name, timeout=240)
    assert state["stop"]["kind"] == "max_segments" and len(started(state)) == 3
    assert [(s["asked"]["hours"], s["asked"]["nodes"]) for s in started(state)] == [(0.003, 1)] * 3, started(state)
    before = json.loads(hpcrl("status", name, "--json").stdout)[0]
    assert before["segments"] == before["segments_planned"] == 3
    good_before = {g["k"]: g["goodput"] for g in before["goodput"]}
    assert all(0.2 < g <= 1 for g in good_before.values())

    hpcrl("resume", name, "--hours", "0.01", "--total-hours", "0.03", "--max-segments", "50")
    wait_until(lambda: any(s.get("k") == 4 for s in run_state(name)["segments"]), 60, "segment 4 to start")
    wait_until(lambda: (json.loads(hpcrl("status", name, "--json").stdout)[0]["step"] or 0) > 0
               and run_state(name)["state"] == "RUNNING", 60, "segment 4 to train")
    row = json.loads(hpcrl("status", name, "--json").stdout)[0]
    state = run_state(name)
    closed_h = sum(s["ended"] - s["started"] for s in started(state) if s.get("ended")) / 3600
    import math

    assert row["segments"] == 4 <= row["segments_planned"]  # was 4/3 (ceil(0.03 / 0.01))
    assert row["segments_planned"] == 3 + math.ceil((0.03 - closed_h) / 0.01 - 1e-9)
    assert started(state)[-1]["asked"]["hours"] == 0.01
    good_after = {g["k"]: g["goodput"] for g in row["goodput"]}
    assert {k: good_after[k] for k in good_before} == good_before, "past segments keep their goodput"
    assert row["cost"]["node_hours"] == pytest.approx(row["used_hours"], abs=2e-4)
    assert row["eta"]["steps_per_s"] and row["eta"]["segments_left"] is not None
    plain = hpcrl("status", name).stdout
    assert f"4/{row['segments_planned']}" in plain
    hpcrl("cancel", name)
    wait_for_run(name, timeout=120)


# ---------------------------------------------------------------- status at 80 columns, long ids

from test_results import tmux  # noqa: E402,F401 - the real-terminal fixture (a private tmux server)


def test_status_at_80_columns_shows_every_long_id_whole(fast_local, tmux):
    from helpers import wait_for_run

    names = ["countdown-tiny-20261204-081503", "countdown-tiny-20261204-081503-lr3e-6-group8-with-a-long-note"]
    for name in names:
        hpcrl("submit", "--site", fast_local, "--trainer", "smoke", "--hours", "0.01", "--name", name,
              "--set", "args.steps=3", "--set", "args.step_time_s=0.01")
    for name in names:
        wait_for_run(name, timeout=120)
    for width in (80, 100):
        screen = tmux.screen(f"st{width}", ["status"], width)
        lines = screen.rstrip("\n").splitlines()
        assert all(len(ln) <= width for ln in lines), screen
        for name in names:  # whole, on a line of its own or at the start of its row
            assert any(ln.split() and ln.split()[0] == name for ln in lines), (name, screen)
        assert "\u2026" not in "".join(ln.split()[0] for ln in lines if ln.split()), screen
        assert "COMPLETED" in screen
    # a short id keeps the one-line row
    short = "short-id"
    hpcrl("submit", "--site", fast_local, "--trainer", "smoke", "--hours", "0.01", "--name", short,
          "--set", "args.steps=3", "--set", "args.step_time_s=0.01")
    wait_for_run(short, timeout=120)
    screen = tmux.screen("one", ["status", short], 80)
    row = next(ln for ln in screen.splitlines() if ln.startswith(short))
    assert "COMPLETED" in row, screen


# ---------------------------------------------------------------- plots at any segment count


def test_plot_of_a_long_run_is_readable(home, tmp_path):
    """A run of 40 segments with a warm-up and a custom reward file, written as the trainer and
    the lifecycle write them, plotted by the real CLI."""
    from PIL import Image

    from hpcrl import runs
    from hpcrl.rewards.mix import _key

    rdir = tmp_path / "runs" / "long-run"
    rdir.mkdir(parents=True)
    term = "/tmp/some dir/my_reward.py:compute_score"
    (rdir / "spec.json").write_text(json.dumps({"spec": {"trainer": "builtin", "args": {
        "reward": f"0.5*countdown + 0.5*{term}"}, "resources": {}}, "site": {"name": "local"}}))
    segs, recs, T = [], [], 1_000_000.0
    for k in range(1, 41):
        segs.append({"k": k, "job_id": str(k), "state": "CONTINUE", "started": T + 100 * k, "ended": T + 100 * k + 90,
                     "start_step": (k - 1) * 10 or None, "end_step": k * 10})
    for step in range(1, 401):
        phase = "sft" if step <= 30 else "train"
        rec = {"step": step, "phase": phase, "segment": (step - 1) // 10 + 1, "time": T + step,
               "loss": 5.0 - step / 10 if phase == "sft" else 0.01 * ((-1) ** step)}
        if phase == "train":
            rec.update({"reward_mean": (step % 7) / 7, "kl": 0.001 * step, f"reward/{_key(term)}": 0.5})
        recs.append(rec)
    recs += [{"step": 0, "phase": "eval_before", "eval/reward_mean": 0.0},
             {"step": 400, "phase": "eval_after", "eval/reward_mean": 0.7}]
    (rdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (rdir / "state.json").write_text(json.dumps({"run_id": "long-run", "state": "STOPPED", "segments": segs,
                                                 "budget": {"hours": 0.01, "total_hours": None, "max_segments": 40},
                                                 "trainer": "builtin", "site": "local"}))
    runs.register("long-run", rdir)
    out = tmp_path / "long.png"
    hpcrl("plot", "long", "--out", out)  # a prefix of the id
    drawn = json.loads(Image.open(out).info["hpcrl"])
    reward, kl, loss = drawn["panels"][:3]
    assert reward["boundaries"] == {"long-run": 40} and reward["segment_labels"] <= 12
    assert reward["smoothed"] and reward["rl_start"] and reward["eval_points"] == 2
    assert loss["warmup_axis"] and loss["train_points"] == 400  # warm-up on its own axis, RL on the left
    custom = tmp_path / "custom.png"
    hpcrl("plot", "long-run", "--out", custom, "--metric", f"reward/{_key(term)}")
    panel = json.loads(Image.open(custom).info["hpcrl"])["panels"][0]
    assert panel["title"] == "reward/my_reward.py:compute_score", panel
    # `status RUN`: the evaluations before -> after, not only the last metric
    detail = hpcrl("status", "long-run").stdout
    assert "eval: reward 0.000 at the start (step 0) -> 0.700 at the end (step 400)" in detail, detail


# ---------------------------------------------------------------- metrics read by offset


def test_metrics_are_read_incrementally_and_anew_when_the_file_is_replaced(tmp_path, monkeypatch):
    from hpcrl.status import metrics as run_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3')  # the last line is still being written
    assert [r["step"] for r in run_metrics.read_records(path)] == [1, 2]
    parsed = []
    real = run_metrics._parse
    monkeypatch.setattr(run_metrics, "_parse", lambda data: parsed.append(data) or real(data))
    with open(path, "a") as f:
        f.write('}\n{"step": 4}\n')
    assert [r["step"] for r in run_metrics.read_records(path)] == [1, 2, 3, 4]
    assert parsed == [b'{"step": 3}\n{"step": 4}\n']  # only what was appended
    assert [r["step"] for r in run_metrics.read_records(path)] == [1, 2, 3, 4] and len(parsed) == 1
    replaced = tmp_path / "new.jsonl"
    replaced.write_text('{"step": 9}\n')
    replaced.replace(path)  # a rewritten file (another inode): read from its start
    assert [r["step"] for r in run_metrics.read_records(path)] == [9]
    path.unlink()
    assert run_metrics.read_records(path) == []


# ---------------------------------------------------------------- the docs say what the code does


def test_readme_recipe_list_is_init_list(home):
    listed = hpcrl("init", "--list").stdout
    names = {line.split()[0] for line in listed.splitlines() if line.strip()}
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    para = readme[readme.index("Recipes (`hpcrl init --list`):"):]
    para = para[:para.index(".\n")]
    assert set(re.findall(r"`([^`]+)`", para)) - {"hpcrl init --list"} == names


def test_readme_first_steps_are_true(home, tmp_path):
    """Issue 39: the README's smoke-test commands are ones hpcrl accepts (a chained debug submit it
    refuses once stood beside the true one), the args keys it names exist, docs/adapt.md is linked."""
    from hpcrl.schemas.builtin import SCHEMA

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    smoke = re.findall(r"`hpcrl submit (--trainer smoke [^`]*)`", readme)
    assert smoke, "the README gives a smoke-test submit"
    for command in smoke:  # render: what submit would send, nothing queued
        r = hpcrl("render", *command.split(), env={"SCRATCH": str(tmp_path)}, check=False)
        assert r.returncode == 0 and "#SBATCH" in r.stdout, f"README: hpcrl submit {command}: {r.stderr}"
    named = set(re.findall(r"`args\.([a-z_]+)`", readme))
    assert named and named <= set(SCHEMA.fields), f"not keys of the built-in trainer: {named - set(SCHEMA.fields)}"
    assert "(docs/adapt.md)" in readme


def test_init_list_titles_are_whole_sentences(home):
    for line in hpcrl("init", "--list").stdout.splitlines():
        assert line.rstrip().endswith((".", ")")), f"cut mid-sentence: {line}"


def test_init_names_the_file_it_wrote_in_its_next_commands(home, tmp_path):
    out = hpcrl("init", "--recipe", "smoke", "--out", "gsm8k.yaml", cwd=tmp_path).stdout
    assert "`hpcrl render gsm8k.yaml`" in out and "`hpcrl submit gsm8k.yaml`" in out
    assert "render gsm8k.yaml" in out and hpcrl("render", "gsm8k.yaml", cwd=tmp_path).returncode == 0
    out = hpcrl("init", "--recipe", "smoke", cwd=tmp_path).stdout
    assert "`hpcrl render` " in out  # ./hpcrl.yaml is found by itself


def test_tiny_model_size_in_the_docs_is_the_models(tmp_path):
    """The parameter count the README, the recipe and BENCHMARKS give is the built model's."""
    pytest.importorskip("torch", reason="needs the rl extra (torch) to build the model")
    from hpcrl.rl.tiny import build_tiny_model

    from transformers import AutoModelForCausalLM

    build_tiny_model(tmp_path / "m", hidden_size=128, layers=2, heads=4, max_int=200, seed=0, vocab="countdown",
                     reward_head=False)
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tmp_path / "m").parameters())
    said = f"{n:,}"
    for doc in ("README.md", "BENCHMARKS.md", "hpcrl/recipes/countdown-tiny.yaml"):
        text = (ROOT / doc).read_text(encoding="utf-8")
        assert said in text and "0.6 M" not in text, (doc, said)


def test_perlmutter_doc_names_the_run_dir_files_a_run_has(fast_local):
    from helpers import run_dir, wait_for_run

    hpcrl("submit", "--site", fast_local, "--trainer", "smoke", "--hours", "0.01", "--name", "files",
          "--set", "args.steps=2", "--set", "args.step_time_s=0.01")
    wait_for_run("files")
    doc = (ROOT / "docs" / "perlmutter.md").read_text(encoding="utf-8")
    records = next(ln for ln in doc.splitlines() if "hpcrl's own records" in ln)
    named = re.findall(r"[\w.-]+\.\w+|[\w-]+/", records)
    assert named and all((run_dir("files") / n.rstrip("/")).exists() for n in named), named


# ---------------------------------------------------------------- truthful after faults; the progress line


def test_a_lost_segments_checkpointing_flag_goes_when_the_next_segment_begins(fast_local):
    """A segment hard-killed while saving never runs its end hook: its .checkpointing flag must not
    make the next segment show CHECKPOINTING throughout."""
    from helpers import run_dir, run_state, wait_for_run, wait_until

    hpcrl("submit", "--site", fast_local, "--trainer", "smoke", "--hours", "0.01", "--max-segments", "2",
          "--name", "flag", "--set", "args.steps=100000", "--set", "args.step_time_s=0.05")
    wait_until(lambda: run_state("flag")["state"] == "RUNNING", 120, "segment 1 to run")
    rdir = run_dir("flag")
    (rdir / ".checkpointing").write_text("")  # as the script leaves it when killed while saving
    assert json.loads(hpcrl("status", "flag", "--json").stdout)[0]["state"] == "CHECKPOINTING"
    # the next segment's begin hook, as a job the user queued by hand runs it (sbatch job.sh)
    r = subprocess.run([sys.executable, "-m", "hpcrl.cli", "_segment", "begin", str(rdir), "--job-id", "by-hand"],
                       capture_output=True, text=True)
    state = run_state("flag")
    lost = [s for s in state["segments"] if s.get("k") == 1][0]
    assert lost["state"] == "LOST" and not (rdir / ".checkpointing").exists(), (r.stdout, r.stderr, state)
    assert json.loads(hpcrl("status", "flag", "--json").stdout)[0]["state"] != "CHECKPOINTING"
    hpcrl("cancel", "flag", check=False)
    # the hand-run job's own end hook (there is no such job to end it)
    subprocess.run([sys.executable, "-m", "hpcrl.cli", "_segment", "end", str(rdir), "--job-id", "by-hand", "--rc", "85"],
                   check=True)
    wait_for_run("flag", timeout=120)


def test_finish_estimate_right_after_a_segment_starts_and_progress_line_fits_80_columns():
    from hpcrl.status import terminal
    from hpcrl.status import eta as status_eta
    from hpcrl.status.metrics import segment_timings

    T = 1_000_000.0
    segs = [{"k": 1, "job_id": "1", "state": "CONTINUE", "started": T, "ended": T + 36, "end_step": 26},
            {"k": 2, "job_id": "2", "state": "RUNNING", "started": T + 37, "start_step": 26}]
    state = {"run_id": "r", "state": "RUNNING", "segments": segs,
             "budget": {"hours": 0.01, "total_hours": None, "max_segments": 20}}
    timings = segment_timings([{"step": s, "segment": 1, "time": T + 6 + s} for s in range(1, 27)])
    facts = status_eta.RunFacts(total_steps=100, walltime_s=36, stop_lead_s=4)
    eta = status_eta.eta(state, timings, facts, step=26, now=T + 38)  # segment 2 has no step yet
    assert eta["finish_time"] is not None and eta["steps_per_s"] == 1.0
    row = {"id": "countdown-tiny-20261204-081503-with-a-rather-long-name", "state": "CHECKPOINTING",
           "segments": 12, "segments_planned": 150, "step": 12345, "metric_name": "eval/reward_mean",
           "metric": 0.74691, "eta": {**eta, "total_steps": 123456}}
    for width in (80, 60, 40):
        text = terminal.progress_text(row, width).plain
        assert len(text) <= width and "\u2026" not in text, text
        assert text.startswith("CHECKPOINTING") and "seg 12/150" in text
    assert "ETA" in terminal.progress_text(row, 80).plain


def test_logs_follow_ends_on_a_final_run_whose_segment_never_closed(home, tmp_path):
    """`hpcrl cancel` of a segment killed before its end hook leaves it recorded as RUNNING in a
    CANCELLED run: `logs -f` (and the demo that follows it) must not wait on it for ever."""
    import io

    from hpcrl import runs
    from hpcrl.status import text as status_text

    rdir = tmp_path / "runs" / "stuck"
    (rdir / "logs").mkdir(parents=True)
    (rdir / "logs" / "job-7.log").write_text("hpcrl: TERM: stop now\n")
    (rdir / "state.json").write_text(json.dumps({"run_id": "stuck", "state": "CANCELLED", "segments": [
        {"k": 1, "job_id": "7", "state": "RUNNING", "started": 1.0}], "budget": {"hours": 0.01, "max_segments": 2}}))
    runs.register("stuck", rdir)
    out = io.StringIO()
    status_text.follow(runs.Run.by_id("stuck"), 0, out, follow_on=True, poll_s=0.001)
    assert out.getvalue().startswith("hpcrl: TERM: stop now\n") and "ended without its end hook" in out.getvalue()


def test_projection_after_resume_uses_the_new_walltime_not_the_old_segments():
    """After `resume --hours 0.1` on a 0.01 h run the old 36 s segments say nothing about the next
    ones: the running 360 s segment and those after it are projected at 360 s."""
    from hpcrl.status import eta as status_eta
    from hpcrl.status.metrics import segment_timings

    T, recs, segs = 1_000_000.0, [], []
    for k in range(1, 4):  # 36 s segments: 6 s start-up, 26 steps at 1 step/s
        t0 = T + (k - 1) * 40
        segs.append({"k": k, "job_id": str(k), "state": "CONTINUE", "started": t0, "ended": t0 + 36,
                     "asked": {"hours": 0.01, "nodes": 1, "gpus_per_node": 0}})
        recs += [{"step": (k - 1) * 26 + i, "segment": k, "time": t0 + 6 + i} for i in range(1, 27)]
    t4 = T + 120
    segs.append({"k": 4, "job_id": "4", "state": "RUNNING", "started": t4,
                 "asked": {"hours": 0.1, "nodes": 1, "gpus_per_node": 0}})
    recs += [{"step": 78 + i, "segment": 4, "time": t4 + 6 + i} for i in range(1, 3)]
    state = {"run_id": "r", "state": "RUNNING", "segments": segs,
             "budget": {"hours": 0.1, "total_hours": 1.5, "max_segments": 100}}
    facts = status_eta.RunFacts(total_steps=1000, walltime_s=360, stop_lead_s=4)
    eta = status_eta.eta(state, segment_timings(recs), facts, step=80, now=t4 + 8)
    # 920 steps: segment 4 trains 360 - 4 - 6 = 350 s (348 left), then 572 steps = 2 more segments
    assert eta["segments_left"] == 2, eta
    assert eta["eta_s"] == pytest.approx(348 + 6 + 360 + 6 + (572 - 350), abs=15), eta
    good = status_eta.goodput(state, segment_timings(recs), facts, now=t4 + 8)
    assert [g["goodput"] for g in good[:3]] == [pytest.approx(26 / 36, abs=0.01)] * 3
