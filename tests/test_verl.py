"""verl adapter: every rendered override is composed with verl's own ppo_trainer config.

Needs `pip install --no-deps verl==0.9.1 hydra-core==1.3.2 omegaconf==2.3.0
antlr4-python3-runtime==4.9.3` (the test extra); the composition tests skip without them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hpcrl import protocol
from hpcrl.errors import SpecError
from hpcrl.job import verl as verl_launch
from hpcrl.trainers.verl import VERL_VERSION, VerlTrainer, compose, ray_env, ray_bootstrap, verl_checkpoint_step, verl_config_dir

from helpers import adapter_context, protocol_env

RECIPES = Path(__file__).resolve().parents[1] / "hpcrl" / "recipes"
VERL_RECIPES = ["tinyzero-countdown-ppo", "tinyzero-countdown-grpo", "verl-gsm8k-grpo", "verl-gsm8k-gspo"]
DATA = Path(__file__).resolve().parent / "data" / "verl"

needs_verl = pytest.mark.skipif(
    importlib.util.find_spec("hydra") is None or verl_config_dir() is None,
    reason=f"needs verl=={VERL_VERSION} (--no-deps) and hydra-core in the test venv",
)


def ctx_for(args, nodes=1, gpus=4, run_dir="/pscratch/sd/u/user/hpcrl/runs/r-1"):
    trainer = VerlTrainer()
    return trainer, adapter_context(trainer, args, run_dir, site={"gpus_per_node": gpus, "cpus_per_task": 128},
                                    resources={"nodes": nodes}, python="/global/common/software/m1234/venv/bin/python")


def recipe(name):
    return yaml.safe_load((RECIPES / f"{name}.yaml").read_text())


def verl_overrides(trainer, ctx, segment=2, deadline=1_800_000_000, wandb=False):
    """Exactly what verl receives in segment `segment`: the static argv after '--', then the launcher's."""
    argv = trainer.command(ctx)
    assert argv[1:3] == ["-m", "hpcrl.job.verl"], argv  # run from the run's lib/ snapshot of hpcrl
    opts = verl_launch.parse_args(argv[3:])
    env = {"HPCRL_SEGMENT": str(segment), "HPCRL_DEADLINE": str(deadline), "SCRATCH": "/pscratch/sd/u/user"}
    if wandb:
        env["WANDB_API_KEY"] = "x"
    return verl_launch.expand_paths(opts.args, env) + verl_launch.runtime_overrides(opts, env, ctx.run_dir, [])


def base_args(**kw):
    return {"model": "/m/Qwen2.5-3B-Instruct", "train_files": "/d/train.parquet", "val_files": "/d/test.parquet", **kw}


# ------------------------------------------------------------------ composition with verl's config


