#!/usr/bin/env python3
"""The built-in trainer vs TRL's GRPOTrainer, same run, interleaved, with where the time goes.

    .venv/bin/python scripts/bench_trl.py --trl-python /tmp/trl-venv/bin/python --config tiny --steps 200 --repeats 3
    .venv/bin/python scripts/bench_trl.py --trl-python /tmp/trl-venv/bin/python --config smollm2 --steps 8 --repeats 2
    # TRL in its own venv (never in the project's test dependencies):
    #   python3 -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install 'torch==2.13.0' 'trl==1.16.0' \
    #       'transformers>=5.0,<5.20' pandas pyarrow xxhash

Configs:
- tiny: scripts/bench_rl.py's (the countdown-tiny recipe's warmed-up 0.6 M-parameter Llama,
  2-number Countdown, 8 prompts x 8, 8 new tokens, lr 5e-4, beta 0.04).
- smollm2: the smollm2-arithmetic recipe's (SmolLM2-135M-Instruct from `hpcrl model smollm2`,
  "What is a + b?" with its chat template, 4 prompts x 8, 12 new tokens, temperature 0.7,
  lr 2e-5, beta 0), in float32 for both (bf16 matmuls are slower than fp32 on a CPU).
Both trainers: same model files, data rows, group, batch, completion length, temperature, lr
(constant), token-mean loss (TRL loss_type "dapo"), one update per batch, max_grad_norm 1.
Steps/s counts training steps only. Each step's time is split by wrapping the calls each trainer
makes (generation, forward, backward, optimizer step, reward) in one timer that does not count a
call inside another twice; "other" is the rest of the step. Greedy evaluation of both final
models by the same code on the same held-out rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

CONFIGS = {
    "tiny": {"batch_size": 8, "group_size": 8, "lr": 5e-4, "beta": 0.04, "max_response_length": 8,
             "temperature": 1.0, "threads": 2, "seed": 0, "eval_size": 128, "dtype": "float32"},
    "smollm2": {"batch_size": 4, "group_size": 8, "lr": 2e-5, "beta": 0.0, "max_response_length": 12,
                "max_prompt_length": 64, "temperature": 0.7, "threads": 2, "seed": 0, "eval_size": 32,
                "eval_batch_size": 32, "dtype": "float32"},
}


def prepare(name: str, work: Path) -> tuple[Path, Path, Path]:
    """(model dir, train rows, test rows) shared by both trainers."""
    if name == "tiny":
        from bench_rl import setup

        return setup(work)
    from hpcrl.rl import data, smollm2

    model = smollm2.ensure(work / "smollm2")[0]
    train, test = data.arithmetic_rows(512, 32, seed=0)
    paths = work / "train.parquet", work / "test.parquet"
    data.write_parquet(train, paths[0])
    data.write_parquet(test, paths[1])
    return model, *paths


def knobs(name: str) -> dict:
    return dict(CONFIGS[name])


# ------------------------------------------------------------------ built-in (in this process)

def run_builtin(name: str, model: Path, train: Path, test: Path, steps: int, work: Path) -> dict:
    from gpu_check import Phases, instrument

    from hpcrl import protocol
    from hpcrl.rl import config
    from hpcrl.rl.loop import RLTrainer

    work.mkdir(parents=True, exist_ok=True)
    cfg = config.resolve({**knobs(name), "model": str(model), "data": "files", "train_files": str(train),
                          "val_files": str(test), "total_steps": steps, "save_every": 0, "eval_before": False,
                          "eval_after": False, "async_save": False, "keep_last": 1})
    ctx = protocol.Context(work, work / "checkpoints", 1, None, work / "metrics.jsonl")
    trainer = RLTrainer(cfg, ctx, protocol.StopFlag(ctx, install=False))
    phases = Phases(trainer.device)
    undo = instrument(trainer, phases)
    try:
        trainer.run()
    finally:
        undo()
    recs = [json.loads(x) for x in ctx.metrics_path.read_text().splitlines()]
    train_recs = [r for r in recs if r.get("phase") == "train"]
    train_s = sum(r["step_time_s"] for r in train_recs)
    tail = train_recs[-max(1, steps // 5):]
    out = {"steps": len(train_recs), "train_s": train_s, "steps_per_s": len(train_recs) / train_s,
           "reward_last20pct": sum(r["reward_mean"] for r in tail) / len(tail),
           "phases_s_per_step": per_step(phases.secs, train_s, len(train_recs))}
    out.update(greedy_eval(trainer.model, trainer.tok, test, cfg))
    return out


def per_step(secs: dict, train_s: float, steps: int) -> dict:
    out = {k: v / steps for k, v in secs.items()}
    out["other"] = max(0.0, train_s / steps - sum(out.values()))
    return out


def greedy_eval(model, tok, test: Path, cfg: dict) -> dict:
    """The same greedy evaluation for both trainers' final models: the built-in rollout engine,
    prompts as the trainer encodes them, the rows' own reward."""
    from hpcrl.rewards import score as rewards
    from hpcrl.rl import data, policy
    from hpcrl.rl.rollout import HFRollout

    ex = data.load_examples(test)[:cfg["eval_size"]]
    ids = policy.encode_prompts(tok, ex, chat_template="auto", max_prompt_length=cfg.get("max_prompt_length", 512))
    texts = HFRollout(model, tok, max_new_tokens=cfg["max_response_length"]).generate(ids, greedy=True).texts
    scores = [float(rewards.compute_score(e["data_source"], t, e["ground_truth"])) for t, e in zip(texts, ex)]
    return {"eval_reward": sum(scores) / len(scores), "eval_accuracy": sum(s >= 1 for s in scores) / len(scores)}


