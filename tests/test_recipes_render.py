"""Every shipped trainer recipe renders for its site: golden scripts (HPCRL_UPDATE_GOLDENS=1 rewrites
them), bash -n, and the shape of the verl script on one node (no srun) and on two (Ray via srun)."""

import re
from pathlib import Path

import pytest

from helpers import ROOT, hpcrl
from test_render import FIXED, PY, bash_n, check_golden

VERL_RECIPES = ["tinyzero-countdown-ppo", "tinyzero-countdown-grpo", "verl-gsm8k-grpo", "verl-gsm8k-gspo"]
MAXTEXT_RECIPES = ["maxtext-llama3.1-8b-grpo", "maxtext-llama3.1-8b-gspo"]
BUILTIN_GPU_RECIPES = ["gsm8k-grpo", "gsm8k-gspo", "countdown-grpo", "mbpp-code-grpo", "tinyzero-countdown-builtin"]
PERLMUTTER = ["--site", "perlmutter", "--account", "m1234_g", "--hours", "4"]
# The TPU site needs a project, zone and bucket; any well-formed values render the same script.
TPU = ["--site", "tpu-v5p-8", "--hours", "4", "--set", "site.project=hpcrl-demo",
       "--set", "site.zone=us-east5-a", "--set", "site.bucket=gs://hpcrl-demo-bucket"]


def render_recipe(tmp_path: Path, recipe: str, *args: str) -> str:
    spec = tmp_path / f"{recipe}.yaml"
    hpcrl("init", "--recipe", recipe, "--out", spec, env=FIXED)
    return hpcrl("render", spec, *args, env=FIXED).stdout


def verl_command(text: str) -> str:
    return next(ln.strip() for ln in text.splitlines() if "-m hpcrl.job.verl" in ln)


@pytest.mark.parametrize("recipe", VERL_RECIPES)
def test_verl_recipe_renders_on_perlmutter(tmp_path, recipe):
    text = render_recipe(tmp_path, recipe, *PERLMUTTER, "--name", recipe, PY)
    bash_n(text)
    assert "#SBATCH --nodes=1" in text and "#SBATCH --gpus-per-node=4" in text
    cmd = verl_command(text)
    assert cmd.startswith('"$trainer_py" ')  # run in the foreground of the status-recording subshell
    for override in ("trainer.resume_mode=auto", "trainer.nnodes=1", "trainer.n_gpus_per_node=4",
                     f"trainer.default_local_dir=/pscratch/sd/u/user/hpcrl/runs/{recipe}/checkpoints",
                     "ray_kwargs.ray_init.num_cpus=128"):
        assert f" {override} " in f" {cmd} ", override
    assert "srun" not in text and "hpcrl_ray" not in text, "one node: verl starts Ray itself, no srun"
    check_golden(f"recipe-{recipe}-perlmutter.sh", text)


def test_verl_multinode_script_starts_ray_head_and_workers_through_srun(tmp_path):
    text = render_recipe(tmp_path, "tinyzero-countdown-grpo", *PERLMUTTER, "--name", "verl-multinode",
                         "--nodes", "2", PY)
    bash_n(text)
    assert "#SBATCH --nodes=2" in text
    head = re.search(r'^srun --nodes=1 --ntasks=1 --cpus-per-task="\$hpcrl_ray_cpus" --overlap -w "\$hpcrl_head" \\\n'
                     r'(.*\n){2}', text, re.M)
    assert head and " start --head " in head.group(0) and "--port=6379" in head.group(0)
    assert head.group(0).rstrip().endswith("--block &")
    worker = re.search(r'^for hpcrl_node in "\$\{hpcrl_nodes\[@\]:1\}"; do\n'
                       r'    srun --nodes=1 --ntasks=1 --cpus-per-task="\$hpcrl_ray_cpus" --overlap -w "\$hpcrl_node" \\\n'
                       r'(.*\n){2}', text, re.M)
    assert worker and ' start --address "$RAY_ADDRESS" ' in worker.group(0)
    assert ('hpcrl_head_ip=$(srun --nodes=1 --ntasks=1 --cpus-per-task=1 --overlap -w "$hpcrl_head" hostname '
            '--ip-address') in text
    # each Ray daemon gets the job's CPUs (srun no longer inherits -c since Slurm 22.05)
    assert text.index("hpcrl_ray_cpus=${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-$(nproc)}}") < text.index("hpcrl_head_ip=$(srun")
    assert 'export RAY_ADDRESS="$hpcrl_head_ip:"6379' in text
    assert "trap hpcrl_ray_stop EXIT" in text, "Ray must not outlive the segment"
    # Ray is up before the driver starts, and the driver is told the node count, not Ray's CPUs
    assert text.index("Ray cluster up") < text.index("-m hpcrl.job.verl")
    cmd = verl_command(text)
    assert " trainer.nnodes=2 " in cmd and "ray_kwargs.ray_init.num_cpus" not in cmd
    check_golden("verl-multinode-perlmutter.sh", text)