@needs_verl
@pytest.mark.parametrize("name", VERL_RECIPES)
def test_recipe_overrides_compose_to_the_intended_values(name):
    spec = recipe(name)
    assert spec["trainer"] == "verl"
    trainer, ctx = ctx_for(spec["args"], gpus=spec["resources"]["gpus_per_node"])
    cfg = compose(verl_overrides(trainer, ctx))
    algo = spec["args"]["algorithm"]
    assert cfg.algorithm.adv_estimator == {"ppo": "gae", "grpo": "grpo", "gspo": "grpo"}[algo]
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == ("gspo" if algo == "gspo" else "vanilla")
    assert cfg.actor_rollout_ref.rollout.n == {"ppo": 1, "grpo": spec["args"].get("rollout_n", 5), "gspo": 16}[algo]
    assert cfg.actor_rollout_ref.rollout.name == "vllm"
    assert cfg.trainer.resume_mode == "auto"
    assert cfg.trainer.default_local_dir == str(ctx.ckpt_dir)
    assert cfg.trainer.save_freq > 0  # verl saves nothing (not even at the deadline) otherwise
    assert cfg.trainer.val_before_train is False  # segment 2
    assert cfg.trainer.use_v1 is False and cfg.trainer.esi_redundant_time == spec["args"].get("save_time_s", 300)
    assert cfg.trainer.n_gpus_per_node == spec["resources"]["gpus_per_node"] and cfg.trainer.nnodes == 1
    assert list(cfg.trainer.logger) == ["console", "file"]
    env_vars = cfg.ray_kwargs.ray_init.runtime_env.env_vars
    # a str, as Ray requires; moved by verl's fixed 60 s less the stop margin (esi_timestamp)
    assert env_vars.MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP == str(1_800_000_000 + 60 - 10)
    # every segment logs to one wandb run: the run's id, resumed (wandb reads these; verl passes no id)
    assert (env_vars.WANDB_RUN_ID, env_vars.WANDB_RESUME) == (ctx.run_dir.name, "allow")
    assert "WANDB_API_KEY" not in env_vars  # the key stays in the job's environment, never in the argv
    assert env_vars.VERL_FILE_LOGGER_PATH == str(ctx.run_dir / "verl-metrics" / "segment-002.jsonl")
    assert cfg.reward.custom_reward_function.path == str(ctx.run_dir / "verl" / "rewards.py")
    assert cfg.reward.custom_reward_function.name == "compute_score"
    assert cfg.trainer.rollout_data_dir == str(ctx.run_dir / "verl" / "rollouts")  # what `hpcrl samples` reads
    assert cfg.data.train_files.startswith("/pscratch/sd/u/user/")  # $SCRATCH expanded in the job
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size is None  # only the *_per_gpu form is set


@needs_verl
def test_tinyzero_recipe_keeps_tinyzero_settings():
    spec = recipe("tinyzero-countdown-ppo")
    trainer, ctx = ctx_for(spec["args"])
    cfg = compose(verl_overrides(trainer, ctx, segment=1, wandb=True))
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.data.max_response_length) == (256, 256, 1024)
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6 and cfg.critic.optim.lr == 1e-5
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 64
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 8
    assert cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 8
    assert cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 4
    assert cfg.critic.ppo_micro_batch_size_per_gpu == 8 and cfg.critic.model.path == cfg.actor_rollout_ref.model.path
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.001 and cfg.actor_rollout_ref.rollout.gpu_memory_utilization == 0.4
    assert (cfg.trainer.save_freq, cfg.trainer.test_freq, cfg.trainer.total_epochs) == (100, 100, 15)
    assert cfg.trainer.project_name == "TinyZero"
    assert cfg.trainer.val_before_train is True  # first segment: evaluate before training
    assert list(cfg.trainer.logger) == ["console", "file", "wandb"]


@needs_verl
def test_gspo_matches_verls_example():
    _, ctx = ctx_for(base_args(algorithm="gspo"))
    a = compose(VerlTrainer().overrides(ctx)).actor_rollout_ref.actor
    assert (a.loss_agg_mode, a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c, a.use_kl_loss) == (
        "seq-mean-token-mean", 3e-4, 4e-4, 10.0, False)


@needs_verl
def test_wrong_user_override_is_one_line_spec_error_at_validation():
    with pytest.raises(SpecError) as e:
        VerlTrainer().validate_args(base_args(overrides=["trainer.test_freq=5", "actor_rollout_ref.actor.entropy_coef=0.01"]))
    msg = str(e.value)
    assert "\n" not in msg
    assert "'actor_rollout_ref.actor.entropy_coef=0.01'" in msg and VERL_VERSION in msg


@needs_verl
def test_good_user_override_and_new_key_with_plus_pass():
    args = VerlTrainer().validate_args(base_args(overrides=["actor_rollout_ref.actor.entropy_coeff=0.001",
                                                            "+trainer.hpcrl_note=x"]))
    _, ctx = ctx_for(args)
    assert compose(VerlTrainer().overrides(ctx)).actor_rollout_ref.actor.entropy_coeff == 0.001


@needs_verl
@pytest.mark.parametrize("hostile", ["/p/with space/m", "/p/a,b/m", "/p/it's/m", "/p/[x]/m", "/p/a=b/m", "/p/back\\slash"])
def test_hostile_paths_reach_verl_unchanged(hostile):
    _, ctx = ctx_for(base_args(model=hostile, train_files=hostile + ".parquet"))
    cfg = compose(VerlTrainer().overrides(ctx))
    assert cfg.actor_rollout_ref.model.path == hostile
    assert cfg.data.train_files == hostile + ".parquet"


