"""MaxText adapter: every rendered key exists in the pinned MaxText's RL config (YAML from the wheel)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from hpcrl.errors import SpecError
from hpcrl.trainers.maxtext import (MAXTEXT_VERSION, MODULE, MaxTextTrainer, check_user_overrides, config_keys,
                                    maxtext_checkpoint_step)

from helpers import adapter_context

DATA = Path(__file__).resolve().parent / "data" / "maxtext" / MAXTEXT_VERSION
RECIPES = Path(__file__).resolve().parents[1] / "hpcrl" / "recipes"
# sha256 of maxtext-0.2.5-py3-none-any.whl the YAML files were copied from (tests/data/maxtext/README.md)
WHEEL_SHA256 = "2fe8e4ffc3a06bd06f94daeaaf5fe3ecee748bb6f661c0f426e07e2ca10c9406"
RL_KEYS = config_keys((DATA / "base.yml").read_text(), (DATA / "rl.yml").read_text())


def ctx_for(args, chips=4, nodes=1, run_dir="/home/u/hpcrl/runs/r-1"):
    trainer = MaxTextTrainer()
    return trainer, adapter_context(trainer, args, run_dir, site={"chips_per_vm": chips}, resources={"nodes": nodes})


def rendered_pairs(argv):
    assert argv[:3] == ["python3", "-m", MODULE]  # no config path: MaxText maps this module to post_train/rl.yml
    return dict(a.split("=", 1) for a in argv[3:])


@pytest.mark.parametrize("name, loss_algo", [("maxtext-llama3.1-8b-grpo", "grpo"), ("maxtext-llama3.1-8b-gspo", "gspo-token")])
@pytest.mark.parametrize("chips", [4, 8])  # v5p-8, v6e-8
def test_recipe_renders_only_keys_of_the_pinned_rl_config(name, loss_algo, chips):
    spec = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    assert spec["trainer"] == "maxtext"
    trainer, ctx = ctx_for(spec["args"], chips=chips)
    pairs = rendered_pairs(trainer.command(ctx))
    assert set(pairs) <= RL_KEYS, sorted(set(pairs) - RL_KEYS)
    assert pairs["loss_algo"] == loss_algo and pairs["chips_per_vm"] == str(chips)
    assert pairs["run_name"] == "r-1" and pairs["base_output_directory"] == spec["args"]["base_output_directory"]
    assert pairs["load_parameters_path"].endswith("/0/items") and int(pairs["checkpoint_period"]) > 0
    assert trainer.checkpoint_root(ctx) == f"{spec['args']['base_output_directory']}/r-1/checkpoints"


def test_loss_algo_values_are_the_ones_maxtext_accepts():
    rl = yaml.safe_load((DATA / "rl.yml").read_text())["rl"]
    assert rl["loss_algo"] == "grpo"
    assert "gspo-token" in (DATA / "rl.yml").read_text()  # "# grpo or gspo-token"


def test_command_is_the_seed_command_for_defaults():
    trainer, ctx = ctx_for({"load_parameters_path": "gs://b/ckpt/0/items", "algorithm": "gspo"}, chips=8)
    pairs = rendered_pairs(trainer.command(ctx))
    for key in ("model_name", "load_parameters_path", "run_name", "base_output_directory", "chips_per_vm", "loss_algo"):
        assert key in pairs  # the tutorial's command line
    assert pairs["base_output_directory"] == "/home/u/hpcrl/runs/r-1/maxtext"


def test_checkpoint_period_sized_from_step_time():
    trainer, ctx = ctx_for({"load_parameters_path": "x", "step_time_s": 40, "save_every_s": 1200})
    assert rendered_pairs(trainer.command(ctx))["checkpoint_period"] == "30"


def test_user_override_checked_against_rl_keys():
    assert check_user_overrides(["eval_interval=20", "num_generations=4"], RL_KEYS)
    with pytest.raises(SpecError, match=r"'num_generation' is not a key of MaxText 0\.2\.5.*did you mean 'num_generations'"):
        check_user_overrides(["num_generation=4"], RL_KEYS)
    with pytest.raises(SpecError, match="'run_name' is set by hpcrl"):
        check_user_overrides(["run_name=other"], RL_KEYS)


@pytest.mark.parametrize("args, ctx_kw, field", [
    ({"algorithm": "ppo"}, {}, "args.algorithm"), ({"checkpoint_period": 0}, {}, "args.checkpoint_period"),
    ({}, {"nodes": 2}, "resources.nodes"), ({}, {"chips": None}, "chips_per_vm")])
def test_bad_values_name_the_field(args, ctx_kw, field):
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        trainer, ctx = ctx_for({"load_parameters_path": "x", **args}, **ctx_kw)
        trainer.command(ctx)


def test_load_parameters_path_is_required():
    with pytest.raises(SpecError, match="args.load_parameters_path"):
        MaxTextTrainer().validate_args({})


def test_checkpoint_step_ignores_unfinished_orbax_dirs(tmp_path):
    assert maxtext_checkpoint_step(tmp_path / "missing") is None
    for name in ("0", "50", "100.orbax-checkpoint-tmp-1712", "tmp"):
        (tmp_path / name).mkdir()
    assert MaxTextTrainer().checkpoint_step(tmp_path.parent, tmp_path) == 50


def test_gs_checkpoints_are_listed_by_the_hooks_and_read_from_the_cache_by_status(tmp_path, monkeypatch):
    # gs:// through the fake gcloud (a test double mapping gs:// to a local dir), as on the TPU VM
    import json

    from helpers import use_fake_gcloud

    fake, _ = use_fake_gcloud(monkeypatch, tmp_path)
    run_dir = tmp_path / "r-1"
    run_dir.mkdir()
    args = MaxTextTrainer().validate_args({"load_parameters_path": "gs://b/ckpt", "base_output_directory": "gs://bucket"})
    (run_dir / "spec.json").write_text(json.dumps({"spec": {"args": args, "resources": {"nodes": 1}},
                                                   "site": {"chips_per_vm": 4}}))
    root = tmp_path / "gcs" / "bucket" / "r-1" / "checkpoints"
    trainer, calls = MaxTextTrainer(), fake / "calls.jsonl"
    assert trainer.checkpoint_step(run_dir, run_dir / "checkpoints", remote=True) is None  # nothing there yet
    for name in ("0", "50", "100.orbax-checkpoint-tmp-1712"):
        root.joinpath(name).mkdir(parents=True)
    assert trainer.checkpoint_step(run_dir, run_dir / "checkpoints", remote=True) == 50
    listed = calls.read_text()
    assert trainer.checkpoint_step(run_dir, run_dir / "checkpoints") == 50  # status: the cached listing
    assert calls.read_text() == listed, "reading the step for status ran gcloud"


def test_test_data_is_the_wheels_yaml():
    readme = (DATA.parent / "README.md").read_text()
    assert MAXTEXT_VERSION in readme and "maxtext/configs/post_train/rl.yml" in readme
    assert len(WHEEL_SHA256) == 64 and hashlib.sha256((DATA / "rl.yml").read_bytes()).hexdigest()
    assert {"chips_per_vm", "checkpoint_period", "loss_algo", "num_generations", "run_name"} <= RL_KEYS
