"""verl adapter (TinyZero's stack): Hydra overrides for `verl.trainer.main_ppo`, Ray on Slurm, resume.

What runs in the job (hpcrl/job/verl.py, from the run's lib/ snapshot of hpcrl):

    PY -m hpcrl.job.verl --python PY --ckpt-dir CKPT ... -- <static Hydra overrides>

The static overrides are everything known at submit time and are what `hpcrl render` shows.
The launcher adds the per-segment ones (val_before_train, logger, save_freq, the deadline) and
supervises verl. Every override below was checked against verl VERL_VERSION's own `ppo_trainer`
config (tests/test_verl.py composes it); a user's `args.overrides` are composed the same way at
validation time when hydra and verl are importable, so a misspelt key fails `hpcrl submit`, not
the job.

Pre-walltime saving (verl handles no signal):
  save_mode: deadline (default) -- verl's legacy trainer (trainer.use_v1=False) saves when
      MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP - now <= 60 s + slowest step +
      trainer.esi_redundant_time (verl/utils/checkpoint/checkpoint_manager.py
      should_save_ckpt_esi, called in verl/trainer/ppo/ray_trainer.py fit()); the launcher feeds
      it HPCRL_DEADLINE and sets esi_redundant_time to args.save_time_s.
  save_mode: periodic -- the default v1 trainer, which has no time-based save: save_freq only,
      re-sized each segment from the measured step time (args.save_every_s).
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import SpecError
from ..schemas import Choice, Float, Int, Schema, Str, StrList, fail
from ..shell import q
from .base import Trainer, TrainerContext, check_override_keys
from ..job.verl_rollouts import ROLLOUTS_DIR

VERL_VERSION = "0.9.1"
HYDRA_PINS = ("hydra-core==1.3.2", "omegaconf==2.3.0", "antlr4-python3-runtime==4.9.3")
# verl[vllm]==0.9.1's own pins, repeated so pip cannot settle on another torch (read from its metadata)
_ROLLOUT_PINS = {
    "vllm": ["torch==2.11.0", "torchvision==0.26.0", "torchaudio==2.11.0", "vllm==0.24.0", "transformers==5.9.0"],
    "sglang": ["torch==2.11.0", "torchvision==0.26.0", "torchaudio==2.11.0", "sglang==0.5.12", "transformers==5.9.0"],
}
# The actor's (and PPO critic's) attention. verl 0.9.1 defaults to flash_attention_2, and verl[vllm]
# installs no flash-attn: PyPI has only its source, which compiles for hours against the venv's
# torch and CUDA. sdpa needs nothing beyond torch; it runs unpadded batches only through
# flash-attn's varlen kernels, so remove-padding is off with it (padded batches: more compute).
ATTENTION = {
    "sdpa": {"+{role}.model.override_config.attn_implementation": "sdpa", "{role}.model.use_remove_padding": False},
    "flash_attention_2": {},
}
TRACKER = "latest_checkpointed_iteration.txt"
LAUNCH_MODULE = "hpcrl.job.verl"  # the job-side launcher, run from the run's lib/
REWARD_FILE = "verl/rewards.py"  # hpcrl/rewards/score.py, under the name runs made before issue 40 carry
SANDBOX_FILE = "verl/sandbox.py"  # rewards.py's code reward imports it from beside itself (verl loads by path)
SANDBOX_SIBLINGS = ("extract", "cpus", "cgroups", "sandbox_harness", "sandbox_program", "sandbox_tester",
                    "sandbox_server", "sandbox_seccomp")  # sandbox.py reads these from beside itself

# algorithm -> overrides that define it (GSPO as in verl's examples/gspo_trainer; PPO as TinyZero)
ALGORITHMS = {
    "ppo": {"algorithm.adv_estimator": "gae"},
    "grpo": {
        "algorithm.adv_estimator": "grpo",
        "actor_rollout_ref.actor.use_kl_loss": "True",
        "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    },
    "gspo": {
        "algorithm.adv_estimator": "grpo",
        "actor_rollout_ref.actor.policy_loss.loss_mode": "gspo",
        "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean",
        "actor_rollout_ref.actor.clip_ratio_low": "0.0003",
        "actor_rollout_ref.actor.clip_ratio_high": "0.0004",
        "actor_rollout_ref.actor.clip_ratio_c": "10.0",
        "actor_rollout_ref.actor.use_kl_loss": "False",
        "algorithm.use_kl_in_reward": "False",
    },
}
# Keys hpcrl owns: a user override of these would break resume, placement or the walltime logic.
OWNED_KEYS = (
    "trainer.default_local_dir", "trainer.resume_mode", "trainer.resume_from_path", "trainer.nnodes",
    "trainer.n_gpus_per_node", "trainer.val_before_train", "trainer.logger", "trainer.use_v1",
    "trainer.save_freq", "trainer.esi_redundant_time", "ray_kwargs.ray_init.num_cpus",
    "trainer.rollout_data_dir",  # `hpcrl samples` reads verl's dumps there (hpcrl/job/verl_rollouts.py)
)
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9_./~:+@-]+$")
_OVERRIDE = re.compile(r"^(\+\+|\+|~)?([A-Za-z_][\w.@-]*)=(.*)$", re.S)


def hydra_value(value) -> str:
    """A value Hydra reads back as exactly this string: quoted unless plainly safe."""
    text = str(value)
    if _SAFE_VALUE.match(text):
        return text
    # Hydra's quoted strings: a backslash is literal unless it precedes a quote or ends the string
    escaped = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, text)
    return "'" + escaped.replace("'", "\\'") + "'"


def _kv(key, value) -> str:
    return f"{key}={hydra_value(value) if isinstance(value, (str, Path)) else _scalar(value)}"


def _scalar(value) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    return "null" if value is None else str(value)


def _check_mini_batch(a: dict, where) -> None:
    if a["ppo_mini_batch_size"] > a["train_batch_size"]:
        fail(where("ppo_mini_batch_size"), a["ppo_mini_batch_size"], f"exceeds train_batch_size = {a['train_batch_size']}",
             "lower it or raise train_batch_size (verl needs train_batch_size >= ppo_mini_batch_size)")


_PATH = dict(nullable=True, nonempty=True)
SCHEMA = Schema("verl", [
    Choice("algorithm", "grpo", ALGORITHMS, "ppo (GAE + critic, TinyZero) | grpo | gspo"),
    Str("model", None, "HF model directory (staged on a login node) or hub id", required=True, **_PATH),
    Str("train_files", None, "parquet (hpcrl's Countdown/GSM8K prep or verl's)", required=True, **_PATH),
    Str("val_files", None, "parquet of the validation split", required=True, **_PATH),
    Str("reward", "hpcrl", "hpcrl (hpcrl/rewards/score.py) | verl (its built-ins) | /path/file.py:fn", nonempty=True),
    Int("train_batch_size", 256, "prompts per step (data.train_batch_size)", ge=1),
    Int("val_batch_size", None, "null: the whole validation set in one batch (verl's default)", ge=1, nullable=True),
    Int("max_prompt_length", 256, "prompt tokens", ge=1),
    Int("max_response_length", 1024, "response tokens", ge=1),
    Int("rollout_n", None, "responses per prompt; null: 1 for ppo, 5 for grpo, 16 for gspo", ge=1, nullable=True),
    Choice("rollout", "vllm", _ROLLOUT_PINS, "vllm | sglang"),
    Choice("attention", "sdpa", ATTENTION, "sdpa (PyTorch's own) | flash_attention_2 (verl's default: needs flash-attn "
                                           "in the spec's requirements)"),
    Int("rollout_tp", 1, "tensor parallel size of the rollout engine", ge=1),
    Float("gpu_memory_utilization", 0.4, "share of each GPU the rollout engine may take", gt=0, le=1),
    Float("actor_lr", 1e-6, "actor learning rate", gt=0),
    Float("critic_lr", 1e-5, "critic learning rate (ppo)", gt=0),
    Float("kl_coef", 0.001, "ppo: in-reward KL; grpo: kl_loss_coef", ge=0),
    Int("ppo_mini_batch_size", 64, "prompts per actor update (<= train_batch_size)", ge=1),
    Int("micro_batch_size_per_gpu", 8, "actor and critic update micro batch", ge=1),
    Int("log_prob_micro_batch_size_per_gpu", 8, "rollout log-prob micro batch", ge=1),
    Int("ref_log_prob_micro_batch_size_per_gpu", 4, "reference log-prob micro batch", ge=1),
    Int("total_epochs", 15, "passes over the training data", ge=1),
    Int("total_training_steps", None, "null: total_epochs decides", ge=1, nullable=True),
    Int("test_freq", 100, "steps between validations; -1: never", ge=-1),
    Str("project_name", "hpcrl", "tracker project", nonempty=True),
    Str("experiment_name", None, "null: the run id", **_PATH),
    Choice("logger", "auto", ("auto", "console", "wandb"), "auto (wandb when WANDB_API_KEY is set) | console | wandb"),
    Choice("save_mode", "deadline", ("deadline", "periodic"),
           "deadline (legacy trainer + ESI save) | periodic (v1 trainer)"),
    Int("save_freq", 100, "regular save interval in steps (first segment in periodic mode)", ge=1),
    Float("save_every_s", 1800, "periodic mode: target seconds between saves, from measured steps", gt=0),
    Float("save_time_s", 300, "what one save may take; start the deadline save this much earlier", ge=0),
    Int("max_ckpt_to_keep", 2, "checkpoints kept; 0: all", ge=0),
    Choice("ray_cluster", "auto", ("auto", "always", "never"), "auto (nodes > 1) | always | never: start Ray via srun first"),
    Int("ray_port", 6379, "port of the Ray head", ge=1, le=65535),
    StrList("overrides", [], "extra Hydra overrides, e.g. ['actor_rollout_ref.actor.entropy_coeff=0.001']"),
], checks=[_check_mini_batch])


class VerlTrainer(Trainer):
    name = "verl"
    uses_gpus = True  # on a GPU site each segment first checks its torch sees them (hpcrl/rl/gpucheck.py)
    obeys_protocol = True  # through hpcrl.job.verl: exit 0 complete, 85 continue
    schema = SCHEMA
    package, package_version = "verl", VERL_VERSION
    ranks_hint = "Ray workers on resources.gpus_per_node GPUs of each of resources.nodes nodes"

    # ------------------------------------------------------------ validation

    def validate_args(self, args: dict) -> dict:
        merged = super().validate_args(args)
        merged["overrides"] = check_user_overrides(merged["overrides"])
        compose_check(self.overrides(_placeholder_ctx(merged)), suspects=merged["overrides"])
        return merged

    def check_python(self, args: dict, python: str, env: dict) -> None:
        """The reward file imports, the parquet files have the prompt column, and the data holds
        the steps asked: verl's loop runs total_epochs x (rows // train_batch_size) batches
        (its dataloader drops the last partial batch) and ends, unsaved, when they run out."""
        from . import probe

        a = {**self.defaults, **args}
        probe.check_model_dir("args.model", a["model"], env)
        files = [] if a["reward"] in ("hpcrl", "verl") else [reward_target(a["reward"], Path("/"))]
        tables = []
        for key in ("train_files", "val_files"):
            path = probe.expand(a[key], env)
            if path is not None and not path.is_file():
                raise SpecError(f"args.{key}: {path} does not exist; give the absolute path of a parquet file")
            if path is not None:
                tables.append((f"args.{key}", path))
        # the reward as verl's reward manager calls it: every argument by keyword (#41 item 6)
        row_from = str(tables[0][1]) if tables and tables[0][0] == "args.train_files" else None
        facts = probe.probe(python, env, files, [str(p) for _, p in tables], row_from=row_from, keywords=True)
        if facts is None:
            return
        for i, (path, func) in enumerate(files):
            probe.reward_error(facts, i, "args.reward", path, func, python, row_from)
        prompt_key = _override_value(a["overrides"], "data.prompt_key") or "prompt"
        rows = {key: probe.table(facts, i, key, path, (prompt_key,)) for i, (key, path) in enumerate(tables)}
        if rows.get("args.train_files") is not None:
            check_steps(a, rows["args.train_files"])

    # ------------------------------------------------------------ the command line

    def requirements(self, args: dict, site: dict) -> list[str]:
        return [f"verl[{args.get('rollout', 'vllm')}]=={VERL_VERSION}", *_ROLLOUT_PINS[args.get("rollout", "vllm")]]

    def runtime_packages(self, args: dict) -> list[str]:
        # verl 0.9.1's model config defaults to attn_implementation=flash_attention_2
        attention = args.get("attention", "sdpa")
        return ["verl", "torch", "ray", args.get("rollout", "vllm")] + (["flash-attn"] if attention == "flash_attention_2" else [])

    def files(self, ctx: TrainerContext) -> dict[str, str]:
        here = Path(__file__).resolve().parent
        out = {}
        if ctx.args["reward"] == "hpcrl":
            out[REWARD_FILE] = (here.parent / "rewards" / "score.py").read_text(encoding="utf-8")
            out[SANDBOX_FILE] = (here.parent / "rewards" / "sandbox.py").read_text(encoding="utf-8")
            for name in SANDBOX_SIBLINGS:
                out[f"verl/{name}.py"] = (here.parent / "rewards" / f"{name}.py").read_text(encoding="utf-8")
        return out

    def overrides(self, ctx: TrainerContext) -> list[str]:
        """The static Hydra overrides (the launcher appends the per-segment ones)."""
        a = ctx.args
        pairs = {**self._data(a), **self._model(ctx), **self._algorithm(ctx), **self._trainer(ctx)}
        # a key the user overrides too is theirs (Hydra refuses `+key` twice)
        theirs = {_OVERRIDE.match(o).group(2) for o in a["overrides"] if _OVERRIDE.match(o)}
        return [_kv(k, v) for k, v in pairs.items() if k.lstrip("+") not in theirs] + list(a["overrides"])

    def command(self, ctx: TrainerContext) -> list[str]:
        a = ctx.args
        launch = [ctx.python, "-m", LAUNCH_MODULE, "--python", ctx.python,
                  "--ckpt-dir", str(ctx.ckpt_dir), "--save-mode", a["save_mode"],
                  "--save-freq", str(a["save_freq"]), "--save-every-s", str(a["save_every_s"]),
                  "--save-time-s", str(a["save_time_s"]), "--logger", a["logger"],
                  "--keep", str(a["max_ckpt_to_keep"])]
        return [*launch, "--", *self.overrides(ctx)]

    def env(self, ctx: TrainerContext) -> dict[str, str]:
        # vLLM's workers must not try to reach the hub for a staged model; HF_HUB_OFFLINE is the
        # user's call (spec env), so only make the log line-buffered for `hpcrl logs -f`.
        return {"PYTHONUNBUFFERED": "1"}

    def _data(self, a) -> dict:
        out = {
            "data.train_files": a["train_files"], "data.val_files": a["val_files"],
            "data.train_batch_size": a["train_batch_size"], "data.max_prompt_length": a["max_prompt_length"],
            "data.max_response_length": a["max_response_length"],
        }
        if a["val_batch_size"] is not None:
            out["data.val_batch_size"] = a["val_batch_size"]
        return out

    def _model(self, ctx) -> dict:
        a, gpus = ctx.args, _gpus_per_node(ctx)
        arr = "actor_rollout_ref"
        out = {
            f"{arr}.model.path": a["model"], f"{arr}.actor.optim.lr": a["actor_lr"],
            f"{arr}.actor.ppo_mini_batch_size": a["ppo_mini_batch_size"],
            f"{arr}.actor.ppo_micro_batch_size_per_gpu": a["micro_batch_size_per_gpu"],
            f"{arr}.rollout.name": a["rollout"], f"{arr}.rollout.n": _rollout_n(a),
            f"{arr}.rollout.tensor_model_parallel_size": min(a["rollout_tp"], gpus),
            f"{arr}.rollout.gpu_memory_utilization": a["gpu_memory_utilization"],
            f"{arr}.rollout.log_prob_micro_batch_size_per_gpu": a["log_prob_micro_batch_size_per_gpu"],
            f"{arr}.ref.log_prob_micro_batch_size_per_gpu": a["ref_log_prob_micro_batch_size_per_gpu"],
        }
        roles = [arr]
        if a["algorithm"] == "ppo":  # the critic exists only for GAE
            out.update({"critic.model.path": a["model"], "critic.optim.lr": a["critic_lr"],
                        "critic.ppo_micro_batch_size_per_gpu": a["micro_batch_size_per_gpu"]})
            roles.append("critic")
        for role in roles:
            out.update({k.format(role=role): v for k, v in ATTENTION[a.get("attention", "sdpa")].items()})
        return out

    def _algorithm(self, ctx) -> dict:
        a = ctx.args
        out = dict(ALGORITHMS[a["algorithm"]])
        if a["algorithm"] == "ppo":
            out["algorithm.kl_ctrl.kl_coef"] = a["kl_coef"]
        elif a["algorithm"] == "grpo":
            out["actor_rollout_ref.actor.kl_loss_coef"] = a["kl_coef"]
        if a["reward"] != "verl":
            path, name = reward_target(a["reward"], Path(ctx.run_dir) / REWARD_FILE)
            out["reward.custom_reward_function.path"] = path
            out["reward.custom_reward_function.name"] = name
        return out

    def _trainer(self, ctx) -> dict:
        a, res = ctx.args, ctx.resources or {}
        out = {
            "trainer.default_local_dir": str(ctx.ckpt_dir), "trainer.resume_mode": "auto",
            "trainer.nnodes": int(res.get("nodes") or 1), "trainer.n_gpus_per_node": _gpus_per_node(ctx),
            "trainer.total_epochs": a["total_epochs"], "trainer.test_freq": a["test_freq"],
            "trainer.project_name": a["project_name"], "trainer.experiment_name": a["experiment_name"] or ctx.run_id,
            "trainer.max_actor_ckpt_to_keep": a["max_ckpt_to_keep"],
            "trainer.max_critic_ckpt_to_keep": a["max_ckpt_to_keep"],
            "trainer.use_v1": a["save_mode"] == "periodic",
            "trainer.esi_redundant_time": a["save_time_s"],
            # each step's prompts, responses and scores, for `hpcrl samples RUN` (job/verl_rollouts.py)
            "trainer.rollout_data_dir": str(Path(ctx.run_dir) / ROLLOUTS_DIR),
        }
        if a["total_training_steps"] is not None:
            out["trainer.total_training_steps"] = a["total_training_steps"]
        if not _uses_ray_cluster(ctx):  # verl starts Ray itself: give it the CPUs Slurm granted
            out["ray_kwargs.ray_init.num_cpus"] = int(res.get("cpus_per_task") or ctx.site.get("cpus_per_task") or 0) or None
        return out

    # ------------------------------------------------------------ Ray on Slurm

    def bootstrap(self, ctx: TrainerContext) -> str:
        if not _uses_ray_cluster(ctx):
            return ray_env(ctx.python)  # verl's own ray.init() starts Ray, in this environment
        return ray_bootstrap(ctx.python, int((ctx.resources or {}).get("nodes") or 1),
                             _gpus_per_node(ctx), ctx.args["ray_port"])

    # ------------------------------------------------------------ progress

    def total_steps(self, args: dict) -> int | None:
        # null: total_epochs x batches per epoch, which only verl knows once it read the data
        return (args or {}).get("total_training_steps")

    def checkpoint_step(self, run_dir: Path, ckpt_dir: Path, remote: bool = False) -> int | None:
        return verl_checkpoint_step(ckpt_dir)


def verl_checkpoint_step(ckpt_dir) -> int | None:
    """The step verl's tracker names, if that global_step_N directory exists (as verl checks)."""
    try:
        text = (Path(ckpt_dir) / TRACKER).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    if not re.fullmatch(r"\d+", text) or not (Path(ckpt_dir) / f"global_step_{text}").is_dir():
        return None  # verl writes the tracker last; a torn or stale one names nothing usable
    return int(text)


