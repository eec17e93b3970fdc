"""MaxText adapter: every rendered key exists in the pinned MaxText's RL config (YAML from the wheel)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml

from hpcrl.errors import SpecError
from hpcrl.job import maxtext as maxtext_launch
from hpcrl.trainers.maxtext import (MAXTEXT_VERSION, MaxTextTrainer, check_user_overrides, config_keys,
                                    maxtext_checkpoint_step)

from helpers import adapter_context, job_launcher

DATA = Path(__file__).resolve().parent / "data" / "maxtext" / MAXTEXT_VERSION
RECIPES = Path(__file__).resolve().parents[1] / "hpcrl" / "recipes"
# sha256 of maxtext-0.2.5-py3-none-any.whl the YAML files were copied from (tests/data/maxtext/README.md)
WHEEL_SHA256 = "2fe8e4ffc3a06bd06f94daeaaf5fe3ecee748bb6f661c0f426e07e2ca10c9406"
RL_KEYS = config_keys((DATA / "base.yml").read_text(), (DATA / "rl.yml").read_text())


def ctx_for(args, chips=4, nodes=1, run_dir="/home/u/hpcrl/runs/r-1", bucket=None):
    trainer = MaxTextTrainer()
    site = {"chips_per_vm": chips, **({"bucket": bucket} if bucket else {})}
    return trainer, adapter_context(trainer, args, run_dir, site=site, resources={"nodes": nodes})


def rendered_pairs(argv):
    # python3 -m hpcrl.job.maxtext --python python3 ... -- key=value ...: the launcher (from the run's
    # lib/) runs `python3 -m MODULE key=value ...` (no config path: MaxText maps this module to post_train/rl.yml)
    assert argv[:3] == ["python3", "-m", "hpcrl.job.maxtext"] and "--" in argv, argv
    opts = maxtext_launch.parse_args(argv[3:])
    assert maxtext_launch.main([*argv[3:argv.index("--")], "--dry-run", "--", *opts.args]) == 0
    return dict(a.split("=", 1) for a in opts.args)


@pytest.mark.parametrize("name, loss_algo", [("maxtext-llama3.1-8b-grpo", "grpo"), ("maxtext-llama3.1-8b-gspo", "gspo-token")])
@pytest.mark.parametrize("chips", [4, 8])  # v5p-8, v6e-8
def test_recipe_renders_only_keys_of_the_pinned_rl_config(name, loss_algo, chips):
    spec = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    assert spec["trainer"] == "maxtext"
    trainer, ctx = ctx_for(spec["args"], chips=chips, bucket="gs://my-bucket")
    pairs = rendered_pairs(trainer.command(ctx))
    assert set(pairs) <= RL_KEYS, sorted(set(pairs) - RL_KEYS)
    assert pairs["loss_algo"] == loss_algo and pairs["chips_per_vm"] == str(chips)
    # the recipes' placeholder bucket takes the site's
    assert pairs["run_name"] == "r-1" and pairs["base_output_directory"] == "gs://my-bucket/hpcrl"
    assert pairs["load_parameters_path"] == "gs://my-bucket/llama3.1-8b-maxtext/0/items"
    assert int(pairs["checkpoint_period"]) > 0
    assert trainer.checkpoint_root(ctx) == "gs://my-bucket/hpcrl/r-1/checkpoints"
    _, no_bucket = ctx_for(spec["args"], chips=chips)  # a site without a bucket: the placeholder is refused
    with pytest.raises(SpecError, match="gs://YOUR_BUCKET/hpcrl is a placeholder"):
        trainer.command(no_bucket)


def test_loss_algo_values_are_the_ones_maxtext_accepts():
    rl = yaml.safe_load((DATA / "rl.yml").read_text())["rl"]
    assert rl["loss_algo"] == "grpo"
    assert "gspo-token" in (DATA / "rl.yml").read_text()  # "# grpo or gspo-token"


def test_command_is_the_seed_command_for_defaults():
    trainer, ctx = ctx_for({"load_parameters_path": "gs://bkt/ckpt/0/items", "algorithm": "gspo"}, chips=8)
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


def test_recipes_load_a_checkpoint_and_null_means_random_init():
    # random initialisation is for tests (the tier); every recipe names the checkpoint to train
    for name in ("maxtext-llama3.1-8b-grpo", "maxtext-llama3.1-8b-gspo"):
        assert yaml.safe_load((RECIPES / f"{name}.yaml").read_text())["args"]["load_parameters_path"]
    assert MaxTextTrainer().validate_args({})["load_parameters_path"] is None
    with pytest.raises(SpecError, match="args.load_parameters_path"):
        MaxTextTrainer().validate_args({"load_parameters_path": ""})


def test_checkpoint_step_ignores_unfinished_orbax_dirs(tmp_path):
    assert maxtext_checkpoint_step(tmp_path / "missing") is None
    for name in ("0", "50", "100.orbax-checkpoint-tmp", "100.orbax-checkpoint-tmp-1712", "tmp"):
        (tmp_path / name).mkdir()
    assert MaxTextTrainer().checkpoint_step(tmp_path.parent, tmp_path) == 50


def test_checkpoint_step_reads_tunix_actor_dir(tmp_path):
    # measured (notes/maxtext-cpu.md, and the tier): <base>/<run>/checkpoints/actor/<step>/
    import json

    run_dir = tmp_path / "r-1"
    run_dir.mkdir()
    args = MaxTextTrainer().validate_args({"load_parameters_path": None})
    (run_dir / "spec.json").write_text(json.dumps({"spec": {"args": args, "resources": {"nodes": 1}},
                                                   "site": {"chips_per_vm": 4}}))
    ckpt = run_dir / "maxtext" / "r-1" / "checkpoints"
    (ckpt / "9").mkdir(parents=True)  # not Tunix's place: ignored
    assert MaxTextTrainer().checkpoint_step(run_dir, run_dir / "checkpoints") is None
    for name in ("1", "2", "4", "6.orbax-checkpoint-tmp"):
        (ckpt / "actor" / name).mkdir(parents=True)
    assert MaxTextTrainer().checkpoint_step(run_dir, run_dir / "checkpoints") == 4


@pytest.mark.parametrize("args, overrides, steps", [
    ({"num_batches": 10}, [], 10), ({"num_batches": 10, "num_epoch": 2}, [], 20),
    ({"num_batches": 10}, ["num_iterations=2", "train_fraction=0.5"], 10),
    ({}, [], 4),  # rl.yml's num_batches
])
def test_total_steps_is_maxtexts_train_steps(args, overrides, steps):
    # types.py: train_steps = num_batches x num_iterations x train_fraction x num_epoch
    a = MaxTextTrainer().validate_args({"load_parameters_path": None, **args, "overrides": overrides})
    assert MaxTextTrainer().total_steps(a) == steps


def test_random_init_leaves_load_parameters_path_out():
    # MaxText rejects an empty load_parameters_path; null renders nothing (random initialisation)
    trainer, ctx = ctx_for({"load_parameters_path": None})
    assert "load_parameters_path" not in rendered_pairs(trainer.command(ctx))


def test_launcher_argv_carries_cadence_layout_and_eval_choice():
    trainer, ctx = ctx_for({"load_parameters_path": "x", "checkpoint_period": 7, "num_batches": 30,
                            "eval_every_segment": True})
    argv = trainer.command(ctx)
    opts = maxtext_launch.parse_args(argv[3:])
    assert opts.ckpt_root == "/home/u/hpcrl/runs/r-1/maxtext/r-1/checkpoints/actor"
    assert (opts.period, opts.total_steps, opts.eval) == (7, 30, "every")
    assert not any(name.endswith(".py") for name in trainer.files(ctx))  # the launcher: hpcrl.job.maxtext, in lib/


def test_launcher_skips_pre_training_eval_after_the_first_segment():
    opts = maxtext_launch.parse_args(["--python", "p", "--ckpt-root", "c", "--period", "2"])
    assert maxtext_launch.runtime_keys(opts, {"HPCRL_SEGMENT": "1"}) == []
    assert maxtext_launch.runtime_keys(opts, {"HPCRL_SEGMENT": "2"}) == ["num_test_batches=0"]
    every = maxtext_launch.parse_args(["--python", "p", "--ckpt-root", "c", "--period", "2", "--eval", "every"])
    assert maxtext_launch.runtime_keys(every, {"HPCRL_SEGMENT": "3"}) == []


def test_launcher_stop_decision_and_pace():
    opts = maxtext_launch.parse_args(["--python", "p", "--ckpt-root", "c", "--period", "5"])
    assert not maxtext_launch.should_stop(opts, 10, None, None)  # nothing measured: keep going
    # 2 (safety) x 5 steps x 4 s + one step for its metrics + a 6 s save + the 10 s margin = 60 s
    assert maxtext_launch.PACE_SAFETY == 2
    assert maxtext_launch.should_stop(opts, 59, 4.0, 6.0) and not maxtext_launch.should_stop(opts, 61, 4.0, 6.0)
    assert maxtext_launch.should_stop(opts, 61, 4.0, 6.0, poll_s=15)  # a GCS listing's interval counts too
    # the first save of a segment (after compilation) only starts the clock; the slowest pace counts
    assert maxtext_launch.pace([(1, 100.0)]) is None
    assert maxtext_launch.pace([(1, 100.0), (3, 104.0), (5, 110.0)]) == 3.0


def test_launcher_removes_only_temporary_step_dirs(tmp_path):
    for name in ("2", "4", "6.orbax-checkpoint-tmp", "8.orbax-checkpoint-tmp-1712"):
        (tmp_path / name / "model_params").mkdir(parents=True)
    removed = maxtext_launch.clean_temporary(tmp_path)
    assert sorted(p.name for p in removed) == ["6.orbax-checkpoint-tmp", "8.orbax-checkpoint-tmp-1712"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "4"]
    assert maxtext_launch.committed_steps(tmp_path) == [2, 4]


def test_gs_checkpoints_are_listed_by_the_hooks_and_read_from_the_cache_by_status(tmp_path, monkeypatch):
    # gs:// through the fake gcloud (a test double mapping gs:// to a local dir), as on the TPU VM
    import json

    from helpers import use_fake_gcloud

    fake, _ = use_fake_gcloud(monkeypatch, tmp_path)
    run_dir = tmp_path / "r-1"
    run_dir.mkdir()
    args = MaxTextTrainer().validate_args({"load_parameters_path": "gs://bkt/ckpt", "base_output_directory": "gs://bucket"})
    (run_dir / "spec.json").write_text(json.dumps({"spec": {"args": args, "resources": {"nodes": 1}},
                                                   "site": {"chips_per_vm": 4}}))
    # Tunix's layout: checkpoints/actor/<step>/; on GCS Orbax writes <step>/ in place and commits
    # it with commit_success.txt last (a step directory without it is a save in progress)
    root = tmp_path / "gcs" / "bucket" / "r-1" / "checkpoints" / "actor"
    trainer, calls = MaxTextTrainer(), fake / "calls.jsonl"
    assert trainer.checkpoint_step(run_dir, run_dir / "checkpoints", remote=True) is None  # nothing there yet
    for name in ("0", "50", "100", "100.orbax-checkpoint-tmp-1712"):
        root.joinpath(name).mkdir(parents=True)
    for name in ("0", "50"):
        root.joinpath(name, "commit_success.txt").write_text("")
    root.parent.joinpath("70").mkdir()  # directly under checkpoints/: not where Tunix writes
    root.parent.joinpath("70", "commit_success.txt").write_text("")
    assert trainer.checkpoint_step(run_dir, run_dir / "checkpoints", remote=True) == 50
    listed = calls.read_text()
    assert trainer.checkpoint_step(run_dir, run_dir / "checkpoints") == 50  # status: the cached listing
    assert calls.read_text() == listed, "reading the step for status ran gcloud"


def test_test_data_is_the_wheels_yaml():
    readme = (DATA.parent / "README.md").read_text()
    assert MAXTEXT_VERSION in readme and "maxtext/configs/post_train/rl.yml" in readme
    assert len(WHEEL_SHA256) == 64 and hashlib.sha256((DATA / "rl.yml").read_bytes()).hexdigest()
    assert {"chips_per_vm", "checkpoint_period", "loss_algo", "num_generations", "run_name"} <= RL_KEYS


def test_launcher_reads_gcs_commit_markers_and_cleans_uncommitted_steps(tmp_path, monkeypatch):
    # On GCS Orbax writes <step>/ in place and commit_success.txt last (the fake gcloud, a test
    # double, maps gs:// to a local folder)
    from helpers import use_fake_gcloud

    _, gcs = use_fake_gcloud(monkeypatch, tmp_path)
    actor = gcs / "bucket" / "hpcrl" / "r-1" / "checkpoints" / "actor"
    for name in ("2", "4", "6", "8.orbax-checkpoint-tmp"):
        (actor / name / "model_params").mkdir(parents=True)
        (actor / name / "model_params" / "x").write_text("x")
    for name in ("2", "4"):
        (actor / name / "commit_success.txt").write_text("")
    store = maxtext_launch.store_for("gs://bucket/hpcrl/r-1/checkpoints/actor/")
    assert isinstance(store, maxtext_launch.GcsStore)
    assert store.committed() == [2, 4]
    assert store.in_progress() == ["6", "8.orbax-checkpoint-tmp"]  # 6: a save still writing, or torn
    assert store.clean() == ["6", "8.orbax-checkpoint-tmp"]
    assert sorted(p.name for p in actor.iterdir()) == ["2", "4"] and store.in_progress() == []
    assert maxtext_launch.store_for(str(tmp_path)).poll_s < store.poll_s


STAND_IN = """#!/bin/bash
# TEST DOUBLE of a MaxText process in the middle of an Orbax save: the step's temporary directory
# exists until the test allows the rename (the commit); ignores every signal it can.
trap '' TERM USR1 INT
trap 'touch "$CKPT/continued"' CONT  # the launcher froze it (SIGSTOP) and let it go on
cd "$CKPT"
mkdir -p 2.orbax-checkpoint-tmp/model_params
touch ready
while [ ! -e rename-now ]; do sleep 0.05; done
mv 2.orbax-checkpoint-tmp 2
touch renamed
while :; do sleep 0.05; done
"""


def test_launcher_never_kills_during_a_save_and_exits_85_after_it(tmp_path):
    """A TERM that arrives while a save is in progress: the launcher (a real process) freezes the
    trainer, sees the temporary directory, lets it go on, and kills it only once the step is
    committed; then exits 85 and records why."""
    import os
    import subprocess
    import sys

    from helpers import wait_until

    ckpt, run_dir = tmp_path / "actor", tmp_path / "run"
    ckpt.mkdir()
    run_dir.mkdir()
    stand_in = tmp_path / "maxtext-stand-in"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    launcher, env = job_launcher(tmp_path, "hpcrl.job.maxtext")
    proc = subprocess.Popen([*launcher, "--python", str(stand_in), "--ckpt-root", str(ckpt),
                             "--period", "2", "--total-steps", "10", "--", "run_name=r"],
                            env={**env, "CKPT": str(ckpt), "HPCRL_RUN_DIR": str(run_dir), "HPCRL_SEGMENT": "1"})
    try:
        wait_until(lambda: (ckpt / "ready").exists(), 60, "the stand-in's save to start")
        proc.send_signal(15)  # TERM during the save
        # the launcher freezes the stand-in, sees the save in progress and resumes it (SIGCONT)
        wait_until(lambda: (ckpt / "continued").exists(), 60, "the launcher to let the save go on",
                   describe=lambda: f"launcher exit code {proc.poll()}")
        (ckpt / "rename-now").touch()  # the save commits
        assert proc.wait(timeout=60) == 85
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (ckpt / "renamed").exists() and (ckpt / "2").is_dir()  # killed only after the commit
    end = [json.loads(ln) for ln in (run_dir / "maxtext-segments.jsonl").read_text().splitlines()][-1]
    assert end == {**end, "event": "end", "rc": 85, "stopped_for": "term", "last_save": 2, "metrics_through": None}
    assert (run_dir / "maxtext-saves.jsonl").read_text().count('"step": 2') == 1


def test_launcher_runs_from_the_lib_snapshot_on_the_stdlib(tmp_path):
    # it runs in the job's interpreter (the TPU VM's MaxText venv), which has no hpcrl: the stdlib
    # (no site-packages) and the run's lib/ snapshot on PYTHONPATH must be enough
    import subprocess

    launcher, env = job_launcher(tmp_path, "hpcrl.job.maxtext")
    out = subprocess.run([*launcher, "--python", "p", "--ckpt-root",
                          str(tmp_path), "--period", "2", "--dry-run", "--", "run_name=r"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["argv"] == ["p", "-m", maxtext_launch.MODULE, "run_name=r"]


def test_metrics_from_tunix_events_reach_hpcrl_records(tmp_path):
    """Tunix writes scalars as tensorboard events (TFRecord-framed Event protobufs); the launcher
    reads them with the stdlib and writes hpcrl metric records (what `status` shows). The file is
    a real one from the MaxText tier (tests/data/maxtext/README.md)."""
    import shutil

    tb = tmp_path / "tensorboard"
    tb.mkdir()
    old = tb / "events.out.tfevents.1.vm"
    old.write_bytes(b"")  # an earlier segment's file: not this segment's metrics
    bridge = maxtext_launch.MetricsBridge(tb, str(tmp_path / "metrics.jsonl"))
    shutil.copy(DATA.parent / "tunix-4-steps.tfevents", tb / "events.out.tfevents.2.vm")
    first = bridge.poll()
    last = bridge.poll(final=True)
    recs = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert recs == first + last and [r["step"] for r in recs] == [1, 2, 3, 4]
    assert [r["step"] for r in last] == [4]  # the newest step waits for the final poll
    for r in recs:
        assert r["trainer"] == "maxtext" and {"loss", "kl", "grad_norm", "reward_mean", "response_len"} <= set(r), r


# sha256 of the wheel's own files (its RECORD, urlsafe base64 without padding), which hpcrl ships
WHEEL_RECORD = {"tpu_post_train_overrides.txt": "AVbTpm53TCrAMoioPHIKvOSbiFpfa1efhh4eBJV7U6Q",
                "post_train_github_deps.txt": "CjxGLHR1RW4QaPMVegh64f9VjTMmRKzyN7igQQUJ8Sc"}


def test_tpu_requirement_set_is_maxtexts_documented_install():
    import base64

    from hpcrl.trainers.maxtext import DEPS_DIR, tpu_github_deps, tpu_requirements, venv_install_script

    for name, digest in WHEEL_RECORD.items():
        ours = base64.urlsafe_b64encode(hashlib.sha256((DEPS_DIR / name).read_bytes()).digest()).rstrip(b"=").decode()
        assert ours == digest, f"{name} is not the 0.2.5 wheel's"
    lines, options = tpu_requirements({"spec": {"requirements": ["wandb==0.19.0"]}})
    assert lines == ["maxtext[tpu-post-train]==0.2.5", "wandb==0.19.0"]
    # torch==2.11.0+cpu (the extra's pin) only on PyTorch's CPU index: uv's torch backend, as MaxText's setup.sh
    assert options[:2] == ["--torch-backend=cpu", "--resolution=lowest"]
    overrides = Path(options[2].split("=", 1)[1]).read_text()
    assert options[2].startswith("--override=") and {"jax==0.11.0", "libtpu==0.0.44", "flax==0.12.8"} <= set(overrides.split())
    deps = tpu_github_deps()
    assert [d.split(" @ ")[0] for d in deps] == ["google-tunix", "tpu-inference", "vllm"]
    assert all(re.search(r"[0-9a-f]{40}", d) for d in deps), "each pinned to a commit"
    script = venv_install_script()
    for step in ("uv venv --python 3.12 --seed \"$venv\"",
                 "uv pip install --python \"$venv/bin/python\" --torch-backend=cpu --resolution=lowest "
                 "--override \"$here/tpu_post_train_overrides.txt\" -r \"$requirements\"",
                 "install_tpu_post_train_extra_deps\n"):
        assert step in script, step
    body = script.split("\nset -euo pipefail\n", 1)[1]  # the commands, after the header's comments
    assert body.index("uv venv") < body.index("uv pip install --python") < body.index("install_tpu_post_train")