# ------------------------------------------------------------------ adapter behaviour without verl


def test_user_may_not_override_hpcrl_owned_keys():
    with pytest.raises(SpecError, match="trainer.default_local_dir.*set by hpcrl"):
        VerlTrainer().validate_args(base_args(overrides=["trainer.default_local_dir=/elsewhere"]))
    with pytest.raises(SpecError, match="trainer.rollout_data_dir.*set by hpcrl"):  # `hpcrl samples` reads it
        VerlTrainer().validate_args(base_args(overrides=["trainer.rollout_data_dir=/elsewhere"]))


@pytest.mark.parametrize("bad, field", [({"algorithm": "dpo"}, "args.algorithm"), ({"save_freq": 0}, "args.save_freq"),
                                        ({"ppo_mini_batch_size": 512}, "args.ppo_mini_batch_size"),
                                        ({"overrides": "x=1"}, "args.overrides"), ({"reward": "module.fn"}, "args.reward")])
def test_bad_args_name_the_field(bad, field):
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        VerlTrainer().validate_args(base_args(**bad))


def test_requirements_pin_verl_and_its_torch():
    reqs = VerlTrainer().requirements(VerlTrainer().validate_args(base_args()), {})
    assert reqs[0] == "verl[vllm]==0.9.1" and "torch==2.11.0" in reqs and "vllm==0.24.0" in reqs


def test_files_ship_the_reward_and_the_launcher_runs_from_lib(tmp_path):
    _, ctx = ctx_for(base_args(), run_dir=tmp_path)
    files = VerlTrainer().files(ctx)
    # the code reward imports the sandbox, and the sandbox its harness's parts and cpus, each from beside itself
    assert set(files) == {"verl/rewards.py", "verl/sandbox.py", "verl/extract.py", "verl/cpus.py",
                          "verl/cgroups.py", "verl/sandbox_harness.py", "verl/sandbox_program.py",
                          "verl/sandbox_tester.py", "verl/sandbox_server.py", "verl/sandbox_seccomp.py"}
    assert "def compute_score(" in files["verl/rewards.py"]


def test_single_node_starts_no_ray_cluster_and_gives_ray_the_cpus():
    trainer, ctx = ctx_for(base_args())
    script = trainer.bootstrap(ctx)
    assert "srun" not in script and "start --head" not in script  # verl's ray.init() starts Ray
    assert "export RAY_AUTH_MODE=token" in script  # but with a token of its own (ray_env)
    assert "ray_kwargs.ray_init.num_cpus=128" in trainer.command(ctx)


def run_auth(tmp_path, env_extra: dict, show=("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")) -> dict:
    """Runs ray_env's bash in a real shell with a clean home; the environment it leaves."""
    script = tmp_path / "auth.sh"
    script.write_text(ray_env(sys.executable) + "".join('echo "%s=${%s:-}"\n' % (k, k) for k in show))
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), **env_extra}
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True).stdout
    assert not any(home.iterdir()), "nothing written to the home"
    return dict(line.split("=", 1) for line in out.splitlines())


def test_ray_env_gives_each_segment_a_fresh_token_in_the_environment_only(tmp_path):
    # Ray >= 2.5x: a ~/.ray/auth_token left by any local ray.init() turns token auth on for a head
    # but not for a joining worker (InvalidAuthToken); an explicit mode and token fixes both
    first, second = run_auth(tmp_path, {}), run_auth(tmp_path, {})
    assert first["RAY_AUTH_MODE"] == "token" and re.fullmatch(r"[0-9a-f]{64}", first["RAY_AUTH_TOKEN"])
    assert first["RAY_AUTH_TOKEN"] != second["RAY_AUTH_TOKEN"]
    assert first["RAY_AUTH_TOKEN"] not in ray_env(sys.executable)  # made when the job runs, not rendered
    # a mode the user chose (spec or site env) is theirs
    assert run_auth(tmp_path, {"RAY_AUTH_MODE": "disabled"}) == {"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": ""}