# ------------------------------------------------------------------ TRL (in its own venv)

def run_trl(trl_python: str, name: str, model: Path, train: Path, test: Path, steps: int, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    out = work / "trl.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "WANDB_DISABLED": "true"}
    res = subprocess.run([trl_python, __file__, "--trl-worker", name, str(model), str(train), str(test), str(steps),
                          str(out)], env=env, capture_output=True, text=True)
    if res.returncode != 0:
        return {"error": res.stderr[-3000:]}
    return json.loads(out.read_text())


def trl_worker(name: str, model_dir: str, train: str, test: str, steps: int, out: str) -> None:
    import torch
    import trl
    from datasets import Dataset
    from gpu_check import Phases
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from hpcrl.rewards import score as rewards
    from hpcrl.rl import data

    k = knobs(name)
    torch.set_num_threads(k["threads"])
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ex = data.load_examples(train)
    chat = bool(getattr(tok, "chat_template", None))
    # conversational rows: TRL applies the chat template (with the generation prompt) itself
    ds = Dataset.from_list([{"prompt": e["messages"] if chat else e["messages"][0]["content"],
                             "gt": json.dumps(e["ground_truth"]), "ds": e["data_source"]} for e in ex])
    phases = Phases(torch.device("cpu"))

    def reward(completions, gt, ds, **_):
        with phases.timed("reward"):
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            return [float(rewards.compute_score(d, t, json.loads(g))) for t, g, d in zip(texts, gt, ds)]

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, *a, **kw):
            self.t0 = time.monotonic()

        def on_step_end(self, *a, **kw):
            self.times.append(time.monotonic() - self.t0)

    timer = Timer()
    trainer = trl.GRPOTrainer(model=model, processing_class=tok, reward_funcs=reward, train_dataset=ds,
                              args=trl_config(trl, k, steps, Path(out).parent / "trl-out"), callbacks=[timer])
    phases.wrap(trainer.model, "generate", "rollout")
    real_forward = trainer.model.forward

    def forward(*a, **kw):
        with phases.timed("forward"):
            return real_forward(*a, **kw)
    trainer.model.forward = forward
    if getattr(trainer, "ref_model", None) is not None:  # beta > 0: the reference's forward
        phases.wrap(trainer.ref_model, "forward", "reference forward")
    real_backward, real_step = torch.Tensor.backward, torch.optim.AdamW.step

    def backward(self, *a, **kw):
        with phases.timed("backward"):
            return real_backward(self, *a, **kw)

    def step(self, *a, **kw):
        with phases.timed("optimizer"):
            return real_step(self, *a, **kw)
    torch.Tensor.backward, torch.optim.AdamW.step = backward, step
    trainer.train()
    rew = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    tail = rew[-max(1, steps // 5):]
    train_s = sum(timer.times)
    result = {"trl_version": trl.__version__, "steps": len(timer.times), "train_s": train_s,
              "steps_per_s": len(timer.times) / train_s, "reward_last20pct": sum(tail) / len(tail),
              "phases_s_per_step": per_step(phases.secs, train_s, len(timer.times))}
    result.update(greedy_eval(trainer.model, tok, Path(test), k))
    Path(out).write_text(json.dumps(result))


def trl_config(trl, k: dict, steps: int, output_dir: Path):
    """The built-in run's settings in TRL's terms: loss_type "dapo" is a mean over all tokens of
    the batch (the built-in grpo's token-mean); per_device_train_batch_size counts completions."""
    return trl.GRPOConfig(
        output_dir=str(output_dir), use_cpu=True, bf16=False, gradient_checkpointing=False, report_to=[],
        save_strategy="no", logging_steps=1, max_steps=steps, seed=k["seed"],
        per_device_train_batch_size=k["batch_size"] * k["group_size"], num_generations=k["group_size"],
        max_completion_length=k["max_response_length"], learning_rate=k["lr"], lr_scheduler_type="constant",
        warmup_steps=0, beta=k["beta"], loss_type="dapo", temperature=k["temperature"], top_k=0, top_p=1.0,
        max_grad_norm=1.0, weight_decay=0.0, dataloader_num_workers=0)


# ------------------------------------------------------------------ report

def median_run(runs: list) -> dict:
    ok = [r for r in runs if "steps_per_s" in r]
    if not ok:
        return runs[0]
    best = sorted(ok, key=lambda r: r["steps_per_s"])[len(ok) // 2]
    return {**best, "all_steps_per_s": [round(r["steps_per_s"], 3) for r in ok]}


def report(name: str, res: dict) -> str:
    b, t = res["builtin"], res.get("trl", {})
    if "error" in t:
        return f"TRL failed:\n{t['error']}"
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = [f"config {name}: {json.dumps(CONFIGS[name])}", "",
             f"| | built-in | TRL {t.get('trl_version', '')} GRPOTrainer |", "|---|---|---|",
             f"| steps / s of each repeat | {b.get('all_steps_per_s')} | {t.get('all_steps_per_s', '-')} |"]
    for key, label in (("steps_per_s", "steps / s, median"), ("reward_last20pct", "train reward, last 20% of steps"),
                       ("eval_reward", "greedy eval reward (same code, same rows)")):
        lines.append(f"| {label} | {fmt(b.get(key))} | {fmt(t.get(key, '-'))} |")
    keys = sorted(set(b["phases_s_per_step"]) | set(t.get("phases_s_per_step", {})),
                  key=lambda x: -b["phases_s_per_step"].get(x, 0))
    for key in keys:
        lines.append(f"| s / step: {key} | {b['phases_s_per_step'].get(key, 0):.4f} | "
                     f"{t.get('phases_s_per_step', {}).get(key, 0):.4f} |")
    if "steps_per_s" in t:
        paired = [round(x / y, 2) for x, y in zip(b["all_steps_per_s"], t["all_steps_per_s"])]
        lines.append(f"\nspeed ratio built-in / TRL: **{b['steps_per_s'] / t['steps_per_s']:.2f}x** (ratio of the "
                     f"medians); paired repeats {paired}, median **{statistics.median(paired):.2f}x**")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        trl_worker(sys.argv[2], *sys.argv[3:6], int(sys.argv[6]), sys.argv[7])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats (built-in, TRL, built-in, ...)")
    ap.add_argument("--trl-python", help="python of a venv with trl 1.16 (omit: the built-in trainer alone)")
    ap.add_argument("--out", default="bench_trl.json")
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hpcrl-bench-trl-") as tmp:
        work = Path(tmp)
        model, train, test = prepare(ns.config, work)
        runs = {"builtin": [], "trl": []}
        for i in range(ns.repeats):
            runs["builtin"].append(run_builtin(ns.config, model, train, test, ns.steps, work / f"b{i}"))
            print(f"built-in repeat {i}: {runs['builtin'][-1]['steps_per_s']:.3f} steps/s", file=sys.stderr)
            if ns.trl_python:
                runs["trl"].append(run_trl(ns.trl_python, ns.config, model, train, test, ns.steps, work / f"t{i}"))
                print(f"TRL repeat {i}: {runs['trl'][-1].get('steps_per_s', runs['trl'][-1])}", file=sys.stderr)
    res = {k: median_run(v) for k, v in runs.items() if v}
    Path(ns.out).write_text(json.dumps({"config": ns.config, "knobs": CONFIGS[ns.config], **res}, indent=1))
    print(report(ns.config, res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
