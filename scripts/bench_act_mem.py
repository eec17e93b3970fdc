#!/usr/bin/env python3
"""Activation memory of the training forward/backward: measured peak vs hpcrl/rl/memory.py's estimate.

    .venv/bin/python scripts/bench_act_mem.py            # prints a markdown table (BENCHMARKS.md)

A Llama of a mid size (hidden 512, SwiGLU 1536, 8 layers, vocabulary 8192 or 65536) in float32 on the CPU,
one training forward/backward through policy.response_logprobs (the full path, as with gradient
checkpointing) of ROWS rows of 64 prompt + 192 response tokens, in a fresh process per case: the
peak RSS above what the process held just before (model, inputs, allocator warmed by a 1-row
pass) against the estimate for those rows, with and without gradient checkpointing, and with the
response logits computed 256 tokens at a time (policy.response_logprobs' chunk_tokens).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=8, vocab_size=8192)
PROMPT, RESPONSE = 64, 192


def case(rows: int, checkpointing: bool, chunk: int, vocab: int = 8192) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO))
    from hpcrl.rl import memory, policy

    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = LlamaForCausalLM(LlamaConfig(**{**SHAPE, "vocab_size": vocab})).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def step(n):
        prompt = torch.randint(0, vocab, (n, PROMPT))
        response = torch.randint(0, vocab, (n, RESPONSE))
        logp = policy.response_logprobs(model, prompt, torch.ones_like(prompt), response,
                                        torch.ones(n, RESPONSE), 0.7, group_size=1, chunk_tokens=chunk)
        logp.sum().backward()
        model.zero_grad(set_to_none=False)  # the gradients' memory stays, as in training

    step(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step(rows)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    est = memory.pass_bytes(model.config, rows, PROMPT, RESPONSE, "float32", checkpointing, chunk or None)
    return {"rows": rows, "checkpointing": checkpointing, "chunk": chunk, "measured": peak - before, "estimate": est}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--case":
        print(json.dumps(case(int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5]))))
        return
    mib = 2 ** 20
    print("| vocabulary | rows | gradient checkpointing | logits at once | measured peak above start | estimate "
          "| estimate / measured |")
    print("|---|---|---|---|---|---|---|")
    cases = [(8192, rows, ckpt, 0) for rows in (4, 8) for ckpt in (False, True)]
    cases += [(65536, 8, ckpt, chunk) for chunk in (0, 256) for ckpt in (False, True)]
    for vocab, rows, ckpt, chunk in cases:
        argv = [sys.executable, __file__, "--case", str(rows), "1" if ckpt else "0", str(chunk), str(vocab)]
        r = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
        print(f"| {vocab} | {rows} | {'yes' if ckpt else 'no'} | {chunk or rows * RESPONSE} tokens "
              f"| {r['measured'] / mib:.0f} MiB | {r['estimate'] / mib:.0f} MiB "
              f"| {r['estimate'] / r['measured']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
