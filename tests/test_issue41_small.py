"""#41 item 7, the smaller items, in process: reward terms given by path are named short and
unique; a checkpoint keeps the base model's generation_config.json, and `export` with it; the
trainer's own refusal of a mistyped model path names the model beside it, not a download into it.
(The others: the plot's "beta 0" in test_plot_small.py, the mistyped path at submit and the
passes over a small file in test_submit_checks.py, the demo's Ctrl-C in test_demo.py, HPCRL_CACHE
in test_env_documented.py, eval_before logged once in test_slow_start.py.)"""

from __future__ import annotations

import json

import pytest

from hpcrl.rewards import mix

EXAMPLES = [{"data_source": "x", "ground_truth": "4", "extra_info": {}, "messages": []}] * 2


def test_terms_given_by_path_are_named_by_stem_and_function_and_kept_apart():
    assert mix.term_names(["/tmp/pytest-7/judge.py:compute_score", "/srv/b/judge.py", "model:/scratch/models/my-rm/",
                           "code", "pkg.rewards:score", "/a/judge.py:rubric"]) == [
        "judge.compute_score", "judge.compute_score-2", "model.my-rm", "code", "pkg.rewards:score", "judge.rubric"]
    assert mix.term_names(["/a/r.py:f", "/b/r.py:f", "/c/r.py:f"]) == ["r.f", "r.f-2", "r.f-3"]


def test_a_reward_of_two_files_of_one_name_logs_each_under_its_short_name(tmp_path):
    """The issue's metric was reward/_tmp_..._judge.py_compute_score: the path, sanitised, cut at
    60 characters (two judges in two directories could end up as one key)."""
    files = []
    for d, value in (("first", 1.0), ("second", 0.25)):
        (tmp_path / d).mkdir()
        file = tmp_path / d / "judge.py"
        file.write_text(f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                        f"    return {{'score': {value}, 'reason': '{d}', 'sure': 1.0}}\n")
        files.append(file)
    reward = mix.Reward({"reward": f"0.5*{files[0]} + 0.5*{files[1]}:compute_score"})
    scores, metrics = reward(EXAMPLES, ["a", "b"])
    assert scores == [0.625, 0.625]
    assert metrics == {"reward/judge.compute_score": 1.0, "reward/judge.compute_score-2": 0.25,
                       "reward/reason/first": 1.0, "reward/reason/second": 1.0, "reward/sure": 1.0}
    # a sample's terms (RUN/samples, `hpcrl samples`) by the same names
    assert reward.details[0]["terms"] == {"judge.compute_score": 1.0, "judge.compute_score-2": 0.25}
    assert reward.details[0]["extras"] == {"judge.compute_score/sure": 1.0, "judge.compute_score-2/reason": "second",
                                           "judge.compute_score-2/sure": 1.0}


@pytest.mark.parametrize("has_one", [True, False])
def test_export_keeps_the_base_models_generation_config(home, tmp_path, has_one):
    """`hpcrl export` copies what the checkpoint holds, and the checkpoint held no
    generation_config.json: the exported model lost its sampling defaults (eos ids, temperature)."""
    import torch

    from hpcrl import control, export
    from hpcrl.checkpoints.store import CheckpointStore, read_manifest
    from hpcrl.checkpoints.trainer import checkpointer
    from hpcrl.rl import policy
    from hpcrl.rl.tiny import build_tiny_model
    from hpcrl.runs import Run
    from hpcrl.spec import resolve

    model_dir = build_tiny_model(tmp_path / "m", hidden_size=32, layers=1, heads=2, max_int=60)
    gen = model_dir / "generation_config.json"
    if has_one:  # the model's own defaults, as a released model carries them
        gen.write_text(json.dumps({**json.loads(gen.read_text()), "temperature": 0.6, "top_p": 0.9}, indent=2))
    else:
        gen.unlink()
    model, tok = policy.load_policy(model_dir, torch.device("cpu"))
    run = control.create_run(resolve(None, "local", [f"args.model={model_dir}"], {"trainer": "builtin"}), "gc")
    files = checkpointer.base_model_files(model_dir)
    assert files == ([gen] if has_one else [])
    checkpointer.Checkpointer(run.layout.checkpoints, async_save=False, tokenizer=tok, model_files=files).save_now(
        2, model, torch.optim.AdamW(model.parameters()), {"step": 2})
    saved = CheckpointStore(run.layout.checkpoints).find_latest()[1]
    assert ("generation_config.json" in read_manifest(saved)["files"]) == has_one  # digest-checked on export
    record, _ = export.export(Run.by_id("gc"), None, tmp_path / "out")
    assert ("generation_config.json" in record["files"]) == has_one
    if has_one:
        assert (tmp_path / "out" / "generation_config.json").read_bytes() == gen.read_bytes()
    else:
        assert not (tmp_path / "out" / "generation_config.json").exists()


def test_the_trainer_names_the_model_beside_a_mistyped_path(tmp_path):
    """The job's own check (a path that exists only on the compute side is checked there): the
    same sentence as submit's, with the near model and no download into the typo."""
    from hpcrl.rl import prepare

    real = tmp_path / "models" / "SmolLM2-135M-Instruct"
    real.mkdir(parents=True)
    (real / "config.json").write_text("{}")
    typo = tmp_path / "models" / "SmolLM2-135M-Instrcut"
    with pytest.raises(FileNotFoundError) as e:
        prepare.prepare_model({"model": str(typo)}, tmp_path / "run")
    assert str(e.value).startswith(f"args.model: {typo} does not exist (did you mean {real}?); to get a model, "
                                   "download it on a login node (`huggingface-cli download"), e.value
    assert f"--local-dir {typo}" not in str(e.value)
    with pytest.raises(FileNotFoundError, match=r"/nothing/here does not exist; to get a model"):
        prepare.prepare_model({"model": str(tmp_path / "nothing" / "here")}, tmp_path / "run")
