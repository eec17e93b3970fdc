#!/usr/bin/env python3
"""Rollout throughput of multi-turn episodes against one turn at equal generated tokens (issue 42).

    .venv/bin/python scripts/bench_multi_turn.py                      # the tiny model
    .venv/bin/python scripts/bench_multi_turn.py --model smollm2 --per-turn 32 --prompts 2 --group 2

The same model, prompts and engine (the trainer's HF rollout, sampling as a step does) in two
environments, through the trainer's own episode runner (hpcrl/rl/episodes.py):
  multi   code-repair, K turns of at most T new tokens each (failing visible tests come back as the
          next turn: the sandbox runs them, the template tokenises the feedback), then the reward
          on the held-out tests;
  one     one-turn, one turn of at most K*T new tokens (the same budget of model tokens), then the
          reward on all the row's tests.
The rounds alternate (one, multi, one, multi, ...), each round a new step's random streams, so both
see the same machine load; the ratio is the median over the rounds of multi's model tokens/s over
one's. Model tokens/s counts the tokens the model sampled (the loss's tokens), over the whole
rollout's wall time: decoding, the environment's tokenisation and sandbox runs, the reward. The
untrained tiny model rarely passes a visible test, so most episodes take all K turns; where one
stops early (its end-of-turn token, or a passing answer) it samples fewer tokens, and the figure
is per token, so that is counted fairly. The generation-only figure leaves the environment's time
(Runner.env_s: its step calls, the reward included) out. Tokens per CPU second (this process's
CPU: the decoding's threads and the environment's Python, not the sandbox's processes) is the
steadier figure on a shared machine, where the wall time of a round depends on its neighbours.
Results: a Markdown table on stdout and --out JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TINY = {"model": "tiny", "tiny_hidden_size": 128, "tiny_layers": 2, "tiny_heads": 4, "tiny_max_int": 20,
        "tiny_vocab": "code", "data": "code-tiny", "code_tiny_train_size": 64, "code_tiny_test_size": 8,
        "chat_template": False, "prompt_template": "base", "reward": "code", "temperature": 1.0}
SMOLLM2 = {"model": "smollm2", "reward": "code", "temperature": 0.7, "max_prompt_length": 160}
C2PY = REPO / "tests" / "data" / "c2py.jsonl"


def c2py_rows() -> list[dict]:
    """tests/data/c2py.jsonl as `hpcrl data convert` writes it in test_smollm2_repair.py."""
    rows = []
    for i, line in enumerate(C2PY.read_text(encoding="utf-8").splitlines()):
        r = json.loads(line)
        rows.append({"messages": [{"role": "system", "content": "Reply with one ```python block."},
                                  {"role": "user", "content": f"Translate this C function to Python:\n```c\n"
                                                              f"{r['c_code']}\n```"}],
                     "data_source": "code", "ground_truth": json.dumps({"tests": r["py_tests"]}),
                     "extra_info": {"split": "train", "index": i}})
    return rows


def setup(args, work: Path):
    import torch

    from hpcrl.rl import config, data as rl_data, policy, prepare

    base = TINY if args.model == "tiny" else SMOLLM2
    cfg = config.resolve({**base, "threads": args.threads, "seed": 0})
    torch.set_num_threads(args.threads)
    model_dir = prepare.prepare_model(cfg, work)
    rows = (rl_data.load_examples(prepare.prepare_data(cfg, work)[0]) if args.model == "tiny" else c2py_rows())
    model, tok = policy.load_policy(model_dir, torch.device("cpu"))
    model.eval()
    return base, model, tok, rows[:args.prompts]


def rollout(base, model, tok, rows, env_name: str, per_turn: int, turns: int, group: int, step: int,
            threads: int) -> dict:
    """One step's rollout in `env_name`: its figures."""
    import torch

    from hpcrl import envs
    from hpcrl.rewards import mix
    from hpcrl.rl import config, episodes, policy
    from hpcrl.rl.dist import generator
    from hpcrl.rl.rollout import HFRollout

    multi = env_name != "one-turn"
    over = ({"env": env_name, "env_max_turns": turns, "env_max_tokens": 4096, "max_response_length": per_turn}
            if multi else {"env": "one-turn", "max_response_length": per_turn * turns})
    cfg = config.resolve({**base, **over, "group_size": group, "threads": threads, "seed": 0})
    reward = mix.Reward(cfg)

    def score(rows_, texts, whole_batch=False):
        values, metrics = reward(rows_, texts)
        return values, metrics, reward.details

    env = envs.load(cfg, score)
    engine = HFRollout(model, tok, cfg["temperature"], cfg["top_p"], cfg["max_response_length"],
                       record_logprobs=False)
    template = episodes.uses_template(tok, cfg["chat_template"])
    prompts = policy.encode_prompts(tok, rows, cfg["chat_template"], cfg["max_prompt_length"])
    runner = episodes.Runner(engine, env, tok, episodes.Budget(cfg, env.multi_turn), template)

    def streams(turn, keys):
        keys = [(p,) for p in range(len(rows))] if keys is None else [(p, "turn", turn, j) for p, j in keys]
        return {"generators": [generator(torch.device("cpu"), 0, step, *k) for k in keys]}

    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        batch, eps = runner.run(rows, prompts, group, streams)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    model_tokens = int(batch.response_mask.sum().item())
    return {"env": env_name, "wall_s": wall, "env_s": runner.env_s, "model_tokens": model_tokens,
            "env_tokens": sum(ep.env_tokens for ep in eps), "turns_mean": sum(ep.turns for ep in eps) / len(eps),
            "tok_s": model_tokens / wall, "gen_tok_s": model_tokens / max(1e-9, wall - runner.env_s),
            "cpu_s": cpu, "tok_cpu_s": model_tokens / cpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    ap.add_argument("--per-turn", type=int, nargs="+", default=[4, 16], help="T: new tokens a turn, at most")
    ap.add_argument("--turns", type=int, nargs="+", default=[2, 3], help="K: model turns an episode, at most")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    results = []
    with tempfile.TemporaryDirectory(prefix="bench-mt-") as tmp:
        base, model, tok, rows = setup(args, Path(tmp))
        # one untimed rollout of each first: the sandbox's fork server, the first calls' allocations
        for env_name in ("one-turn", "code-repair"):
            rollout(base, model, tok, rows, env_name, args.per_turn[0], 2, args.group, 10_000, args.threads)
        for per_turn in args.per_turn:
            for turns in args.turns:
                rounds = []
                for r in range(args.rounds):
                    one = rollout(base, model, tok, rows, "one-turn", per_turn, turns, args.group, r, args.threads)
                    multi = rollout(base, model, tok, rows, "code-repair", per_turn, turns, args.group, r,
                                    args.threads)
                    rounds.append({"one": one, "multi": multi, "ratio": multi["tok_s"] / one["tok_s"],
                                   "gen_ratio": multi["gen_tok_s"] / one["gen_tok_s"],
                                   "cpu_ratio": multi["tok_cpu_s"] / one["tok_cpu_s"]})
                    print(f"T={per_turn} K={turns} round {r + 1}: one {one['model_tokens']} tok "
                          f"{one['tok_s']:.0f} tok/s (env {one['env_s']:.2f} s), "
                          f"multi {multi['model_tokens']} tok {multi['tok_s']:.0f} tok/s "
                          f"(turns {multi['turns_mean']:.2f}, env {multi['env_s']:.2f} s)", file=sys.stderr)
                med = lambda key, side=None: statistics.median(x[key] if side is None else x[side][key]
                                                              for x in rounds)
                results.append({"per_turn": per_turn, "turns": turns, "rounds": rounds,
                                "one_tokens": med("model_tokens", "one"), "multi_tokens": med("model_tokens", "multi"),
                                "one_tok_s": med("tok_s", "one"), "multi_tok_s": med("tok_s", "multi"),
                                "turns_mean": med("turns_mean", "multi"), "env_tokens": med("env_tokens", "multi"),
                                "multi_env_s": med("env_s", "multi"), "one_env_s": med("env_s", "one"),
                                "ratio": med("ratio"), "gen_ratio": med("gen_ratio"), "cpu_ratio": med("cpu_ratio")})

    n = args.prompts * args.group
    print(f"\n{args.model}, {n} episodes ({args.prompts} prompts x {args.group}), {args.rounds} rounds, "
          f"{args.threads} threads; medians\n")
    print("| T x K | one-turn: tokens, tok/s | multi-turn: tokens, turns, env tokens, tok/s "
          "| multi / one tok/s | generation only | multi / one tok per CPU s |")
    print("|---|---|---|---|---|---|")
    for x in results:
        print(f"| {x['per_turn']} x {x['turns']} | {x['one_tokens']:.0f}, {x['one_tok_s']:.0f} "
              f"| {x['multi_tokens']:.0f}, {x['turns_mean']:.2f}, {x['env_tokens']:.0f}, {x['multi_tok_s']:.0f} "
              f"| {x['ratio']:.2f} | {x['gen_ratio']:.2f} | {x['cpu_ratio']:.2f} |")
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "episodes": n, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
