"""What a job would trip on at its start is refused at `hpcrl submit` (issue #29 item 1, #31 item 6),
checked in the job's own interpreter: the reward file imports, the data has its columns and the
rows for the steps asked, the model directory exists. One line, no run left behind."""

from __future__ import annotations

import sys

import pytest

from helpers import hpcrl

from hpcrl.errors import SpecError


def _parquet(path, rows: int, columns=("prompt", "data_source", "reward_model")):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = {"prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(rows)],
            "data_source": ["arithmetic"] * rows, "reward_model": [{"style": "rule", "ground_truth": "1"}] * rows}
    pq.write_table(pa.table({c: data[c] for c in columns}), path)
    return path


def _no_run_left(home):
    from hpcrl.runs import registered_ids

    runs_dir = home / "runs"
    return registered_ids() == [] and (not runs_dir.exists() or not any(runs_dir.iterdir()))


def _refused(home, r, said):
    assert r.returncode == 2 and said in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert _no_run_left(home)


def test_a_reward_file_importing_a_missing_module_is_refused_at_submit(fast_local, home, tmp_path):
    file = tmp_path / "my_reward.py"
    file.write_text("import nosuchpkg_r29\n\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return 1.0\n")
    r = hpcrl("submit", "--site", fast_local, "--trainer", "builtin", "--hours", "0.01", "--name", "imp",
              "--set", f"args.reward={file}:score", check=False, cwd=tmp_path)
    _refused(home, r, f"reward file {file} fails to import in the trainer's python")
    assert "No module named 'nosuchpkg_r29'" in r.stderr and "pip install" in r.stderr


def test_a_reward_file_whose_function_is_made_at_import_passes(tmp_path):
    """The import is the truth the job will see: a function bound at run time is found there."""
    from hpcrl.trainers.builtin import BuiltinTrainer

    file = tmp_path / "r.py"
    file.write_text("def _make():\n    return lambda *a, **k: 0.0\nscore = _make()\n")
    BuiltinTrainer().check_python({"reward": f"{file}:score"}, sys.executable, {})
    file.write_text("raise SystemExit('no GPU here')\ndef score(*a):\n    return 0\n")
    with pytest.raises(SpecError, match="fails to import .*SystemExit: no GPU here"):
        BuiltinTrainer().check_python({"reward": f"{file}:score"}, sys.executable, {})


@pytest.mark.parametrize("case, said", [
    ("no_prompt", "has no column 'prompt'"),
    ("empty", "has no rows"),
    ("not_parquet", "cannot be read as parquet"),
    ("missing", "does not exist"),
])
def test_builtin_data_files_are_checked_at_submit(fast_local, home, tmp_path, case, said):
    path = tmp_path / "train.parquet"
    if case == "no_prompt":
        _parquet(path, 8, columns=("data_source",))
    elif case == "empty":
        _parquet(path, 0)
    elif case == "not_parquet":
        path.write_text("question,answer\n1,2\n")
    r = hpcrl("submit", "--site", fast_local, "--trainer", "builtin", "--hours", "0.01", "--name", "data",
              "--set", "args.data=files", "--set", f"args.train_files={path}", check=False)
    _refused(home, r, f"args.train_files: {path} {said}")


def test_a_builtin_model_directory_that_does_not_exist_is_refused(fast_local, home, tmp_path):
    r = hpcrl("submit", "--site", fast_local, "--trainer", "builtin", "--hours", "0.01", "--name", "mdl",
              "--set", f"args.model={tmp_path / 'Qwen2.5-0.5B'}", check=False)
    _refused(home, r, f"args.model: {tmp_path / 'Qwen2.5-0.5B'} does not exist; to get a model, download it on a "
                      f"login node (`huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir DIR`) and give "
                      f"DIR as args.model")