@pytest.mark.parametrize("recipe", BUILTIN_GPU_RECIPES)
def test_builtin_gpu_recipe_uses_every_gpu_of_the_node_it_pays_for(tmp_path, recipe):
    text = render_recipe(tmp_path, recipe, *PERLMUTTER, "--name", recipe, PY)
    bash_n(text)
    assert "#SBATCH --nodes=1" in text and "#SBATCH --gpus-per-node=4" in text
    cmd = next(ln.strip() for ln in text.splitlines() if "torch.distributed.run" in ln)
    assert cmd.startswith("srun --nodes=1 --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=128 ")
    assert " --nnodes 1 --nproc-per-node 4 --rdzv-backend c10d " in cmd
    assert cmd.endswith(f"-m hpcrl.rl.train --config /pscratch/sd/u/user/hpcrl/runs/{recipe}/trainer.json")
    recipe_text = (ROOT / "hpcrl" / "recipes" / f"{recipe}.yaml").read_text()
    head = recipe_text[:recipe_text.index("\nname:")]
    assert "Hardware:" in head and "4x A100" in head and re.search(r"~\d+ of 39\.5 GiB", head), \
        "each GPU recipe states its hardware and expected memory (tests/rl/test_memory.py checks the figures)"


def test_tinyzero_sized_builtin_recipe_shards_with_fsdp_like_its_verl_twin(tmp_path):
    import yaml

    text = render_recipe(tmp_path, "tinyzero-countdown-builtin", *PERLMUTTER, "--name", "tzb", PY)
    assert "--nproc-per-node 4" in text
    ours = yaml.safe_load((ROOT / "hpcrl" / "recipes" / "tinyzero-countdown-builtin.yaml").read_text())
    verl = yaml.safe_load((ROOT / "hpcrl" / "recipes" / "tinyzero-countdown-grpo.yaml").read_text())
    a, v = ours["args"], verl["args"]
    assert a["parallel"] == "fsdp" and a["model"] == v["model"] and a["train_files"] == v["train_files"]
    assert (a["batch_size"], a["group_size"], a["lr"], a["beta"]) == (v["train_batch_size"], v["rollout_n"],
                                                                     v["actor_lr"], v["kl_coef"])
    assert a["batch_size"] // a["mini_batches"] == v["ppo_mini_batch_size"]
    assert ours["resources"] == verl["resources"]
    # parallel: fsdp is built: submit's last check before queueing no longer refuses it
    from hpcrl.trainers.builtin import BuiltinTrainer

    assert BuiltinTrainer().check_submit(a, 4) is None


@pytest.mark.parametrize("recipe", ["countdown-tiny", "code-tiny", "code-repair-tiny", "smoke"])
def test_cpu_recipes_stay_one_process_on_the_local_site(tmp_path, recipe):
    text = render_recipe(tmp_path, recipe, "--site", "local", "--name", recipe)
    assert "torch.distributed.run" not in text and "HPCRL_STOP_FILE" not in text


@pytest.mark.parametrize("recipe", MAXTEXT_RECIPES)
def test_maxtext_recipe_renders_on_tpu(tmp_path, recipe):
    text = render_recipe(tmp_path, recipe, *TPU, "--name", recipe)
    bash_n(text)
    assert "-m hpcrl.job.maxtext" in text and "chips_per_vm=4" in text  # the launcher runs train_rl
    assert ("loss_algo=gspo-token" in text) == recipe.endswith("gspo")
    assert "srun" not in text and "#SBATCH" not in text
    check_golden(f"recipe-{recipe}-tpu-v5p-8.sh", text)


def test_trainer_adapters_quote_only_through_shell_q():
    """The one quoting path: adapters that build shell text import hpcrl.shell.q, never shlex."""
    for path in sorted((ROOT / "hpcrl" / "trainers").glob("*.py")):
        assert "shlex" not in path.read_text(encoding="utf-8"), f"{path.name}: use hpcrl.shell.q"
    assert "from ..shell import q" in (ROOT / "hpcrl" / "trainers" / "verl.py").read_text(encoding="utf-8")
