"""The vLLM engine's placement and settings per rank, without vLLM (a pure function of the run's
shape: hpcrl/rl/vllm_rollout.engine_args). vLLM itself runs in the vLLM tier (test_vllm_tier.py)."""

import pytest

from hpcrl.rl import config
from hpcrl.rl.vllm_rollout import engine_args

CFG = config.resolve({"rollout": "vllm", "dtype": "bfloat16", "max_prompt_length": 256, "max_response_length": 1024,
                      "seed": 7})


def test_under_a_world_of_two_each_rank_gets_its_own_engine_on_its_own_device():
    """Without a distributed executor backend vLLM's uni-process executor takes local rank 0 and
    sets the current device to it: every rank's engine on GPU 0 (issue 27). The external launcher
    joins the trainer's process group and takes LOCAL_RANK's device."""
    got = [engine_args(CFG, "/models/q", world=2, rank=r, local_rank=r, device_type="cuda", gpu_memory_utilization=0.3)
           for r in (0, 1)]
    for rank, (kwargs, env) in enumerate(got):
        assert kwargs["distributed_executor_backend"] == "external_launcher"
        assert kwargs["tensor_parallel_size"] == 1
        assert env["LOCAL_RANK"] == str(rank) and env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # external_launcher requires it; the sync is in-process
        assert kwargs["model"] == "/models/q" and kwargs["dtype"] == "bfloat16" and kwargs["max_model_len"] == 1280
        assert kwargs["gpu_memory_utilization"] == 0.3
        assert kwargs["enforce_eager"] is False and kwargs["enable_sleep_mode"] is True  # CUDA graphs, sleep
    assert got[0][0]["seed"] != got[1][0]["seed"]  # independent engines


def test_one_process_and_the_cpu():
    kwargs, env = engine_args(CFG, "/m", world=1, rank=0, local_rank=0, device_type="cpu", gpu_memory_utilization=0.4)
    assert "distributed_executor_backend" not in kwargs and "LOCAL_RANK" not in env
    # vLLM's CPU backend has neither CUDA graphs nor sleep mode
    assert kwargs["enforce_eager"] is True and kwargs["enable_sleep_mode"] is False


def test_tensor_parallel_groups_share_a_seed_and_must_divide_the_ranks():
    cfg = {**CFG, "vllm_tensor_parallel_size": 2}
    seeds = [engine_args(cfg, "/m", world=4, rank=r, local_rank=r, device_type="cuda", gpu_memory_utilization=0.5)[0]
             for r in range(4)]
    assert all(k["tensor_parallel_size"] == 2 and k["distributed_executor_backend"] == "external_launcher" for k in seeds)
    assert [k["seed"] for k in seeds] == [7, 7, 8, 8]
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size = 3 does not divide the 4 ranks"):
        engine_args({**CFG, "vllm_tensor_parallel_size": 3}, "/m", world=4, rank=0, local_rank=0, device_type="cuda",
                    gpu_memory_utilization=0.5)


def test_the_engine_bounds_its_step_and_sequences_as_trls_colocate_mode():
    """Issue 39: TRL's colocate mode sets max_num_batched_tokens=4096 ("Latest vLLM v1 memory
    profiler is misled by the high default value (i.e., 32768) - thinking there's not enough
    memory") and max_num_seqs to the rank's generation batch. hpcrl derives a tight
    gpu_memory_utilization, so it bounds both the same way (the profile runs a step at once)."""
    from hpcrl.rl import memory

    cfg = {**CFG, "batch_size": 16, "group_size": 8, "eval_batch_size": 32, "eval_size": 64}
    kwargs, _ = engine_args(cfg, "/m", world=2, rank=0, local_rank=0, device_type="cuda", gpu_memory_utilization=0.3)
    assert kwargs["max_num_batched_tokens"] == memory.BATCHED_TOKENS == 4096
    assert kwargs["max_num_seqs"] == 64  # this rank's 8 prompts x 8, as many as its evaluation batch
    tp, _ = engine_args({**cfg, "vllm_tensor_parallel_size": 2}, "/m", world=2, rank=0, local_rank=0,
                        device_type="cuda", gpu_memory_utilization=0.3)
    assert tp["max_num_seqs"] == 128  # the group's engine generates both ranks' rows
    # a long context is still one bounded step (chunked prefill, vLLM V1's default, splits it)
    long, _ = engine_args({**cfg, "max_prompt_length": 4096, "max_response_length": 4096}, "/m", world=2, rank=0,
                          local_rank=0, device_type="cuda", gpu_memory_utilization=0.3)
    assert long["max_model_len"] == 8192 and long["max_num_batched_tokens"] == 4096
    # vLLM refuses a step budget below its sequence count: the bound gives way to it
    many, _ = engine_args({**cfg, "batch_size": 1024}, "/m", world=1, rank=0, local_rank=0, device_type="cpu",
                          gpu_memory_utilization=0.3)
    assert many["max_num_seqs"] == 8192 and many["max_num_batched_tokens"] == 8192