def test_ray_env_leaves_one_gpu_list_where_slurm_sets_two(tmp_path):
    # Slurm's gres (no Flags=nvidia_gpu_env) sets both; verl's workers refuse both
    both = {"CUDA_VISIBLE_DEVICES": "0,1", "ROCR_VISIBLE_DEVICES": "0,1"}
    show = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
    assert run_auth(tmp_path, both, show) == {"CUDA_VISIBLE_DEVICES": "0,1", "ROCR_VISIBLE_DEVICES": ""}
    assert run_auth(tmp_path, {"ROCR_VISIBLE_DEVICES": "2"}, show) == {"CUDA_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": "2"}
    # inside each srun step too (Slurm sets them again there): the ray command line applies it
    ray_line = next(ln for ln in ray_bootstrap("python3", 2, 4, 6379).splitlines() if "start --head" in ln)
    assert "unset ROCR_VISIBLE_DEVICES" in ray_line


def test_multi_node_bootstrap_is_valid_bash_and_quotes_python(tmp_path):
    trainer, ctx = ctx_for(base_args(), nodes=2)
    ctx.python = "/sw/my venv/bin/python'; rm -rf ~"
    script = trainer.bootstrap(ctx)
    assert "trainer.nnodes=2" in trainer.command(ctx)
    assert not any(o.startswith("ray_kwargs.ray_init.num_cpus") for o in trainer.command(ctx))
    assert shlex.quote(ctx.python) in script and "ray start" not in script.replace("start --", "")  # via python -c
    (tmp_path / "b.sh").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "b.sh")]).returncode == 0


def test_bootstrap_starts_ray_through_srun_and_waits_for_all_nodes():
    script = ray_bootstrap("python3", nodes=3, gpus_per_node=4, port=6379)
    assert script.count("srun --nodes=1 --ntasks=1 --cpus-per-task=") == 3  # ip, head, each worker
    assert script.count('--cpus-per-task="$hpcrl_ray_cpus" --overlap -w') == 2  # the Ray daemons: the step's CPUs
    assert "start --head" in script and 'start --address "$RAY_ADDRESS"' in script
    assert "export RAY_ADDRESS=" in script
    # the workers start once Ray itself reports the head alive, and the driver once all 3 nodes
    # are: asked of Ray's API (bounded), never a fixed sleep
    head, worker = script.index("start --head"), script.index('start --address "$RAY_ADDRESS"')
    assert head < script.index("hpcrl_ray_join 1 300") < worker < script.index("hpcrl_ray_join 3 300")
    assert "ray.nodes()" in script and not re.search(r"^\s*sleep \d\d", script, re.M)


def test_checkpoint_step_needs_tracker_and_directory(tmp_path):
    assert verl_checkpoint_step(tmp_path) is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("40")
    assert verl_checkpoint_step(tmp_path) is None  # tracker names a step that is not there
    (tmp_path / "global_step_40" / "actor").mkdir(parents=True)
    assert VerlTrainer().checkpoint_step(tmp_path.parent, tmp_path) == 40
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")  # torn write
    assert verl_checkpoint_step(tmp_path) is None


# ------------------------------------------------------------------ the job-side launcher


def opts(**kw):
    argv = ["--python", "py", "--ckpt-dir", "/c", "--save-freq", str(kw.pop("save_freq", 100))]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return verl_launch.parse_args(argv)


def test_first_segment_keeps_validation_and_no_esi_without_deadline(tmp_path):
    out = verl_launch.runtime_overrides(opts(), {"HPCRL_SEGMENT": "1"}, tmp_path, [])
    assert not any("val_before_train" in o for o in out)
    assert not any("MLP_CURRENT" in o for o in out)


