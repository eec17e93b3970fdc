"""The optional supervised warm-up: teaches the answer *format* only, never the solution.

Targets are `<answer> a op b op c </answer>` with the given numbers in a random order and random
operators, chosen without looking at the target - the reward of a model that learned only this
is chance level (a correct equation now and then, the 0.1 format score otherwise). Finding the
equations that hit the target is left to RL.
"""

from __future__ import annotations

import random

import torch

from .policy import left_pad, response_logprobs


def format_target(example: dict, rng: random.Random, ops: str = "+-*/") -> str:
    """A response in the task's format, chosen without looking at the answer: for countdown built
    here; for any other data, one of the row's extra_info.format_targets (a dataset's own list of
    well-formed answers, right or wrong, e.g. every expression of code-tiny's answer space)."""
    choices = (example.get("extra_info") or {}).get("format_targets")
    if example["data_source"] != "countdown":
        if not choices:
            raise ValueError("sft_steps > 0 needs countdown data or rows with extra_info.format_targets "
                             "(a format-only warm-up)")
        return rng.choice(list(choices))
    numbers = list(example["ground_truth"]["numbers"])
    rng.shuffle(numbers)
    expr = str(numbers[0])
    for n in numbers[1:]:
        expr += f" {rng.choice(ops)} {n}"
    return f"<answer> {expr} </answer>"


def sft_loss(model, tokenizer, prompts: list, targets: list, device) -> tuple[torch.Tensor, int]:
    """Mean negative log-likelihood of the target tokens (and eos) given the prompts."""
    p_ids, p_mask = left_pad(prompts, tokenizer.pad_token_id, device)
    resp = [tokenizer(t, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for t in targets]
    width = max(len(r) for r in resp)
    r_ids = torch.full((len(resp), width), tokenizer.pad_token_id, dtype=torch.long)
    r_mask = torch.zeros((len(resp), width))
    for i, r in enumerate(resp):
        r_ids[i, :len(r)] = torch.tensor(r)
        r_mask[i, :len(r)] = 1.0
    r_ids, r_mask = r_ids.to(device), r_mask.to(device)
    logp = response_logprobs(model, p_ids, p_mask, r_ids, r_mask)
    return -(logp * r_mask).sum() / r_mask.sum(), int(r_mask.sum().item())