def test_the_derived_share_keeps_room_for_vllms_start_up_profile_at_that_bound(monkeypatch):
    """The share hpcrl derives (gpu_memory_utilization) holds, beside the weights, the KV cache and
    the overhead, what vLLM's profile takes out of it at start-up: a step of BATCHED_TOKENS and the
    sampler's logits for max_num_seqs rows. A larger step would need a larger share."""
    import types

    from hpcrl.rl import memory

    shape = types.SimpleNamespace(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, vocab_size=151_936,
                                  num_attention_heads=14, num_key_value_heads=2)
    n, tokens, rows, gib = 494_032_768, 1024, 64, 2 ** 30
    bare = n * 2 + rows * tokens * memory.kv_bytes_per_token(shape, "bfloat16") + memory.ENGINE_OVERHEAD
    profile = memory.profile_bytes(shape, rows, "bfloat16")
    assert profile > 4096 * 3 * 4864 * 2 + 3 * rows * 151_936 * 4  # the MLP's step, the sampler's float32 logits
    assert memory.engine_bytes(shape, n, "bfloat16", rows, tokens) == bare + profile
    cfg = {**CFG, "batch_size": 16, "group_size": 8, "eval_batch_size": 32, "eval_size": 64,
           "max_prompt_length": 512, "max_response_length": 512, "micro_batch_size": 4,
           "gradient_checkpointing": False}
    device = 40 * gib
    share, util = memory.engine_plan(shape, [151_936 * 896, n - 151_936 * 896], cfg, 2, False, True, device)
    assert share == bare + profile and util == pytest.approx(share / device, abs=0.01)
    monkeypatch.setattr(memory, "BATCHED_TOKENS", 32768)  # vLLM's old offline default
    wide, wide_util = memory.engine_plan(shape, [151_936 * 896, n - 151_936 * 896], cfg, 2, False, True, device)
    assert wide - share == (32768 - 4096) * (profile - 3 * rows * 151_936 * 4) // 4096 and wide_util > util


class _LLMDouble:
    """TEST DOUBLE of vllm.LLM on a GPU (neither exists here): records the calls the rollout makes."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def collective_rpc(self, method, kwargs):
        self.calls.append((method, [name for name, _ in kwargs["weights_iterator"]]))

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, params, use_tqdm=False):
        from types import SimpleNamespace

        self.calls.append(("generate", len(prompts)))
        out = SimpleNamespace(token_ids=[3], logprobs=None)
        return [SimpleNamespace(outputs=[out] * params[0].n) for _ in prompts]


def _vllm_double(monkeypatch):
    import sys
    import types

    from types import SimpleNamespace

    mod = types.ModuleType("vllm")
    mod.LLM = _LLMDouble
    mod.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: prompt_token_ids
    mod.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_engine_sleeps_through_the_update_and_wakes_for_the_sync_and_generation(monkeypatch, tmp_path, device):
    """On a GPU: level 2 (weights and KV cache freed: the sync rewrites every weight) before the
    update, the weights woken for the sync, the KV cache only for the next generation. vLLM's
    CPU worker has no sleep mode: no call at all."""
    import torch

    from hpcrl.rl.tiny import build_tokenizer
    from hpcrl.rl.vllm_rollout import VllmRollout

    _vllm_double(monkeypatch)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(k, raising=False)  # engine_args' environment goes into os.environ
    tok = build_tokenizer(20)
    engine = VllmRollout(tmp_path, tok, CFG, torch.device(device), gpu_memory_utilization=0.3)
    engine.device = torch.device("cpu")  # where the batch tensors go (no CUDA in this torch)
    engine.generate([[5, 6]], n=2)
    engine.release()
    engine.release()  # twice (an update with nothing to release): one sleep
    engine.sync_weights(iter([("w", torch.zeros(2))]))
    engine.generate([[5, 6]], n=2, seeds=[1])
    want = ([("generate", 1), ("sleep", 2), ("wake_up", ("weights",)), ("reload_weights", ["w"]),
             ("wake_up", ("kv_cache",)), ("generate", 1)] if device == "cuda" else
            [("generate", 1), ("reload_weights", ["w"]), ("generate", 1)])
    assert engine.llm.calls == want
    assert engine.llm.kwargs["enable_sleep_mode"] is (device == "cuda")