def test_periodic_mode_sizes_save_freq_from_measured_steps(tmp_path):
    o = opts(save_mode="periodic", save_every_s=1800)
    assert "trainer.save_freq=100" in verl_launch.runtime_overrides(o, {}, tmp_path, [])
    assert "trainer.save_freq=15" in verl_launch.runtime_overrides(o, {}, tmp_path, [100.0, 120.0])
    out = verl_launch.runtime_overrides(o, {"HPCRL_DEADLINE": "99"}, tmp_path, [120.0])
    assert not any("MLP_CURRENT" in o for o in out)  # v1 trainer: ESI does not exist there


def test_stop_rule_after_a_save():
    o = opts(save_time_s=300)
    assert not verl_launch.should_stop(o, 10_000, [])  # nothing measured yet
    assert verl_launch.should_stop(o, 400, [100.0])  # 100 + 300 + 60 > 400: the next save would not fit
    assert not verl_launch.should_stop(o, 500, [100.0])
    assert verl_launch.should_stop(opts(save_mode="periodic", save_freq=10), 1300, [100.0])


def test_metrics_of_earlier_segments_give_step_times(tmp_path):
    d = tmp_path / "verl-metrics"
    d.mkdir()
    (d / "segment-001.jsonl").write_bytes((DATA / "file_logger_segment.jsonl").read_bytes())
    times = verl_launch.past_step_times(tmp_path, segment=2)
    assert times == [58.25]  # the segment's first step is verl's warm-up: not what the next one takes
    records, _ = verl_launch.read_verl_metrics(d / "segment-001.jsonl")
    assert verl_launch.hpcrl_record(records[-1]) == {"step": 2, "trainer": "verl", "reward": 0.125, "step_s": 58.25,
                                                    "step_time_s": 58.25, "pg_loss": -0.01, "response_len": 402.5}
    # with its segment and time, as the built-in trainer's records: `status` computes goodput from them
    assert verl_launch.hpcrl_record(records[-1], 3, 1000.0)["segment"] == 3
    assert verl_launch.hpcrl_record(records[-1], 3, 1000.0)["time"] == 1000.0


def test_prune_keeps_newest_complete_and_drops_torn(tmp_path):
    for s in (10, 20, 30, 40):
        (tmp_path / f"global_step_{s}").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("30")
    gone = verl_launch.prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in gone) == ["global_step_10", "global_step_40"]
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_20", "global_step_30"]


def test_an_end_without_its_last_steps_saved_is_a_failure_with_its_reason():
    assert verl_launch.unsaved_reason(16, 16) is None and verl_launch.unsaved_reason(None, None) is None
    reason = verl_launch.unsaved_reason(16, 15)
    assert reason.startswith("verl ended at step 16 but its newest checkpoint is step 15: the last 1 steps are not saved")


def fake_verl(tmp_path, body):
    """A stand-in `python` whose `-m verl.trainer.main_ppo` runs `body` (bash)."""
    exe = tmp_path / "fakepy"
    exe.write_text("#!/bin/bash\n" + body)
    exe.chmod(0o755)
    return exe


def run_launcher(tmp_path, exe, deadline_in_s, metrics_wait_s=30, segment=1):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    env = {**os.environ, **protocol_env(tmp_path, segment=segment, deadline=time.time() + deadline_in_s),
           "HPCRL_METRICS": str(tmp_path / "m.jsonl")}
    code = ("import sys; from hpcrl.job import verl as v; S = v.VerlSupervisor; S.poll_s = 0.2; S.stop_grace_s = 5; "
            "S.metrics_wait_s = %r; sys.exit(v.main(sys.argv[1:]))") % (metrics_wait_s,)
    argv = [sys.executable, "-c", code, "--python", str(exe), "--ckpt-dir", str(ckpt), "--save-freq", "1",
            "--save-time-s", "1", "--", "data.train_files=/x"]
    return subprocess.run(argv, env=env, timeout=60, capture_output=True, text=True)


def test_launcher_passes_through_completion(tmp_path):
    assert run_launcher(tmp_path, fake_verl(tmp_path, "exit 0\n"), 3600).returncode == 0
    assert run_launcher(tmp_path, fake_verl(tmp_path, "exit 3\n"), 3600).returncode == 3