def test_a_mistyped_model_path_names_the_model_beside_it_not_a_download_into_it(fast_local, home, tmp_path):
    """#41 item 7: a typo in args.model was answered with a download command into the typo."""
    real = tmp_path / "models" / "Qwen2.5-0.5B-Instruct"
    real.mkdir(parents=True)
    (real / "config.json").write_text("{}")
    typo = tmp_path / "models" / "Qwen2.5-0.5B-Instuct"
    r = hpcrl("submit", "--site", fast_local, "--trainer", "builtin", "--hours", "0.01", "--name", "mdl",
              "--set", f"args.model={typo}", check=False)
    _refused(home, r, f"args.model: {typo} does not exist (did you mean {real}?); to get a model, download it")
    assert f"--local-dir {typo}" not in r.stderr
    # a directory above the model: the models in it
    r = hpcrl("submit", "--site", fast_local, "--trainer", "builtin", "--hours", "0.01", "--name", "mdl",
              "--set", f"args.model={real.parent}", check=False)
    _refused(home, r, f"args.model: {real.parent} is not a Hugging Face model directory (no config.json) "
                      f"(models in it: {real}); to get a model")


def _verl_args(tmp_path, rows=64):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    train, val = _parquet(tmp_path / "train.parquet", rows), _parquet(tmp_path / "val.parquet", 8)
    return ["--set", f"args.model={model}", "--set", f"args.train_files={train}", "--set", f"args.val_files={val}",
            "--set", "args.train_batch_size=4", "--set", "args.ppo_mini_batch_size=4"]


def test_a_verl_run_asking_more_steps_than_its_data_holds_is_refused_at_submit(fast_local, home, tmp_path):
    """#31 item 6: 64 rows, batch 4, the recipe's 15 epochs = 240 steps, 400 asked: the run would
    stop unsaved at 240, two whole segments later. Refused, with the two ways out."""
    r = hpcrl("submit", "--site", fast_local, "--trainer", "verl", "--hours", "0.01", "--name", "vsteps",
              *_verl_args(tmp_path), "--set", "args.total_epochs=15", "--set", "args.total_training_steps=400",
              check=False)
    _refused(home, r, "args.total_training_steps 400: the data holds 15 epochs x 16 batches = 240 steps")
    assert "at most 240, or args.total_epochs to 25" in r.stderr


def test_verl_steps_within_the_data_and_its_batches_pass_the_check(tmp_path):
    from hpcrl.trainers.verl import VerlTrainer, check_steps

    a = VerlTrainer().validate_args({"model": "m", "train_files": "/t", "val_files": "/v", "train_batch_size": 4,
                                     "ppo_mini_batch_size": 4, "total_epochs": 15, "total_training_steps": 240})
    check_steps(a, 64)
    check_steps({**a, "total_training_steps": None}, 64)  # epochs decide: always within the data
    check_steps(a, 67)  # 16 batches: the partial one is dropped
    with pytest.raises(SpecError, match="241: the data holds 15 epochs x 16 batches .* or args.total_epochs to 16"):
        check_steps({**a, "total_training_steps": 241}, 67)
    with pytest.raises(SpecError, match="holds only 3 rows, not one batch"):
        check_steps(a, 3)


def test_verl_data_read_in_the_interpreter_and_a_custom_prompt_key(tmp_path):
    from hpcrl.trainers.verl import VerlTrainer

    args = {"model": str(tmp_path / "model"), "train_files": str(_parquet(tmp_path / "t.parquet", 8, ("data_source",))),
            "val_files": str(_parquet(tmp_path / "v.parquet", 8, ("data_source",))), "train_batch_size": 4,
            "ppo_mini_batch_size": 4}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(SpecError, match="has no column 'prompt'"):
        VerlTrainer().check_python(VerlTrainer().validate_args(args), sys.executable, {})
    args["overrides"] = ["data.prompt_key=data_source"]
    VerlTrainer().check_python(VerlTrainer().validate_args(args), sys.executable, {})


def test_the_mistakes_table_quotes_what_the_cli_says(fast_local, home, tmp_path):
    """docs/mistakes.md: its rows are the CLI's own words (two checked here end to end)."""
    from helpers import ROOT

    doc = (ROOT / "docs" / "mistakes.md").read_text()
    r = hpcrl("submit", "--site", fast_local, "--trainer", "verl", "--hours", "0.01", "--name", "doc",
              *_verl_args(tmp_path), "--set", "args.total_training_steps=400", check=False)
    said = r.stderr.strip().removeprefix("hpcrl: error: ")
    assert said.split(" (")[0] in doc and said.split("; ", 1)[1] in doc, said
    r = hpcrl("render", "--site", "perlmutter", "--account", "m1234_g", "--trainer", "smoke", "--hours", "72",
              "--total-hours", "10", check=False)
    assert r.stderr.strip().removeprefix("hpcrl: error: ") in doc, r.stderr