def reward_target(reward: str, shipped: Path) -> tuple[str, str]:
    """(file, function) for reward.custom_reward_function: 'hpcrl' is the copy of hpcrl/rewards/score.py
    in the run directory (verl loads it by path, so it must be, and is, stdlib-only)."""
    if reward == "hpcrl":
        return str(shipped), "compute_score"
    path, sep, name = reward.rpartition(":")
    if not sep or not path.endswith(".py"):
        path, name = reward, ""
    if not path.endswith(".py"):
        raise SpecError(f"args.reward: '{reward}' is not hpcrl, verl or /path/file.py[:function]")
    return path, name or "compute_score"


def check_steps(a: dict, rows: int) -> None:
    """A SpecError when verl would run out of data before total_training_steps (or has none)."""
    batches = rows // int(a["train_batch_size"])
    if batches == 0:
        raise SpecError(f"args.train_batch_size {a['train_batch_size']}: train_files holds only {rows} rows, not one "
                        f"batch (verl drops a partial batch); lower train_batch_size to at most {rows}")
    steps, epochs = a.get("total_training_steps"), int(a["total_epochs"])
    if steps is not None and int(steps) > epochs * batches:
        need = -(-int(steps) // batches)
        raise SpecError(f"args.total_training_steps {steps}: the data holds {epochs} epochs x {batches} batches = "
                        f"{epochs * batches} steps ({rows} rows of train_files / train_batch_size "
                        f"{a['train_batch_size']}); verl would stop unsaved at step {epochs * batches}: set "
                        f"args.total_training_steps to at most {epochs * batches}, or args.total_epochs to {need}")


def _override_value(overrides, key: str) -> str | None:
    for ov in overrides or []:
        m = _OVERRIDE.match(ov)
        if m and m.group(2) == key:
            return m.group(3)
    return None


def _gpus_per_node(ctx) -> int:
    return int((ctx.resources or {}).get("gpus_per_node") or ctx.site.get("gpus_per_node") or 1)


def _rollout_n(a) -> int:
    if a["rollout_n"] is not None:
        return a["rollout_n"]
    return {"ppo": 1, "grpo": 5, "gspo": 16}[a["algorithm"]]


def _uses_ray_cluster(ctx) -> bool:
    mode = ctx.args.get("ray_cluster", "auto")
    return mode == "always" or (mode == "auto" and int((ctx.resources or {}).get("nodes") or 1) > 1)


def _placeholder_ctx(args) -> TrainerContext:
    return TrainerContext(run_id="validate", run_dir=Path("/hpcrl-validate/run"),
                          ckpt_dir=Path("/hpcrl-validate/run/checkpoints"), args=args,
                          site={"gpus_per_node": 4, "cpus_per_task": 32}, resources={"nodes": 1})


def check_user_overrides(overrides) -> list[str]:
    """args.overrides must be Hydra 'key=value' strings that leave hpcrl's own keys alone."""
    check_override_keys(overrides, _OVERRIDE, 2, OWNED_KEYS, "trainer.test_freq=50 (a Hydra override)")
    return list(overrides)


# ------------------------------------------------------------------ composing verl's own config


def verl_config_dir() -> Path | None:
    """verl's trainer/config directory if verl is installed here (found without importing verl,
    whose __init__ imports ray and torch)."""
    import importlib.util

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / "trainer" / "config"
    return path if (path / "ppo_trainer.yaml").is_file() else None


def compose(overrides: list[str]):
    """verl's ppo_trainer config composed with `overrides` (raises Hydra's own errors)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=list(overrides))


def compose_check(overrides: list[str], suspects: list[str] = ()) -> bool:
    """Compose when hydra and verl are importable; a bad override becomes one SpecError line.
    `suspects` (the user's own overrides) are tried first when looking for the bad one: hpcrl's
    ~40 are composed one by one only if none of them is (a compose takes ~0.3-0.9 s, and trying
    every override in order made a misspelt key take 30 s to report).

    Returns False (nothing checked) when they are not installed: the job would find the error.
    """
    try:
        import hydra  # noqa: F401
    except ImportError:
        return False
    if verl_config_dir() is None:
        return False
    try:
        compose(overrides)
        return True
    except Exception as e:  # Hydra raises several types; every one means "this override is wrong"
        culprit = _first_failing([*suspects, *(ov for ov in overrides if ov not in suspects)])
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecError(f"args.overrides: '{culprit}' is rejected by verl {VERL_VERSION}'s ppo_trainer config "
                        f"({first}); check the key's spelling, or prefix a new key with +") from None


def _first_failing(overrides: list[str]) -> str:
    for ov in overrides:
        try:
            compose([ov])
        except Exception:
            return ov
    return " ".join(overrides)


# ------------------------------------------------------------------ bootstrap script


# Slurm's GPU gres sets ROCR_VISIBLE_DEVICES beside CUDA_VISIBLE_DEVICES (and does so again in
# every srun step) unless gres.conf says Flags=nvidia_gpu_env: measured on the test cluster (Slurm
# 22.05). verl's workers refuse the pair ("Please don't set ROCR_VISIBLE_DEVICES when
# HIP/CUDA_VISIBLE_DEVICES is set"), and Slurm names the same devices in both: keep CUDA's, which
# HIP reads too. Where only ROCR_VISIBLE_DEVICES is set (an AMD site's flags) it stays.
ONE_GPU_LIST = 'if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then unset ROCR_VISIBLE_DEVICES; fi'


def ray_env(python: str) -> str:
    """Bash for the batch shell before Ray or verl start: the GPU list fix above, and this
    segment's Ray gets a token of its own, in the environment only.

    Ray >= 2.5x turns token authentication on by itself: a local `ray.init()` writes
    ~/.ray/auth_token, and from then on every `ray start --head` of that user (on Perlmutter, on
    any node: $HOME is shared) requires the token, while a joining `ray start --address` worker
    does not look for it and fails with InvalidAuthToken (measured on the two-node test cluster).
    An explicit RAY_AUTH_MODE makes head, workers and driver agree; a fresh token per segment
    keeps other users on the nodes' network out of the cluster. srun passes the environment to
    every node, so the token is never written to a file (not the script, the run directory or
    the home). A RAY_AUTH_MODE the user set (spec or site env) is left as it is. Older Ray
    ignores both variables.
    """
    return f"""\
# --- Ray's environment (hpcrl verl adapter): one GPU list; a token for this segment, never on disk ---
{ONE_GPU_LIST}
if [ -z "${{RAY_AUTH_MODE:-}}" ]; then
    export RAY_AUTH_MODE=token
    RAY_AUTH_TOKEN=$({q(python)} -c 'import secrets; print(secrets.token_hex(32))')
    export RAY_AUTH_TOKEN
fi
"""


def ray_bootstrap(python: str, nodes: int, gpus_per_node: int, port: int) -> str:
    """Bash that starts a Ray head on the batch node, waits until Ray reports it alive, starts a
    worker on each other node (via srun), waits until Ray reports all `nodes` alive (each wait
    bounded, and cut short when a Ray srun exits), and exports RAY_ADDRESS for the driver.

    As verl's examples/tutorial/slurm/ray_on_slurm.slurm, except that the driver runs in the
    batch shell itself: Slurm runs the batch script on the allocation's first node, which is the
    head, so `srun --overlap -w head` adds nothing but a second quoting layer. Ray is stopped when
    the batch shell exits (EXIT trap), so no head outlives its segment and holds the port or the
    GPUs when the next segment lands on the same node.
    """
    # No drain on TERM (Ray >= 2.5x waits up to 30 s for a GCS that gets the same TERM): verl
    # runs no Ray Serve, the one thing draining is for.
    # Each srun step gets Slurm's GPU variables anew: the fix runs inside the step too.
    in_step = ONE_GPU_LIST + '; exec env RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 "$@"'
    ray = (f"bash -c {q(in_step)} ray {q(python)} "
           f"-c 'import sys; from ray.scripts.scripts import main; sys.argv[0] = \"ray\"; main()'")
    return ray_env(python) + f"""\
# --- Ray cluster over the allocation (hpcrl verl adapter) ---
hpcrl_nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
hpcrl_head=${{hpcrl_nodes[0]}}
# Every srun names its CPUs: since Slurm 22.05 a step no longer inherits the job's --cpus-per-task,
# and a Ray daemon bound to one core while told it has them all starves its workers. Ray is told
# what its step holds: the job's CPUs per task, else the node's CPUs of the allocation (a step
# asking for more than that is refused: "More processors requested than permitted").
hpcrl_ray_cpus=${{SLURM_CPUS_PER_TASK:-${{SLURM_CPUS_ON_NODE:-$(nproc)}}}}
hpcrl_head_ip=$(srun --nodes=1 --ntasks=1 --cpus-per-task=1 --overlap -w "$hpcrl_head" hostname --ip-address | awk '{{print $1}}')
export RAY_ADDRESS="$hpcrl_head_ip:"{q(str(port))}
hpcrl_ray_pids=()
hpcrl_ray_wait() {{  # up to $1 s for the Ray sruns to end; true when they have
    for hpcrl_try in $(seq 1 "$1"); do
        kill -0 "${{hpcrl_ray_pids[@]}}" 2>/dev/null || return 0
        sleep 1
    done
    ! kill -0 "${{hpcrl_ray_pids[@]}}" 2>/dev/null
}}
hpcrl_ray_stop() {{
    # TERM to the job's steps (never the batch shell) reaches each `ray start --block`, which
    # stops its raylet, GCS and workers itself. If that hangs, TERM to srun makes Slurm kill the
    # whole step. Either way no Ray daemon outlives the segment.
    [ "${{#hpcrl_ray_pids[@]}}" -gt 0 ] || return 0
    echo "hpcrl: stopping Ray" >&2
    scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null
    hpcrl_ray_wait 45 || {{ kill -TERM "${{hpcrl_ray_pids[@]}}" 2>/dev/null; hpcrl_ray_wait 20; }}
    echo "hpcrl: Ray stopped" >&2
}}
trap hpcrl_ray_stop EXIT
hpcrl_ray_alive() {{  # alive Ray nodes, as Ray's own API counts them (empty while no head answers)
    timeout 60 {q(python)} -c 'import ray; ray.init(address="auto", logging_level="ERROR"); print(sum(1 for n in ray.nodes() if n["Alive"]))' 2>/dev/null | tail -n 1
}}
hpcrl_ray_join() {{  # until $1 Ray nodes are alive, for at most $2 s; false at once when one of the Ray sruns exited
    local end=$((SECONDS + $2)) pid
    while :; do
        hpcrl_alive=$(hpcrl_ray_alive)
        [ "${{hpcrl_alive:-0}}" -ge "$1" ] 2>/dev/null && return 0
        for pid in "${{hpcrl_ray_pids[@]}}"; do kill -0 "$pid" 2>/dev/null || return 1; done
        [ "$SECONDS" -lt "$end" ] || return 1
        sleep 2
    done
}}
hpcrl_ray_failed() {{
    echo "hpcrl: $1" >&2
    # recorded as a failed segment (not a lost one), so crash-loop detection sees it
    "$hpcrl_py" -m hpcrl.cli _segment end "$HPCRL_RUN_DIR" --job-id "$HPCRL_JOB_ID" --rc 1
    exit 1
}}
srun --nodes=1 --ntasks=1 --cpus-per-task="$hpcrl_ray_cpus" --overlap -w "$hpcrl_head" \\
    {ray} start --head --node-ip-address="$hpcrl_head_ip" --port={q(str(port))} \\
    --num-cpus "$hpcrl_ray_cpus" --num-gpus {q(str(gpus_per_node))} --disable-usage-stats --block &
hpcrl_ray_pids+=($!)
hpcrl_alive=0
# the workers join a head that answers (asked of Ray, not a fixed sleep: a loaded node's head can
# take longer than any guess, a quiet one far less)
hpcrl_ray_join 1 300 || hpcrl_ray_failed "the Ray head did not come up within 5 minutes"
for hpcrl_node in "${{hpcrl_nodes[@]:1}}"; do
    srun --nodes=1 --ntasks=1 --cpus-per-task="$hpcrl_ray_cpus" --overlap -w "$hpcrl_node" \\
        {ray} start --address "$RAY_ADDRESS" --num-cpus "$hpcrl_ray_cpus" --num-gpus {q(str(gpus_per_node))} \\
        --disable-usage-stats --block &
    hpcrl_ray_pids+=($!)
done
hpcrl_ray_join {q(str(nodes))} 300 ||
    hpcrl_ray_failed "only ${{hpcrl_alive:-0}} of "{q(str(nodes))}" Ray nodes joined within 5 minutes"
echo "hpcrl: Ray cluster up: $hpcrl_alive node(s) at $RAY_ADDRESS" >&2
"""