def test_launcher_stops_verl_after_last_save_and_exits_continue(tmp_path):
    # "verl" logs a 30 s step and saves step 1; only 35 s are left, so another step + save + the
    # stop margin (30 + 1 + 10 s) cannot fit
    body = f"""M="$VERL_FILE_LOGGER_PATH"; C={shlex.quote(str(tmp_path / 'ckpt'))}
echo '{{"step": 1, "data": {{"timing_s/step": 30.0, "critic/score/mean": 0.5}}}}' >> "$M"
mkdir -p "$C/global_step_1"; echo 1 > "$C/latest_checkpointed_iteration.txt"
sleep 50
"""
    result = run_launcher(tmp_path, fake_verl(tmp_path, body), 35)
    assert result.returncode == protocol.EXIT_CONTINUE, result.stderr
    assert "stopping verl for continuation" in result.stderr
    assert json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])["reward"] == 0.5


def test_launcher_waits_for_the_saved_steps_metrics_before_it_stops_verl(tmp_path):
    # verl saves a step, then logs its metrics (ray_trainer.fit): a stop sent when the tracker moves
    # lost that step's record at the segment boundary (the Slurm verl tier saw 53 saved, 52 logged)
    body = f"""M="$VERL_FILE_LOGGER_PATH"; C={shlex.quote(str(tmp_path / 'ckpt'))}
echo '{{"step": 1, "data": {{"timing_s/step": 30.0, "critic/score/mean": 0.25}}}}' >> "$M"
mkdir -p "$C/global_step_2"; echo 2 > "$C/latest_checkpointed_iteration.txt"
sleep 1.5
echo '{{"step": 2, "data": {{"timing_s/step": 30.0, "critic/score/mean": 0.5}}}}' >> "$M"
sleep 50
"""
    result = run_launcher(tmp_path, fake_verl(tmp_path, body), 35)
    assert result.returncode == protocol.EXIT_CONTINUE, result.stderr
    assert "verl saved step 2; the next save would not fit" in result.stderr
    assert [json.loads(x)["step"] for x in (tmp_path / "m.jsonl").read_text().splitlines()] == [1, 2]


def test_launcher_stops_verl_anyway_when_the_saved_steps_metrics_never_come(tmp_path):
    body = f"""C={shlex.quote(str(tmp_path / 'ckpt'))}
echo '{{"step": 1, "data": {{"timing_s/step": 30.0}}}}' >> "$VERL_FILE_LOGGER_PATH"
mkdir -p "$C/global_step_2"; echo 2 > "$C/latest_checkpointed_iteration.txt"
sleep 50
"""
    t0 = time.monotonic()
    result = run_launcher(tmp_path, fake_verl(tmp_path, body), 35, metrics_wait_s=1)
    assert result.returncode == protocol.EXIT_CONTINUE, result.stderr
    assert "(its metrics for step 2 did not come)" in result.stderr
    assert time.monotonic() - t0 < 30


# ------------------------------------------------------------------ the Countdown reward, called as verl calls it