def test_the_probe_reads_the_reward_source_not_a_stale_cache_and_leaves_none(tmp_path):
    """Two versions of a reward file of the same size, written within one second, have the same
    __pycache__ key (mtime in seconds + size): the second must still be the one checked."""
    import os

    from hpcrl.trainers.builtin import BuiltinTrainer

    file = tmp_path / "r.py"
    file.write_text("def score(*a):\n    return 0.0\n")
    BuiltinTrainer().check_python({"reward": f"{file}:score"}, sys.executable, {})
    stat = file.stat()
    file.write_text("raise SystemExit('bad one')\n#\n")
    assert file.stat().st_size == stat.st_size
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the same second, for certain
    with pytest.raises(SpecError, match="SystemExit: bad one"):
        BuiltinTrainer().check_python({"reward": f"{file}:score"}, sys.executable, {})
    assert not (tmp_path / "__pycache__").exists()


@pytest.mark.parametrize("body, said", [
    # the case: a reward written for (text, answer) passed the import check and failed two
    # segments later with a TypeError
    ("def score(text, answer):\n    return 1.0\n",
     "does not take the reward's arguments: it is score(text, answer) (too many positional arguments); define "
     "score(data_source, solution_str, ground_truth, extra_info=None) returning a float or a dict with 'score', "
     "or the batch form score(data_sources, solution_strs, ground_truths, extra_infos) returning a list"),
    ("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return ground_truth['target']\n",
     "raised TypeError: string indices must be integers, not 'str' on the first row of {train} with an empty "
     "response; the trainer's first step would fail the same way: it must score any response"),
    ("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return {'reason': 'ok'}\n",
     "returned {'reason': 'ok'} (dict) on the first row of {train} with an empty response; return a float or a "
     "dict with 'score'"),
])
def test_a_reward_that_cannot_score_a_row_of_the_data_is_refused_at_submit(fast_local, home, tmp_path, body, said):
    """#41 item 6: the reward is called once, in the job's interpreter, on the first row of the
    training data, as the trainer calls it: a wrong signature, a failure on the row, or a value
    that is not a score is one line at submit, and no run is left."""
    file = tmp_path / "my_reward.py"
    file.write_text(body)
    train = _parquet(tmp_path / "train.parquet", 8)
    r = hpcrl("submit", "--site", fast_local, "--trainer", "builtin", "--hours", "0.01", "--name", "sig",
              "--set", f"args.reward={file}:score", "--set", "args.data=files", "--set", f"args.train_files={train}",
              check=False)
    _refused(home, r, f"args.reward: {file}:score " + said.replace("{train}", str(train)))


def test_the_reward_signature_is_checked_without_a_row_and_both_forms_pass(tmp_path):
    """Generated data (no file at submit): the signature alone, as the trainer binds it; a per-sample
    and a batch reward that fit are accepted, by path and by module."""
    from hpcrl.trainers.builtin import BuiltinTrainer

    file = tmp_path / "r.py"
    file.write_text("def one(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
                    "def many(data_sources, solution_strs, ground_truths, extra_infos=None):\n"
                    "    return [{'score': 0.0}] * len(solution_strs)\n"
                    "def wrong(data_sources, solution_strs):\n    return []\n")
    train = _parquet(tmp_path / "train.parquet", 4)
    env = {"PYTHONPATH": str(tmp_path)}
    for reward in (f"{file}:one", f"{file}:many", "r:one", "r:many + 0.5*r:one"):
        for data in ({}, {"data": "files", "train_files": str(train)}):
            BuiltinTrainer().check_python({"reward": reward, **data}, sys.executable, env)
    with pytest.raises(SpecError, match=r"args.reward: r:wrong does not take the reward's arguments: it is "
                                        r"wrong\(data_sources, solution_strs\) \(got an unexpected keyword"):
        BuiltinTrainer().check_python({"reward": "r:wrong"}, sys.executable, env)


