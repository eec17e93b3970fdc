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
    top = hpcrl("--help").stdout
    line = next(ln for ln in top.splitlines() if ln.strip().startswith(name + " "))
    missing = [s for s in subs if s not in line]
    assert not missing, f"`hpcrl --help` does not name {missing} for {name} (hpcrl/cli.py FORWARDED)"
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


def test_reward_names_of_the_schema_are_the_trainers():
    from hpcrl.rl import rewards
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