def _verl_import_utils():
    """verl/utils/import_utils.py is stdlib-only, but `import verl` pulls in ray and torch: load the file."""
    path = verl_config_dir().parents[1] / "utils" / "import_utils.py"
    spec = importlib.util.spec_from_file_location("verl_import_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_verl
def test_countdown_reward_through_verls_loader_and_call(tmp_path):
    np = pytest.importorskip("numpy")
    _, ctx = ctx_for(base_args(), run_dir=tmp_path)
    for rel, text in VerlTrainer().files(ctx).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    cfg = compose(VerlTrainer().overrides(ctx))
    fn_cfg = cfg.reward.custom_reward_function
    # verl/trainer/ppo/reward.py get_custom_reward_fn -> import_utils.load_extern_object(module_path, object_name)
    score = _verl_import_utils().load_extern_object(module_path=fn_cfg.path, object_name=fn_cfg.name)
    # verl/experimental/reward_loop/reward_manager/naive.py run_single: keyword call with the decoded
    # response only (skip_special_tokens=True) and extra_info grown by num_turns/rollout_reward_scores
    ground_truth = {"target": 24, "numbers": np.array([3, 4, 2])}  # parquet lists come back as arrays
    extra = {"split": "test", "index": 0, "num_turns": 2, "rollout_reward_scores": {}}

    def call(response):
        return score(data_source="countdown", solution_str=response, ground_truth=ground_truth, extra_info=extra)

    assert call("<think>3*4=12, 12*2=24</think> <answer>(3 * 4) * 2</answer>") == 1.0
    assert call("<answer>3 * 4 + 2</answer>") == 0.1  # well-formed, wrong value
    assert call("<answer>__import__('os').system('true')</answer>") == 0.1  # never evaluated
    assert call("no answer tag at all") == 0.0
    gsm = score(data_source="openai/gsm8k", solution_str="so 6 + 7 = 13\n#### 13", ground_truth="13", extra_info=extra)
    assert gsm == 1.0


# ------------------------------------------------------------------ the segment boundary (issue 23)


def test_tracker_past_the_last_record_goes_back_to_the_recorded_checkpoint(tmp_path):
    for s in (121, 122):
        (tmp_path / f"global_step_{s}").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("122")
    assert verl_launch.align_tracker(tmp_path, 121) == 121
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "121"
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_121"]
    assert verl_launch.align_tracker(tmp_path, 121) is None  # nothing left to do
    assert verl_launch.align_tracker(tmp_path, 125) is None  # records past the tracker (a hard kill): verl retrains


def test_tracker_stays_when_the_recorded_step_has_no_checkpoint(tmp_path):
    (tmp_path / "global_step_20").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")
    assert verl_launch.align_tracker(tmp_path, 19) is None  # step 19 was never saved: keep 20's training
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "20"
    assert (tmp_path / "global_step_20").is_dir()


def test_launcher_waits_for_verls_actors_and_resumes_from_the_last_recorded_step(tmp_path):
    # verl's TaskRunner actor is no child of the driver's process group (a Ray worker): stopped,
    # the driver exits at once while the actor trains on, saves step 3 (inside the deadline window
    # verl saves every step) and dies before it logs it. The launcher must wait for it and leave
    # the tracker at step 2, the last step with a record, not 3 (segment 2 would begin at 4).
    c = shlex.quote(str(tmp_path / "ckpt"))
    actor = f"""M="$VERL_FILE_LOGGER_PATH"; C={c}
mkdir -p "$C/global_step_1"; echo 1 > "$C/latest_checkpointed_iteration.txt"
echo '{{"step": 1, "data": {{"timing_s/step": 30.0}}}}' >> "$M"
sleep 3
mkdir -p "$C/global_step_2"; echo 2 > "$C/latest_checkpointed_iteration.txt"
echo '{{"step": 2, "data": {{"timing_s/step": 30.0}}}}' >> "$M"
mkdir -p "$C/global_step_3"; echo 3 > "$C/latest_checkpointed_iteration.txt"
"""
    (tmp_path / "actor.sh").write_text(actor)
    body = f"setsid bash {shlex.quote(str(tmp_path / 'actor.sh'))} &\nsleep 50\n"
    result = run_launcher(tmp_path, fake_verl(tmp_path, body), 35)
    assert result.returncode == protocol.EXIT_CONTINUE, result.stderr
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2", result.stderr
    assert not (ckpt / "global_step_3").exists() and (ckpt / "global_step_2").is_dir()
    assert "verl saved step 3 but its record was lost" in result.stderr
    # the actor's record written after the driver exited still reaches the run's metrics
    assert [json.loads(x)["step"] for x in (tmp_path / "m.jsonl").read_text().splitlines()] == [1, 2]
    # ... with what `status` needs for verl's goodput (segment and time, as the built-in trainer's)
    from hpcrl.status import metrics as run_metrics

    timing = run_metrics.segment_timings(run_metrics.read_records(tmp_path / "m.jsonl"))[1]
    assert (timing.first_step, timing.last_step, timing.steps) == (1, 2, 2) and timing.train_s > 0


def test_a_term_before_verl_starts_is_not_lost(tmp_path):
    marker = tmp_path / "verl-started"
    sup = verl_launch.VerlSupervisor(opts(), dict(os.environ), tmp_path)
    sup.argv = ["touch", str(marker)]
    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    try:
        sup._on_signal(signal.SIGTERM, None)  # the batch shell's TERM, before verl exists
        assert sup.run() == 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGUSR1, old[1])
    assert not marker.exists()  # verl was never started, so nothing runs on unwatched


