"""Every GPU segment starts by checking that the venv's torch sees each GPU it was given
(hpcrl/rl/gpucheck.py), and fails in one line naming the driver's CUDA and the build's.

No GPU here: the torch of this machine is a CPU build, which sees none of the GPUs a job says it
was given (CUDA_VISIBLE_DEVICES), exactly as a CUDA 13 build on a CUDA 12 driver sees none. The
driver's side is a test double: an `nvidia-smi` script on PATH that prints a CUDA 12.4 driver's
banner.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, hpcrl, wait_for_run

BANNER = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.127.08             Driver Version: 550.127.08     CUDA Version: 12.4     |
+-----------------------------------------------------------------------------------------+
"""


def nvidia_smi_double(tmp_path: Path, banner: str = BANNER) -> Path:
    """A directory holding an `nvidia-smi` test double that prints a CUDA 12.4 driver's banner."""
    bin_dir = tmp_path / "driver-bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\ncat <<'EOF'\n{banner}EOF\n", encoding="utf-8")
    tool.chmod(0o755)
    return bin_dir


def gpucheck(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl.rl.gpucheck"], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)


def test_torch_that_cannot_see_the_given_gpus_fails_in_one_line(tmp_path):
    import torch

    env = {**os.environ, "PATH": f"{nvidia_smi_double(tmp_path)}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "0,1"}
    r = gpucheck(env)
    assert r.returncode == 1, r.stdout + r.stderr
    line = r.stdout.strip()
    assert "\n" not in line and line.startswith("GPU check failed: the venv's torch sees 0 of the 2 GPUs given")
    assert "driver CUDA 12.4" in line and f"torch {torch.__version__}" in line and "(a CPU build)" in line


def test_no_gpu_given_and_no_nvidia_smi_fail_too(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = f"{tmp_path}:/usr/bin:/bin"  # no nvidia-smi here
    r = gpucheck(env)
    assert r.returncode == 1 and "was given no GPU" in r.stdout and "driver CUDA unknown" in r.stdout, r.stdout


def test_verdict_names_driver_and_build():
    from hpcrl.gpucheck import gpus_given, verdict

    assert gpus_given({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == 4 and gpus_given({}) == 0
    assert gpus_given({"CUDA_VISIBLE_DEVICES": "-1"}) == 0
    ok, line = verdict(4, "2.11.0+cu130", "13.0", 0, "12.4")
    assert not ok and "sees 0 of the 4 GPUs" in line and "driver CUDA 12.4" in line and "CUDA 13.0" in line
    assert "CUDA <= 12.4" in line
    ok, line = verdict(4, "2.11.0+cu130", "13.0", 4, "13.0")
    assert ok and line.startswith("GPU check passed: torch sees all 4 GPUs")


@pytest.fixture
def gpu_site(home, tmp_path):
    """A local site that says it has 2 GPUs and a CUDA 12.4 driver; the trainer is this machine's
    Python (its CPU torch): what a CUDA 13 venv on a CUDA 12 node amounts to."""
    sites = Path(os.environ["HPCRL_SITES_DIR"])
    (sites / "gpulocal.yaml").write_text(
        "extends: local\ngpus_per_node: 2\ngpu_stack: {driver_cuda: '12.4'}\n"
        f"trainer_python: {sys.executable}\n", encoding="utf-8")
    return "gpulocal"


def test_segment_whose_torch_cannot_see_its_gpus_ends_failed_and_status_says_why(gpu_site, tmp_path):
    spec = tmp_path / "spec.yaml"
    hpcrl("init", "--recipe", "countdown-tiny", "--out", spec)
    env = {"PATH": f"{nvidia_smi_double(tmp_path)}:{os.environ['PATH']}"}
    hpcrl("submit", spec, "--site", gpu_site, "--name", "nogpu", "--hours", "0.1",
          "--set", "env.CUDA_VISIBLE_DEVICES=0,1", env=env)
    state = wait_for_run("nogpu", timeout=180)
    assert state["state"] == "FAILED", state
    status = hpcrl("status", "nogpu").stdout
    assert "GPU check failed: the venv's torch sees 0 of the 2 GPUs given" in status, status
    assert "driver CUDA 12.4" in status, status
    from hpcrl.runs import Run

    run = Run.by_id("nogpu")
    assert not list(run.layout.root.glob("metrics*.jsonl")) or not run.layout.metrics.read_text().strip(), \
        "the trainer must not have started"


def test_gpu_check_is_rendered_only_for_gpu_trainers_on_sites_that_state_their_driver(gpu_site, tmp_path):
    spec = tmp_path / "spec.yaml"
    hpcrl("init", "--recipe", "countdown-tiny", "--out", spec)
    assert "-m hpcrl.rl.gpucheck" in hpcrl("render", spec, "--site", gpu_site).stdout
    assert "-m hpcrl.rl.gpucheck" not in hpcrl("render", spec, "--site", "local").stdout
    assert "-m hpcrl.rl.gpucheck" not in hpcrl("render", "--trainer", "smoke", "--site", gpu_site).stdout


def _pm_site(**gpu_stack):
    from hpcrl import spec

    site = spec.site_as_given("perlmutter", account="m1234_g")
    site["gpu_stack"] = {**site["gpu_stack"], **gpu_stack}
    return site


BUILTIN_VLLM = {"trainer": "builtin", "args": {"rollout": "vllm"}, "requirements": []}


def test_doctor_compares_the_driver_with_the_venvs_torch_build(tmp_path, monkeypatch):
    from hpcrl.doctor import _gpu_driver

    monkeypatch.setenv("PATH", f"{nvidia_smi_double(tmp_path)}:{os.environ['PATH']}")
    monkeypatch.setenv("SCRATCH", str(tmp_path))
    [c] = _gpu_driver(_pm_site(), BUILTIN_VLLM)  # the profile's cu129 build on a 12.4 driver
    assert c.status == "pass" and "driver CUDA 12.4 (nvidia-smi here)" in c.detail and "CUDA 12.9" in c.detail
    [c] = _gpu_driver(_pm_site(cuda_variant="cu130"), BUILTIN_VLLM)  # a CUDA 13 build: the bad case
    assert c.status == "fail" and "built for CUDA 13.0" in c.detail and "supports CUDA 12.4" in c.detail, c
    assert "cuda_variant cu129" in c.fix  # the CUDA 12 build vLLM publishes (hpcrl/artifacts.yaml)
    checks = _gpu_driver(_pm_site(driver_cuda="13.0"), BUILTIN_VLLM)  # the profile disagrees with nvidia-smi
    assert [c.status for c in checks] == ["warn", "pass"] and "nvidia-smi here says CUDA 12.4" in checks[0].detail


def test_doctor_without_nvidia_smi_uses_the_profiles_driver(tmp_path, monkeypatch):
    from hpcrl.doctor import _gpu_driver

    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    [c] = _gpu_driver(_pm_site(cuda_variant="cu130"), BUILTIN_VLLM)
    assert c.status == "fail" and "the site profile; no nvidia-smi here" in c.detail
    assert _gpu_driver({**_pm_site(), "gpus_per_node": 0}, BUILTIN_VLLM) == []


def test_scripts_gpu_check_runs_the_segments_check_and_prints_driver_build_and_verdict(tmp_path):
    """scripts/gpu-check on a CUDA 12.4 driver (test double) with this CPU torch: the three lines,
    and the benchmark does not start (exit 1). On a device with a matching build it passes."""
    double = nvidia_smi_double(tmp_path, BANNER)
    (double / "nvidia-smi").write_text(f"#!/bin/sh\nif [ \"$1\" = -L ]; then echo 'GPU 0: NVIDIA A100 (UUID: a)'; "
                                       f"exit 0; fi\ncat <<'EOF'\n{BANNER}EOF\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = f"{double}:{env['PATH']}"
    r = subprocess.run([str(ROOT / "scripts" / "gpu-check")], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["driver", "CUDA:", "12.4"], lines
    assert lines[1].startswith("torch build CUDA:") and lines[2].startswith("conclusion:       GPU check failed: "
                                                                          "the venv's torch sees 0 of the 1 GPUs given")


def test_doctor_weighs_the_venv_against_venv_roots_quota(tmp_path):
    from hpcrl.doctor import _venv_quota

    site = {**_pm_site(), "venv_root": str(tmp_path / "venvs")}
    spec = {"trainer": "verl", "args": {"rollout": "vllm"}, "requirements": []}
    (tmp_path / "venvs" / "old").mkdir(parents=True)
    (tmp_path / "venvs" / "old" / "blob").write_bytes(b"x" * 1_000_000)
    [c] = _venv_quota({**site, "gpu_stack": {**site["gpu_stack"], "venv_quota_gb": 1}}, spec)
    assert c.status == "fail" and "quota 1 GB" in c.detail and "4.5 GB of wheels" in c.detail, c
    assert "another venv_root" in c.fix and "trainer_python" in c.fix
    [c] = _venv_quota({**site, "gpu_stack": {**site["gpu_stack"], "venv_quota_gb": 10}}, spec)
    assert c.status == "warn" and "~11 GB installed" in c.detail, c  # 10 GB: the wheels fit, installed not
    [c] = _venv_quota({**site, "gpu_stack": {**site["gpu_stack"], "venv_quota_gb": 100}}, spec)
    assert c.status == "pass"
    # Perlmutter states no fixed quota: its venv_quota commands read the real one (not here)
    assert _venv_quota(site, spec) == []


def test_two_node_perlmutter_render_sets_up_nccl_and_one_node_does_not(tmp_path):
    from test_recipes_render import PERLMUTTER, render_recipe
    from test_render import PY

    two = render_recipe(tmp_path, "tinyzero-countdown-grpo", *PERLMUTTER, "--name", "n2", "--nodes", "2", PY)
    block = two[two.index("# NCCL across nodes"):]
    block = block[:block.index("\n\n")]
    assert block.splitlines()[1:] == ["module load nccl", "export FI_CXI_DISABLE_HOST_REGISTER=1",
                                      "export FI_MR_CACHE_MONITOR=userfaultfd", "export NCCL_CROSS_NIC=1",
                                      "export NCCL_NET_GDR_LEVEL=PHB", "export NCCL_SOCKET_IFNAME=hsn"], block
    assert two.index("module load nccl") < two.index("-m hpcrl.job.verl")  # before Ray and the trainer start
    (tmp_path / "one").mkdir()
    one = render_recipe(tmp_path / "one", "tinyzero-countdown-grpo", *PERLMUTTER, "--name", "n1", PY)
    assert "NCCL_SOCKET_IFNAME" not in one and "module load nccl" not in one


def test_doctor_says_whether_the_nccl_plugin_would_be_found(tmp_path, monkeypatch):
    from hpcrl.doctor import _nccl_plugin

    site = {**_pm_site(), "modules": []}
    site["gpu_stack"] = {**site["gpu_stack"], "nccl": {**site["gpu_stack"]["nccl"], "modules": []}}
    lib = tmp_path / "aws-ofi-nccl" / "lib"
    lib.mkdir(parents=True)
    monkeypatch.setenv("LD_LIBRARY_PATH", str(lib))
    [c] = _nccl_plugin(site)
    assert c.status == "warn" and "NCCL would use TCP sockets" in c.detail and "aws-ofi-nccl" in c.fix
    (lib / "libnccl-net.so").write_bytes(b"")
    [c] = _nccl_plugin(site)
    assert c.status == "pass" and str(lib / "libnccl-net.so") in c.detail
    [c] = _nccl_plugin(_pm_site())  # no `module` command here: said, not guessed
    assert c.status == "warn" and "module load python nccl" in c.detail


def test_a_users_site_file_overrides_the_driver_and_the_build(home, tmp_path):
    """A node whose driver runs CUDA 13 (R580+): the user's site file says so and drops the CUDA 12
    variant, and the venv installs the default index's builds; the NCCL set-up stays."""
    sites = Path(os.environ["HPCRL_SITES_DIR"])
    (sites / "pm13.yaml").write_text("extends: perlmutter\ngpu_stack:\n  driver_cuda: '13.0'\n  cuda_variant: null\n",
                                     encoding="utf-8")
    from hpcrl import spec, venv

    resolved = spec.resolve(str(ROOT / "hpcrl" / "recipes" / "gsm8k-grpo.yaml"), "pm13",
                            flags={"account": "m1234_g", "hours": 4})
    stack_facts = resolved["site"]["gpu_stack"]
    assert stack_facts["driver_cuda"] == "13.0" and stack_facts["nccl"]["env"]["NCCL_SOCKET_IFNAME"] == "hsn"
    reqs = venv.requirements(resolved)
    assert "vllm==0.24.0" in reqs and "torch==2.11.0" in reqs and not any(r.startswith("--") for r in reqs)
    resolved = spec.resolve(str(ROOT / "hpcrl" / "recipes" / "gsm8k-grpo.yaml"), "perlmutter",
                            flags={"account": "m1234_g", "hours": 4})
    assert "torch==2.11.0+cu129" in venv.requirements(resolved)


def test_verl_attention_defaults_to_sdpa_and_a_users_own_override_wins():
    from hpcrl.trainers.verl import VerlTrainer

    from helpers import adapter_context

    t = VerlTrainer()
    base = {"model": "/m", "train_files": "/t.parquet", "val_files": "/v.parquet", "algorithm": "ppo"}
    ov = t.overrides(adapter_context(t, t.validate_args(base), "/run"))
    for role in ("actor_rollout_ref", "critic"):
        assert f"+{role}.model.override_config.attn_implementation=sdpa" in ov
        assert f"{role}.model.use_remove_padding=False" in ov
    assert "flash-attn" not in t.runtime_packages(t.validate_args(base))
    mine = "+actor_rollout_ref.model.override_config.attn_implementation=eager"
    ov = t.overrides(adapter_context(t, t.validate_args({**base, "overrides": [mine]}), "/run"))
    assert mine in ov and "+actor_rollout_ref.model.override_config.attn_implementation=sdpa" not in ov
    flash = t.validate_args({**base, "attention": "flash_attention_2"})
    assert "flash-attn" in t.runtime_packages(flash)
    assert not any("attn_implementation" in o for o in t.overrides(adapter_context(t, flash, "/run")))


@pytest.mark.parametrize("required", ["1", None])
def test_the_builtin_trainer_never_falls_back_to_the_cpu_on_a_gpu_site(monkeypatch, tmp_path, required):
    from hpcrl.rl import policy

    monkeypatch.setenv("PATH", f"{nvidia_smi_double(tmp_path)}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    if required:
        monkeypatch.setenv("HPCRL_GPUS_REQUIRED", required)
        with pytest.raises(policy.NoGPU, match=r"sees 0 of the 4 GPUs given \(driver CUDA 12\.4"):
            policy.pick_device("auto")
    else:  # no GPU site (stand-in GPUs of a test cluster): the CPU, as before
        monkeypatch.delenv("HPCRL_GPUS_REQUIRED", raising=False)
        assert policy.pick_device("auto").type == "cpu"
