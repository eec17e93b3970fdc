"""Loading the policy, turning prompts into token ids, and response log-probabilities."""

from __future__ import annotations

import torch


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_policy(model_dir, device: torch.device, dtype: str = "float32"):
    """(model, tokenizer) from a local HF directory; never reaches the hub."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # progress bars would flood the segment log
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, local_files_only=True, dtype=getattr(torch, dtype)).to(device)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def prompt_text(tokenizer, messages, chat_template="auto") -> str:
    """Chat-formatted when the tokenizer has a template (or forced); else the contents joined."""
    use = bool(getattr(tokenizer, "chat_template", None)) if chat_template == "auto" else bool(chat_template)
    if use:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in messages)


def encode_prompts(tokenizer, examples, chat_template="auto", max_prompt_length=512):
    """Token ids per example; prompts longer than max_prompt_length keep their tail (the question's end)."""
    out = []
    for ex in examples:
        ids = tokenizer(prompt_text(tokenizer, ex["messages"], chat_template), add_special_tokens=False).input_ids
        if tokenizer.bos_token_id is not None and getattr(tokenizer, "add_bos_token", False):
            ids = [tokenizer.bos_token_id] + ids
        out.append(ids[-max_prompt_length:])
    return out


def left_pad(seqs, pad_id: int, device=None):
    """(ids, attention_mask) with sequences right-aligned, as generation expects."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, temperature=1.0):
    """log pi(y_t | x, y_<t) for every response token (B x R), with the positions generate used.

    Position ids come from the attention mask: with left padding the default arange would shift
    every position and the log-probs would not match the sampler's.
    """
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    attn = torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], dim=1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    # only the positions that predict response tokens go through the LM head (a 150k vocabulary
    # over the prompt too would be most of the activation memory)
    keep = response_ids.shape[1] + 1
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False, logits_to_keep=keep).logits
    logits = logits[:, -keep:-1].float() / temperature
    picked = logits.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
