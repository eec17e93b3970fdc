#!/usr/bin/env python3
"""Activation memory of the training forward/backward: measured peak vs hpcrl/rl/memory.py's estimate.

    .venv/bin/python scripts/bench_act_mem.py            # prints a markdown table (BENCHMARKS.md)

A Llama of a mid size (hidden 512, SwiGLU 1536, 8 layers, vocabulary 8192) in float32 on the CPU,
one training forward/backward through policy.response_logprobs (the full path, as with gradient
checkpointing) of ROWS rows of 64 prompt + 192 response tokens, in a fresh process per case: the
peak RSS above what the process held just before (model, inputs, allocator warmed by a 1-row
pass) against the estimate for those rows, with and without gradient checkpointing.
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


def case(rows: int, checkpointing: bool) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO))
    from hpcrl.rl import memory, policy

    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def step(n):
        prompt = torch.randint(0, SHAPE["vocab_size"], (n, PROMPT))
        response = torch.randint(0, SHAPE["vocab_size"], (n, RESPONSE))
        logp = policy.response_logprobs(model, prompt, torch.ones_like(prompt), response,
                                        torch.ones(n, RESPONSE), 0.7, group_size=1)
        logp.sum().backward()
        model.zero_grad(set_to_none=False)  # the gradients' memory stays, as in training

    step(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step(rows)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    est = rows * memory.row_bytes(model.config, PROMPT, RESPONSE, "float32", checkpointing)
    return {"rows": rows, "checkpointing": checkpointing, "measured": peak - before, "estimate": est}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--case":
        print(json.dumps(case(int(sys.argv[2]), sys.argv[3] == "1")))
        return
    mib = 2 ** 20
    print("| rows | gradient checkpointing | measured peak above start | estimate | estimate / measured |")
    print("|---|---|---|---|---|")
    for rows in (4, 8):
        for ckpt in (False, True):
            out = subprocess.run([sys.executable, __file__, "--case", str(rows), "1" if ckpt else "0"],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"| {rows} | {'yes' if ckpt else 'no'} | {r['measured'] / mib:.0f} MiB | {r['estimate'] / mib:.0f} MiB "
                  f"| {r['estimate'] / r['measured']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