def test_a_reward_model_that_is_not_a_classifier_is_refused_without_loading_it(fast_local, home, tmp_path):
    """A causal LM as model:PATH loads with a new, untrained score head: its rewards are noise."""
    lm = tmp_path / "SmolLM2"
    lm.mkdir()
    (lm / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    r = hpcrl("submit", "--site", fast_local, "--trainer", "builtin", "--hours", "0.01", "--name", "rm",
              "--set", f"args.reward=model:{lm}", check=False)
    _refused(home, r, f"args.reward: model:{lm} is a LlamaForCausalLM, not a sequence-classification model")
    (lm / "config.json").write_text('{"architectures": ["LlamaForSequenceClassification"]}')
    from hpcrl.trainers.builtin import BuiltinTrainer

    BuiltinTrainer().check_python({"reward": f"model:{lm}"}, sys.executable, {})


def test_the_passes_over_a_small_training_file_are_stated_at_submit(tmp_path, capfd):
    """#41 item 7: 1000 steps of 32 prompts on 18 rows went by in silence; submit now says it (a
    note, not a refusal: many passes over a small set is a fair test), and nothing for one pass."""
    from hpcrl.trainers.builtin import BuiltinTrainer

    train = _parquet(tmp_path / "train.parquet", 18)
    args = {"data": "files", "train_files": str(train), "total_steps": 1000, "batch_size": 32}
    BuiltinTrainer().check_python(args, sys.executable, {})
    err = capfd.readouterr().err
    assert err.strip() == (f"hpcrl: note: args.total_steps 1000 x args.batch_size 32 prompts = 1777.8 passes over the "
                           f"18 rows of {train}; a step of 32 prompts repeats rows within itself; lower them, or give "
                           f"more rows, if that is not what you meant"), err
    BuiltinTrainer().check_python({**args, "total_steps": 2, "batch_size": 9}, sys.executable, {})
    assert capfd.readouterr().err == ""


def test_ctrl_c_during_submit_is_one_line_and_leaves_no_run(fast_local, home, tmp_path):
    """#41 item 7: Ctrl-C in `hpcrl submit` printed a KeyboardInterrupt traceback. The interrupt
    lands while submit waits on its checks (a reward whose import waits here, in the probe, in the
    job's interpreter): one line, exit 130, and nothing of the run."""
    import os
    import signal
    import subprocess

    from helpers import wait_until

    started = tmp_path / "importing"
    file = tmp_path / "slow_reward.py"
    file.write_text(f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(600)\n\n"
                    "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    # SIGINT as a terminal leaves it: a suite started in the background (`./scripts/test &`, a CI
    # runner) hands its children SIGINT ignored, and Python then installs no KeyboardInterrupt for
    # it (the submit slept on in the probe until this test's bound, a CI run of 2026-12-06)
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.cli", "submit", "--site", fast_local, "--trainer", "builtin",
                             "--hours", "0.01", "--name", "intr", "--set", f"args.reward={file}:score"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_until(lambda: started.exists(), 120, "the probe importing the reward", proc=proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err == "hpcrl: interrupted: nothing was submitted\n", (proc.returncode, err)
    assert _no_run_left(home)


def test_a_verl_reward_is_checked_as_verl_calls_it_by_keyword(fast_local, home, tmp_path):
    """verl's reward manager passes data_source=, solution_str=, ... by name: a function whose
    parameters are named otherwise works positionally (the built-in trainer) but not there."""
    file = tmp_path / "r.py"
    file.write_text("def score(ds, sol, gt, extra_info=None):\n    return 0.0\n")
    r = hpcrl("submit", "--site", fast_local, "--trainer", "verl", "--hours", "0.01", "--name", "vkw",
              *_verl_args(tmp_path), "--set", f"args.reward={file}:score", check=False)
    _refused(home, r, f"args.reward: {file}:score does not take the reward's arguments: it is "
                      f"score(ds, sol, gt, extra_info=None) (missing a required argument: 'ds'); define score(")
    from hpcrl.trainers.builtin import BuiltinTrainer

    BuiltinTrainer().check_python({"reward": f"{file}:score"}, sys.executable, {})  # positionally it fits
