"""MaxText RL adapter (the seed tutorial: GRPO / GSPO on a single-host TPU VM).

What runs in the job (hpcrl/job/maxtext.py, from the run's lib/ snapshot of hpcrl):

    PY -m hpcrl.job.maxtext --python PY --ckpt-root <base>/<run>/checkpoints/actor \
        --period N --total-steps T ... -- key=value ...

and the launcher runs `python -m maxtext.trainers.post_train.rl.train_rl key=value ...` for the
pinned MaxText (MAXTEXT_VERSION). With no config path in argv, MaxText picks post_train/rl.yml for
this module (maxtext/configs/pyconfig.py _CONFIG_FILE_MAPPING) and routes flat keys such as
loss_algo into the nested `rl:` group (types.py RLConfig.map_flat_fields_to_nested_models).

Resume: rerunning the identical command with the same run_name and base_output_directory
restores the newest committed <base_output_directory>/<run_name>/checkpoints/actor/<step>/ (Tunix
keeps the actor's params and optimizer state under checkpoints/actor/: measured, notes/
maxtext-cpu.md) and fast-forwards the data iterator. The RL path handles no signal (SIGTERM: no
save; SIGUSR1: killed, also in the middle of a save), so the launcher speaks the walltime protocol
for it: it stops MaxText only between saves, right after a committed one when the next would not
fit before the deadline (exit 85), and removes what an interrupted save left. checkpoint_period
bounds what a hard kill loses (args.checkpoint_period, or sized from args.step_time_s and
args.save_every_s).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import SpecError, did_you_mean
from ..names import gs_url_problem
from ..schemas import Bool, Choice, Float, Int, Schema, Str, StrList
from .base import Trainer, TrainerContext, check_override_keys

MAXTEXT_VERSION = "0.2.5"
MODULE = "maxtext.trainers.post_train.rl.train_rl"
LAUNCH_MODULE = "hpcrl.job.maxtext"  # the job-side launcher, run from the run's lib/
# Tunix's checkpoint manager keeps the policy under this sub-directory of MaxText's checkpoint_dir
ACTOR_SUBDIR = "actor"
# rl.yml's defaults of the keys that fix the number of steps (types.py: train_steps =
# num_batches x num_iterations x train_fraction x num_epoch)
RL_YML_STEPS = {"num_batches": 4, "num_iterations": 1, "train_fraction": 1.0, "num_epoch": 1}
LOSS_ALGO = {"grpo": "grpo", "gspo": "gspo-token"}
# Keys hpcrl renders itself: a user override would break resume or placement.
OWNED_KEYS = ("run_name", "base_output_directory", "chips_per_vm", "load_parameters_path",
              "enable_checkpointing", "checkpoint_period", "loss_algo", "hf_access_token")
# The recipes' example bucket: replaced by the site's bucket (site.bucket) wherever a path starts with it
PLACEHOLDER_BUCKET = "gs://YOUR_BUCKET"
# Models whose Hugging Face repositories are gated (their tokenizer is fetched from the Hub when
# tokenizer_path is null): a token of an account that accepted the licence is needed.
GATED_MODELS = re.compile(r"^(llama|gemma)", re.I)
GATED_TOKENIZERS = re.compile(r"^(meta-llama|google)/", re.I)
TOKEN_NAMES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
# MaxText's documented install for post-training on TPUs (docs/install_maxtext.md, "From PyPI",
# option 3; the wheel's dependencies/scripts/setup.sh install_post_training_deps): Python 3.12,
# `uv pip install maxtext[tpu-post-train] --resolution=lowest` with UV_TORCH_BACKEND=cpu (the
# extra pins torch==2.11.0+cpu, which only PyTorch's CPU index serves; uv's torch backend sends
# just the torch packages there), then the wheel's `install_tpu_post_train_extra_deps` (vLLM,
# tpu-inference and Tunix at the GitHub commits of post_train_github_deps.txt, built for TPU).
# The wheel's tpu_post_train_overrides.txt (jax 0.11.0, libtpu 0.0.44, flax 0.12.8, ...) is
# applied as uv overrides, as MaxText's lock generation does (generate_requirements.sh).
TPU_PYTHON = "3.12"
# The platform to resolve the set for: libtpu 0.0.44 ships only manylinux_2_31 wheels (TPU VM
# images are Ubuntu 22.04, glibc 2.35); manylinux_2_28 finds no libtpu and fails.
TPU_PYTHON_PLATFORM = "x86_64-manylinux_2_31"
TPU_INDEX_OPTIONS = ("--torch-backend=cpu", "--resolution=lowest")
DEPS_DIR = Path(__file__).parent / "maxtext_deps"  # copied unchanged from the 0.2.5 wheel
OVERRIDES_FILE, GITHUB_DEPS_FILE = "tpu_post_train_overrides.txt", "post_train_github_deps.txt"
INSTALL_FILE = "maxtext/install-venv.sh"
COMMIT_FILE = "commit_success.txt"  # Orbax's commit marker (where it cannot rename: GCS)
_KEY = re.compile(r"^([A-Za-z_]\w*)=(.*)$", re.S)


_NONE_OR_POSITIVE = dict(ge=1, nullable=True)
SCHEMA = Schema("maxtext", [
    Choice("algorithm", "grpo", LOSS_ALGO, "grpo | gspo (loss_algo=gspo-token)"),
    Str("model_name", "llama3.1-8b-Instruct", "MaxText model name (configs/models/<name>.yml, -Instruct stripped)",
        nonempty=True),
    Str("load_parameters_path", None, "MaxText checkpoint .../0/items (tutorial option 1 or 2); null: random "
        "initialisation (MaxText rejects an empty value; the recipes always set one)", nullable=True, nonempty=True),
    Str("tokenizer_path", None, "null: MaxText's HF id for model_name", nullable=True, nonempty=True),
    Str("base_output_directory", None, "null: <run dir>/maxtext; on TPU use gs://BUCKET/...", nullable=True,
        nonempty=True),
    Str("run_name", None, "null: the run id (must stay the same across segments)", nullable=True, nonempty=True),
    Int("num_batches", None, "null: rl.yml's (4, a smoke run); 3738 = one GSM8K epoch", **_NONE_OR_POSITIVE),
    Int("batch_size", None, "null: rl.yml's", **_NONE_OR_POSITIVE),
    Int("num_generations", None, "responses per prompt; null: rl.yml's", **_NONE_OR_POSITIVE),
    Float("learning_rate", None, "null: rl.yml's", gt=0, nullable=True),
    Int("num_epoch", None, "null: rl.yml's", **_NONE_OR_POSITIVE),
    Int("checkpoint_period", None, "steps between saves; null: sized from step_time_s, else rl.yml's 50",
        **_NONE_OR_POSITIVE),
    Float("step_time_s", None, "measured seconds per step, to size checkpoint_period", gt=0, nullable=True),
    Float("save_every_s", 1800, "target seconds between saves when step_time_s is known", gt=0),
    Int("max_num_checkpoints_to_keep", 3, "checkpoints kept", ge=1),
    Float("save_time_s", 120, "what one save may take until one is measured (the launcher's stop decision)", gt=0),
    Bool("eval_every_segment", False, "rerun MaxText's pre-training evaluation on every resume (it has no key "
         "to skip only that one: false sets num_test_batches=0 after the first segment)"),
    StrList("overrides", [], "extra key=value for rl.yml / base.yml keys"),
])


class MaxTextTrainer(Trainer):
    python_min = (3, 12)  # maxtext[tpu-post-train] needs Python >= 3.12 on the VM
    name = "maxtext"
    package, package_version = "maxtext", MAXTEXT_VERSION
    obeys_protocol = True  # through hpcrl.job.maxtext: exit 0 complete, 85 continue
    schema = SCHEMA
    ranks_hint = "JAX on every chip of the TPU VM, the site's chips_per_vm"

    def validate_args(self, args: dict) -> dict:
        merged = super().validate_args(args)
        merged["overrides"] = check_user_overrides(merged["overrides"], installed_config_keys())
        return merged

    def requirements(self, args: dict, site: dict) -> list[str]:
        # tpu-post-train brings tunix and vLLM-TPU; MaxText needs Python >= 3.12 on the VM
        return [f"maxtext[tpu-post-train]=={MAXTEXT_VERSION}"]

    def check_submit(self, args: dict, world: int) -> None:
        import os

        if needs_hf_token(args) and not any(os.environ.get(k) for k in TOKEN_NAMES):
            raise SpecError(f"model {args['model_name']} is gated on Hugging Face (its tokenizer comes from the Hub) "
                            "and HF_TOKEN is not set in this shell: `export HF_TOKEN=hf_...` (an account that "
                            "accepted the model's licence), then submit again")

    def output_dir(self, ctx: TrainerContext) -> str:
        """base_output_directory; null: <site.bucket>/hpcrl on a site with a bucket (TPU), else
        <run dir>/maxtext."""
        given = ctx.args["base_output_directory"]
        if given is None and ctx.site.get("bucket"):
            given = f"{ctx.site['bucket'].rstrip('/')}/hpcrl"
        return site_path(given, ctx.site, "base_output_directory") if given else str(Path(ctx.run_dir) / "maxtext")

    def keys(self, ctx: TrainerContext) -> dict:
        """The key=value pairs of the command line, in order."""
        a = ctx.args
        if int((ctx.resources or {}).get("nodes") or 1) != 1:
            raise SpecError("resources.nodes: the maxtext trainer runs on one TPU VM (single host); set nodes: 1")
        chips = ctx.site.get("chips_per_vm")
        if not chips:
            raise SpecError("site: chips_per_vm is not set (v5p: 4, v6e: 8, v5e: 8); add it to the site profile")
        out = {"model_name": a["model_name"],
               "run_name": a["run_name"] or ctx.run_id, "base_output_directory": self.output_dir(ctx),
               "chips_per_vm": chips, "loss_algo": LOSS_ALGO[a["algorithm"]],
               "enable_checkpointing": "true", "checkpoint_period": checkpoint_period(a),
               "max_num_checkpoints_to_keep": a["max_num_checkpoints_to_keep"]}
        if a["load_parameters_path"] is not None:  # null: random initialisation (MaxText rejects an empty value)
            out["load_parameters_path"] = site_path(a["load_parameters_path"], ctx.site, "load_parameters_path")
        if a["tokenizer_path"] is not None:
            out["tokenizer_path"] = site_path(a["tokenizer_path"], ctx.site, "tokenizer_path")
        for key in ("num_batches", "batch_size", "num_generations", "learning_rate", "num_epoch"):
            if a[key] is not None:
                out[key] = a[key]
        return out

    def files(self, ctx: TrainerContext) -> dict[str, str]:
        return {INSTALL_FILE: venv_install_script(),
                f"maxtext/{OVERRIDES_FILE}": (DEPS_DIR / OVERRIDES_FILE).read_text(encoding="utf-8")}

    def venv_installer(self, ctx: TrainerContext) -> str | None:
        return str(Path(ctx.run_dir) / INSTALL_FILE)

    def command(self, ctx: TrainerContext) -> list[str]:
        a = ctx.args
        keys = self.keys(ctx)
        pairs = [f"{k}={v}" for k, v in keys.items()]
        launch = [ctx.python, "-m", LAUNCH_MODULE, "--python", ctx.python,
                  "--ckpt-root", f"{self.checkpoint_root(ctx)}/{ACTOR_SUBDIR}", "--period", str(keys["checkpoint_period"]),
                  "--total-steps", str(self.total_steps(a) or 0), "--save-time-s", f"{float(a['save_time_s']):g}",
                  "--eval", "every" if a["eval_every_segment"] else "first"]
        if a["step_time_s"]:
            launch += ["--step-time-s", f"{float(a['step_time_s']):g}"]
        overrides = [f"{k}={site_path(v, ctx.site, f'overrides ({k})')}" for k, _, v in
                     (ov.partition("=") for ov in a["overrides"])]
        return [*launch, "--", *pairs, *overrides]

    def env(self, ctx: TrainerContext) -> dict[str, str]:
        return {"PYTHONUNBUFFERED": "1"}  # HF_TOKEN comes from the user's env, never the spec

    def total_steps(self, args: dict) -> int | None:
        """MaxText's train_steps (types.py): num_batches x num_iterations x train_fraction x num_epoch,
        each from args, else args.overrides, else rl.yml's default."""
        a = args or {}
        given = dict(RL_YML_STEPS)
        for ov in a.get("overrides") or []:
            key, _, value = ov.partition("=")
            if key in given:
                given[key] = value
        for key in given:
            if a.get(key) is not None:
                given[key] = a[key]
        try:
            return int(int(given["num_batches"]) * int(given["num_iterations"]) * float(given["train_fraction"])
                       * int(given["num_epoch"]))
        except (TypeError, ValueError):
            return None

    def checkpoint_step(self, run_dir: Path, ckpt_dir: Path, remote: bool = False) -> int | None:
        # MaxText writes under base_output_directory/run_name, not the run's checkpoints/ dir:
        # find that place from the run's frozen spec.
        from ..runs import RunLayout

        layout = RunLayout(run_dir)
        try:
            resolved = json.loads(layout.spec.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return maxtext_checkpoint_step(ckpt_dir)
        ctx = TrainerContext(run_id=Path(run_dir).name, run_dir=Path(run_dir), ckpt_dir=Path(ckpt_dir),
                             args=resolved["spec"]["args"], site=resolved["site"], resources=resolved["spec"]["resources"])
        root = f"{self.checkpoint_root(ctx)}/{ACTOR_SUBDIR}"
        if not root.startswith("gs://"):
            return maxtext_checkpoint_step(root)
        if not remote:  # `status`: what the last listing found (never the network)
            return read_step_cache(layout.checkpoint_cache)
        step = _gs_checkpoint_step(root)
        write_step_cache(layout.checkpoint_cache, step)
        return step

    def checkpoint_root(self, ctx: TrainerContext) -> str:
        """MaxText's checkpoint_dir (types.py: base/run_name/checkpoints/); Tunix writes the steps
        under its actor/ sub-directory."""
        return f"{self.output_dir(ctx).rstrip('/')}/{ctx.args['run_name'] or ctx.run_id}/checkpoints"


def tpu_requirements(resolved: dict) -> tuple[list[str], list[str]]:
    """MaxText's TPU post-training requirement set (pure): the requirement lines of the run's venv
    (the extra, then the spec's own) and the uv options MaxText installs them with (its torch
    backend, lowest resolution, its overrides file). The GitHub-pinned vLLM / tpu-inference /
    Tunix commits (`tpu_github_deps`) are installed after them, without dependencies, by the
    wheel's own command: they are not part of this resolve."""
    spec = resolved["spec"]
    lines = [f"maxtext[tpu-post-train]=={MAXTEXT_VERSION}", *(spec.get("requirements") or [])]
    return lines, [*TPU_INDEX_OPTIONS, f"--override={DEPS_DIR / OVERRIDES_FILE}"]


def tpu_github_deps() -> list[str]:
    """The wheel's post_train_github_deps.txt: what install_tpu_post_train_extra_deps installs."""
    text = (DEPS_DIR / GITHUB_DEPS_FILE).read_text(encoding="utf-8")
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def venv_install_script() -> str:
    """RUN/maxtext/install-venv.sh VENV REQUIREMENTS: the venv built as MaxText documents it (the
    segment script runs it on the TPU VM instead of its generic venv + pip lines)."""
    opts = " ".join(TPU_INDEX_OPTIONS)
    return f"""#!/bin/bash
# MaxText {MAXTEXT_VERSION}'s venv for post-training on a TPU VM, as MaxText documents it
# (docs/install_maxtext.md "From PyPI", option 3; the wheel's setup.sh install_post_training_deps):
#   uv venv --python {TPU_PYTHON} --seed VENV
#   uv pip install {opts} --override {OVERRIDES_FILE} -r REQUIREMENTS
#     (maxtext[tpu-post-train]=={MAXTEXT_VERSION}: torch==2.11.0+cpu from PyTorch's CPU index via uv's torch
#     backend; the overrides file is the wheel's dependencies/extra_deps/{OVERRIDES_FILE})
#   install_tpu_post_train_extra_deps
#     (the wheel's command: vLLM, tpu-inference and Tunix at the commits of its
#     {GITHUB_DEPS_FILE}, built for TPU with gcc >= 11, then MaxText's vLLM integration)
# Written by hpcrl; usage: install-venv.sh VENV REQUIREMENTS
set -euo pipefail
venv=$1
requirements=$2
here=$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)
python3 -m uv --version >/dev/null 2>&1 || python3 -m pip install --quiet uv
if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
  # vLLM for TPU is built from source (MaxText's setup.sh installs the same tools)
  apt-get update -y && apt-get install -y --no-install-recommends gcc-12 g++-12 build-essential cmake ninja-build
fi
python3 -m uv venv --python {TPU_PYTHON} --seed "$venv"
python3 -m uv pip install --python "$venv/bin/python" {opts} --override "$here/{OVERRIDES_FILE}" -r "$requirements"
(
  source "$venv/bin/activate"
  python -m pip install --quiet uv  # the extra-deps command calls `uv` from PATH
  install_tpu_post_train_extra_deps
)
"$venv/bin/python" -c 'import maxtext, jax, vllm, tpu_inference, tunix'
"""


def site_path(value: str, site: dict, key: str) -> str:
    """A path of the spec as the job gets it: the recipes' placeholder bucket (gs://YOUR_BUCKET)
    becomes the site's bucket; a gs:// path that is still a placeholder or invalid is refused."""
    if not isinstance(value, str) or not value.startswith("gs://"):
        return value
    if (value == PLACEHOLDER_BUCKET or value.startswith(PLACEHOLDER_BUCKET + "/")) and site.get("bucket"):
        value = site["bucket"].rstrip("/") + value[len(PLACEHOLDER_BUCKET):]
    problem = gs_url_problem(value)
    if problem:
        raise SpecError(f"args.{key}: {value} {problem}; give your bucket's path (one that starts with "
                        f"{PLACEHOLDER_BUCKET} takes site.bucket: --set site.bucket=gs://NAME)")
    return value


def needs_hf_token(args: dict) -> bool:
    """Whether the run fetches a gated model's files from the Hub (its tokenizer, by MaxText's HF id)."""
    tokenizer = args.get("tokenizer_path")
    if tokenizer is None:
        return bool(GATED_MODELS.match(str(args.get("model_name") or "")))
    return bool(GATED_TOKENIZERS.match(str(tokenizer)))


def checkpoint_period(a: dict) -> int:
    if a["checkpoint_period"] is not None:
        return a["checkpoint_period"]
    if a["step_time_s"]:
        return max(1, int(float(a["save_every_s"]) // float(a["step_time_s"])))
    return 50  # rl.yml's default


def maxtext_checkpoint_step(ckpt_dir) -> int | None:
    """Newest <step>/ directory. Orbax writes <step>.orbax-checkpoint-tmp-*/ and renames it when
    complete, so an all-digit name is a finished save."""
    try:
        steps = [int(p.name) for p in Path(ckpt_dir).iterdir() if p.is_dir() and p.name.isdigit()]
    except OSError:
        return None
    return max(steps) if steps else None


def read_step_cache(path) -> int | None:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8")).get("step")
    except (OSError, ValueError, AttributeError):
        return None


def write_step_cache(path, step: int | None) -> None:
    import time

    from ..atomicio import atomic_write_json

    atomic_write_json(path, {"step": step, "listed": time.time()})


def _gs_checkpoint_step(url: str) -> int | None:
    """Newest committed step under a gs:// checkpoint root, listed with `gcloud storage ls`.
    On GCS Orbax writes <step>/ in place (nothing is renamed) and commits it with
    <step>/commit_success.txt last: a step directory without it is a save in progress or torn.

    Called where listing is allowed to take time: the segment's end hook (on the TPU VM, where
    gcloud is installed and authorised; without it every segment would look like no progress)
    and the TPU watcher; they cache the answer for `status`. HPCRL_GS overrides the command (as
    in the TPU startup script).
    """
    import os

    from ..errors import BackendError
    from ..proc import run_command

    # HPCRL_GS is a command of plain words ("gcloud storage"), split as the startup script does.
    argv = os.environ.get("HPCRL_GS", "gcloud storage").split() + ["ls", url.rstrip("/") + "/*/" + COMMIT_FILE]
    try:
        out = run_command(argv, timeout_s=60, check=False).stdout
    except BackendError:
        return None
    steps = [int(m.group(1)) for m in re.finditer(r"/(\d+)/" + re.escape(COMMIT_FILE) + r"\s*$", out, re.M)]
    return max(steps) if steps else None


def config_keys(*yaml_texts: str) -> set[str]:
    """Settable keys of MaxText's RL config: top-level keys of the YAMLs plus the `rl:` group's
    (flat CLI keys are routed into nested groups)."""
    import yaml

    keys: set[str] = set()
    for text in yaml_texts:
        data = yaml.safe_load(text) or {}
        keys |= set(data)
        for group in ("rl",):
            if isinstance(data.get(group), dict):
                keys |= set(data[group])
    return keys


def installed_config_keys() -> set[str] | None:
    """Keys of the installed MaxText's base.yml + post_train/rl.yml; None when it is not installed
    (it needs Python >= 3.12, so a login node often lacks it: then overrides are checked on the VM)."""
    import importlib.util

    spec = importlib.util.find_spec("maxtext")
    if spec is None or not spec.origin:
        return None
    configs = Path(spec.origin).parent / "configs"
    try:
        return config_keys(*(p.read_text(encoding="utf-8") for p in (configs / "base.yml", configs / "post_train" / "rl.yml")))
    except OSError:
        return None


def check_user_overrides(overrides, known: set[str] | None) -> list[str]:
    for key in check_override_keys(overrides, _KEY, 1, OWNED_KEYS, "eval_interval=20"):
        if known is not None and key not in known:
            raise SpecError(f"args.overrides: '{key}' is not a key of MaxText {MAXTEXT_VERSION}'s RL config"
                            f"{did_you_mean(key, known)}; see maxtext/configs/post_train/rl.yml")
    return list(overrides)