def test_a_signal_at_once_after_verl_starts_is_handled(tmp_path):
    # "verl" signals the launcher first thing: USR1 must not kill it (its default action) and the
    # TERM must reach verl, whose exit code the launcher returns
    body = 'trap "exit 7" TERM\nkill -USR1 $PPID; kill -TERM $PPID\nfor i in $(seq 100); do sleep 0.2; done\nexit 3\n'
    result = run_launcher(tmp_path, fake_verl(tmp_path, body), 3600)
    assert result.returncode == 7, result.stderr


@needs_verl
@pytest.mark.parametrize("route", ["compute_score", "compute_score_batch"])
def test_code_reward_through_verls_loader_scores_a_code_row(tmp_path, route):
    """The shipped RUN/verl/rewards.py imports the sandbox from beside itself: verl loads it by
    path (a module without a package), where `from . import sandbox` failed (issue 23), and the
    batch route's `from .cpus import workers_per_rank` (issue 28)."""
    from hpcrl.rl.data import code_row

    _, ctx = ctx_for(base_args(), run_dir=tmp_path)
    for rel, text in VerlTrainer().files(ctx).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    fn_cfg = compose(VerlTrainer().overrides(ctx)).reward.custom_reward_function
    assert fn_cfg.name == "compute_score"
    score = _verl_import_utils().load_extern_object(module_path=fn_cfg.path, object_name=route)
    row = code_row("add", ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"], "test", 0)

    def call(response):
        if route == "compute_score_batch":  # verl's batch reward manager: lists, keyword names
            return score(data_sources=[row["data_source"]], solution_strs=[response],
                         ground_truths=[row["reward_model"]["ground_truth"]], extra_infos=[row["extra_info"]])[0]
        return score(data_source=row["data_source"], solution_str=response,
                     ground_truth=row["reward_model"]["ground_truth"], extra_info=row["extra_info"])

    def scored(response):
        # a timeout here is the sample's 5 s wall-clock backstop on a loaded machine, not the route
        # (beside the full suite a correct `add` scored `timeout` once, CI of 2026-12-07: the first
        # call also starts the sandbox's fork server): asked once more
        out = call(response)
        return call(response) if out.get("reason") == "timeout" else out

    good = scored("```python\ndef add(a, b):\n    return a + b\n```")
    assert good["score"] == 1.0 and good["all_passed"] == 1.0, good
    half = scored("```python\ndef add(a, b):\n    return 5\n```")
    assert half["score"] == 0.5 and half["pass_rate"] == 0.5, half


def test_next_segment_starts_from_the_last_recorded_step_when_the_previous_one_could_not_align(tmp_path):
    # segment 1 was killed (TERM) after verl saved step 3 and before it logged it: segment 2's
    # launcher points the tracker at step 2 before verl reads it
    ckpt = tmp_path / "ckpt"
    for step in (2, 3):
        (ckpt / f"global_step_{step}").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    (tmp_path / "verl-metrics").mkdir()
    (tmp_path / "verl-metrics" / "segment-001.jsonl").write_text(
        "".join(json.dumps({"step": s, "data": {"timing_s/step": 1.0}}) + "\n" for s in (1, 2)))
    seen = tmp_path / "tracker-verl-saw"
    body = f"cat {shlex.quote(str(ckpt / 'latest_checkpointed_iteration.txt'))} > {shlex.quote(str(seen))}\nexit 0\n"
    run_launcher(tmp_path, fake_verl(tmp_path, body), 3600, segment=2)
    assert seen.read_text().strip() == "2" and not (ckpt / "global_step_3").exists()
