"""scripts/gpu-check's CPU path: the same code as on a GPU (the trainer in bf16 compute, timed
phases, a real save and load), on a tiny model, without the packages a device image lacks."""

import json
import os
import subprocess

import pytest

from rl_helpers import REPO


def test_gpu_check_runs_on_cpu_with_only_the_device_images_packages(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    # a device image has torch, transformers, safetensors, pyyaml, jinja2 (and their own
    # dependencies): the trainer's parquet and digest packages and vLLM are made unimportable
    # (None in sys.modules: `import` fails and importlib.util.find_spec answers None, as for a
    # package that is not installed; transformers probes several of them at import)
    (shim / "sitecustomize.py").write_text(
        "import sys\n"
        "for name in ('pandas', 'pyarrow', 'xxhash', 'vllm', 'rich'):\n"
        "    sys.modules[name] = None\n")
    env = {**os.environ, "PYTHONPATH": str(shim), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "gc.json"
    r = subprocess.run([str(REPO / "scripts" / "gpu-check"), "--cpu", "--tiny", "--threads", "1", "--steps", "3",
                        "--work", str(tmp_path / "work"), "--json", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for line in ("step time", "tokens/s", "checkpoint", "GB/s", "peak memory", "rollout", "backward", "optimizer"):
        assert line in r.stdout, (line, r.stdout)
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["steps"] == 3 and res["dtype"] == "bfloat16"
    assert res["step_s"] > 0 and res["response_tokens_per_s"] > 0
    phases = res["phases_s_per_step"]
    assert {"rollout", "forward", "backward", "optimizer", "reward"} <= set(phases)
    assert all(v >= 0 for v in phases.values())
    # the checkpoint is the trainer's own, of the model and AdamW's two moments
    ckpt = sorted((tmp_path / "work" / "run" / "checkpoints").glob("step-*"))[-1]
    size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    assert size == pytest.approx(res["checkpoint_gb"] * 1e9, abs=2)
    assert res["save_gb_per_s"] > 0 and res["load_gb_per_s"] > 0
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(tmp_path / "work" / "model")
    assert res["params"] == sum(p.numel() for p in LlamaForCausalLM(config).parameters())
