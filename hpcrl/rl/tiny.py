"""A tokenizer and a randomly initialised small Llama built locally (no model hub).

Word-level vocabulary: every whole number up to `max_int` is one token, so a tiny model can copy
numbers from the prompt into its answer. Llama, not Qwen2: transformers 5 rebuilds a Qwen2
byte-level tokenizer on load and would silently corrupt this vocabulary (notes/cpu-ml.md).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]
MARKERS = ["<answer>", "</answer>", "<think>", "</think>"]
PUNCT = list("+-*/()=.,:;?!'\"[]#$%")
WORDS = ("numbers target answer using the create an equation that equals you can use basic arithmetic "
         "operations and each number only be used once show your work in tags return final for example "
         "a conversation between user assistant asks question solves it first thinks about reasoning "
         "process mind then provides with let me solve this step by think output after s").split()


# code-tiny's words, after the numbers so countdown's token ids stay what they were
CODE_WORDS = "def f a b return sum product difference double square".split()


def build_tokenizer(max_int: int = 1000, vocab: str = "countdown"):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_list = SPECIAL + MARKERS + PUNCT + sorted(set(WORDS)) + [str(i) for i in range(max_int + 1)]
    if vocab == "code":
        vocab_list += CODE_WORDS
    elif vocab != "countdown":
        raise ValueError(f"vocab must be 'countdown' or 'code', not {vocab!r}")
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(vocab_list))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Punctuation("isolated"),
        pre_tokenizers.Digits(individual_digits=False),
    ])
    # markers are matched before pre-tokenisation, so "<answer>" stays one token
    tok.add_tokens([AddedToken(m, normalized=False) for m in MARKERS])
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>", padding_side="left")


def build_tiny_model(out_dir, hidden_size: int = 128, layers: int = 2, heads: int = 4,
                     max_int: int = 1000, seed: int = 0, max_positions: int = 256, vocab: str = "countdown",
                     reward_head: bool = False) -> Path:
    """Write tokenizer + randomly initialised LlamaForCausalLM to out_dir (atomically); with
    `reward_head`, a LlamaForSequenceClassification with one label (a tiny reward model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(max_int, vocab)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max_positions, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False, num_labels=1,
    )
    with torch.random.fork_rng():  # deterministic weights without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = (LlamaForSequenceClassification if reward_head else LlamaForCausalLM)(config)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
