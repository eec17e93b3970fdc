#!/usr/bin/env python3
"""Benchmark of the built-in RL trainer, side by side with TRL's GRPOTrainer, in one run.

    .venv/bin/python scripts/bench_rl.py --trl-python /tmp/trl-venv/bin/python --steps 200

1. Setup: the tiny Llama and the 2-number Countdown data of the countdown-tiny recipe, then the
   recipe's format-only warm-up (built-in trainer, sft_steps) -> one warmed-up model for both.
2. RL for --steps steps from that model with the same data, group size, batch, completion length,
   learning rate, temperature and loss: the built-in trainer (a real trainer process) and TRL
   GRPOTrainer (in its own venv: TRL pins its own torch/transformers ranges). Steps/s counts the
   training steps only (rollout + reward + update), not model loading or evaluation.
   Both are then evaluated by the same greedy evaluation on the same test problems.
3. Rollout tokens/s of HF generate (and vLLM where importable).
4. Checkpoint save/load throughput against a raw sequential write/read of the same bytes.
Results: a Markdown table on stdout and --out JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RECIPE = {  # the countdown-tiny recipe's task and RL knobs (kept in step with the YAML by hand)
    "model": "tiny", "tiny_hidden_size": 128, "tiny_layers": 2, "tiny_max_int": 200, "prompt_template": "tiny",
    "countdown_min_count": 2, "countdown_max_count": 2, "countdown_max_number": 9, "countdown_max_target": 100,
    "countdown_ops": "+-*/", "countdown_train_size": 3000, "countdown_test_size": 128,
    "countdown_test_disjoint": False, "batch_size": 8, "group_size": 8, "lr": 5e-4, "beta": 0.04,
    "max_response_length": 8, "eval_size": 128, "threads": 2, "seed": 0,
}


def run_builtin(run_dir: Path, args: dict) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "trainer.json").write_text(json.dumps(args))
    env = {**os.environ, "HPCRL_RUN_DIR": str(run_dir), "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "hpcrl.rl.train", "--config", str(run_dir / "trainer.json")],
                         env=env, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"built-in trainer failed ({res.returncode}):\n{res.stderr[-3000:]}")
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": time.monotonic() - t0, "records": recs}


def setup(work: Path) -> tuple[Path, Path, Path]:
    """(warm model dir, train parquet, test parquet) after the recipe's format warm-up."""
    out = run_builtin(work / "warmup", {**RECIPE, "sft_steps": 60, "sft_lr": 3e-3, "total_steps": 0,
                                        "eval_before": False, "eval_after": False, "save_every": 0})
    from hpcrl.checkpoints.store import CheckpointStore

    step, ckpt = CheckpointStore(work / "warmup" / "checkpoints").find_latest()
    print(f"warm-up: {step} supervised format steps in {out['wall_s']:.1f} s -> {ckpt}", file=sys.stderr)
    return ckpt, work / "warmup" / "data" / "train.parquet", work / "warmup" / "data" / "test.parquet"


def bench_builtin(work: Path, model: Path, train: Path, test: Path, steps: int) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    args = {**RECIPE, "model": str(model), "data": "files", "train_files": str(train), "val_files": str(test),
            "total_steps": steps, "save_every": 0, "eval_before": False}
    out = run_builtin(work, args)
    train_recs = [r for r in out["records"] if r.get("phase") == "train"]
    step_s = sum(r["step_time_s"] for r in train_recs)
    ev = [r for r in out["records"] if r.get("phase") == "eval_after"][-1]
    tail = train_recs[-max(1, steps // 5):]
    return {"steps": len(train_recs), "train_s": step_s, "steps_per_s": len(train_recs) / step_s,
            "reward_last20pct": sum(r["reward_mean"] for r in tail) / len(tail),
            "eval_reward": ev["eval/reward_mean"], "eval_accuracy": ev["eval/accuracy"]}


def bench_trl(trl_python: str, model: Path, train: Path, test: Path, steps: int, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    out = work / "trl.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "WANDB_DISABLED": "true"}
    res = subprocess.run([trl_python, __file__, "--trl-worker", str(model), str(train), str(test), str(steps),
                          str(out)], env=env, capture_output=True, text=True)
    if res.returncode != 0:
        return {"error": res.stderr[-2000:]}
    return json.loads(out.read_text())


def trl_worker(model_dir: str, train: str, test: str, steps: int, out: str) -> None:
    """Runs inside the TRL venv: GRPOTrainer with the built-in trainer's settings."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from hpcrl.rewards import score as rewards
    from hpcrl.rl import data

    torch.set_num_threads(RECIPE["threads"])
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ex = data.load_examples(train)
    ds = Dataset.from_list([{"prompt": e["messages"][0]["content"], "gt": json.dumps(e["ground_truth"])} for e in ex])

    def reward(completions, gt, **_):
        return [rewards.countdown_score(c, json.loads(g)) for c, g in zip(completions, gt)]

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, *a, **k):
            self.t0 = time.monotonic()

        def on_step_end(self, *a, **k):
            self.times.append(time.monotonic() - self.t0)

    timer = Timer()
    trainer = trl.GRPOTrainer(model=model, processing_class=tok, reward_funcs=reward, train_dataset=ds,
                              args=trl_config(trl, steps, Path(out).parent / "trl-out"), callbacks=[timer])
    trainer.train()
    rew = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    tail = rew[-max(1, steps // 5):]
    result = {"trl_version": trl.__version__, "steps": len(timer.times), "train_s": sum(timer.times),
              "steps_per_s": len(timer.times) / sum(timer.times), "reward_last20pct": sum(tail) / len(tail)}
    result.update(greedy_eval(trainer.model, tok, test))
    Path(out).write_text(json.dumps(result))


def trl_config(trl, steps: int, output_dir: Path):
    """The built-in run's settings in TRL's terms. loss_type "dapo" normalises by all tokens of
    the batch: the built-in grpo's token-mean; per_device_train_batch_size counts completions."""
    return trl.GRPOConfig(
        output_dir=str(output_dir), use_cpu=True, bf16=False, gradient_checkpointing=False, report_to=[],
        save_strategy="no", logging_steps=1, max_steps=steps, seed=0,
        per_device_train_batch_size=RECIPE["batch_size"] * RECIPE["group_size"],
        num_generations=RECIPE["group_size"], max_completion_length=RECIPE["max_response_length"],
        learning_rate=RECIPE["lr"], lr_scheduler_type="constant", warmup_steps=0, beta=RECIPE["beta"],
        loss_type="dapo", temperature=1.0, top_k=0, max_grad_norm=1.0, weight_decay=0.0, dataloader_num_workers=0)


def greedy_eval(model, tok, test) -> dict:
    from hpcrl.rewards import score as rewards
    from hpcrl.rl import data, policy
    from hpcrl.rl.rollout import HFRollout

    ex = data.load_examples(test)[:RECIPE["eval_size"]]
    ids = policy.encode_prompts(tok, ex, chat_template=False)
    texts = HFRollout(model, tok, max_new_tokens=RECIPE["max_response_length"]).generate(ids, greedy=True).texts
    scores = [rewards.countdown_score(t, e["ground_truth"]) for t, e in zip(texts, ex)]
    return {"eval_reward": sum(scores) / len(scores), "eval_accuracy": sum(s >= 1 for s in scores) / len(scores)}


def bench_rollout(model_dir: Path, seqs: int = 64, new_tokens: int = 32, reps: int = 5, chat: bool = False) -> dict:
    """Tokens/s of the built-in sampling loop (`rollout: hf`) and of HF generate (`hf-generate`),
    interleaved, 64 samples of one prompt (a GRPO group), eos suppressed (fixed work); then vLLM's
    on the same prompt when vllm is importable. `chat`: a chat-formatted question (a real model)."""
    import torch

    from hpcrl.rl import policy
    from hpcrl.rl.rollout import HFGenerateRollout, HFRollout

    torch.set_num_threads(RECIPE["threads"])
    model, tok = policy.load_policy(model_dir, torch.device("cpu"))
    text = (policy.prompt_text(tok, [{"role": "user", "content": "What is 17 + 25? Show your work."}]) if chat
            else "numbers 3 7 target 21 answer")
    prompt = tok(text, add_special_tokens=False).input_ids
    engines = {"hf": HFRollout(model, tok, max_new_tokens=new_tokens),
               "hf_generate": HFGenerateRollout(model, tok, max_new_tokens=new_tokens)}
    model.generation_config.suppress_tokens = engines["hf"].stop_ids()  # generate's way: every stop id
    engines["hf"].suppress_eos = True  # the loop's way
    secs, ntok = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0)
    for r in engines.values():
        r.generate([prompt], n=seqs)  # warm-up
    for _ in range(reps):
        for name, r in engines.items():
            t0 = time.monotonic()
            ntok[name] += int(r.generate([prompt], n=seqs).response_mask.sum())
            secs[name] += time.monotonic() - t0
    out = {f"{k}_tokens_per_s": ntok[k] / secs[k] for k in engines}
    out.update(seqs=seqs, new_tokens=new_tokens)
    assert ntok["hf"] == ntok["hf_generate"] == reps * seqs * new_tokens, ntok
    try:
        import vllm  # noqa: F401
    except ImportError:
        out["vllm"] = "not installed"
        return out
    out["vllm_tokens_per_s"] = bench_vllm(model_dir, tok, prompt, seqs, new_tokens, reps)
    return out


def bench_vllm(model_dir, tok, prompt, seqs, new_tokens, reps) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from hpcrl.rl import config
    from hpcrl.rl.vllm_rollout import VllmRollout

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = config.resolve({"max_prompt_length": max(32, len(prompt)), "max_response_length": new_tokens})
    llm = VllmRollout(model_dir, tok, cfg).llm
    params = SamplingParams(n=seqs, max_tokens=new_tokens, ignore_eos=True, temperature=1.0)
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)  # warm-up
    t0 = time.monotonic()
    ntok = sum(len(c.token_ids) for _ in range(reps)
               for o in llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False) for c in o.outputs)
    return ntok / (time.monotonic() - t0)


def bench_checkpoint(work: Path) -> dict:
    """A 30 M-parameter Llama + AdamW state through Checkpointer vs raw sequential I/O of the same
    bytes. Save = the synchronous save a walltime stop makes. Load = the resume path
    (Checkpointer.restore: every file verified against the manifest, tensors read into the model
    and a new optimizer), from disk (page cache dropped, as on the node a next segment lands on)
    and from the page cache (the same node).

    Each is timed twice in A-B-B-A order with the raw operation (writes first, then reads): this
    VM's disk alternates between fast and slow bursts, which one A-B pair would credit to one side."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpcrl.checkpoints.trainer import checkpointer

    model = LlamaForCausalLM(LlamaConfig(vocab_size=1200, hidden_size=512, intermediate_size=1536,
                                         num_hidden_layers=8, num_attention_heads=8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    saver = checkpointer.Checkpointer(work / "ckpt-bench", keep_last=1, async_save=False)
    raw = work / "raw.bin"

    def save() -> float:
        t0 = time.monotonic()
        saver.save_now(1, model, opt, {"step": 1, "sampler": {"epoch": 0, "cursor": 0}}, background=False)
        took = time.monotonic() - t0  # sealed: the pointer names it
        saver.store.wait_for_pruning()  # the old one's deletion must not slow the next measurement
        return took

    def load(cache: str) -> float:
        if cache == "cold":
            drop_cache(p for p in saver.latest()[1].iterdir() if p.is_file())
        fresh = torch.optim.AdamW(model.parameters(), lr=1e-4)  # a new process's optimizer: no state yet
        t0 = time.monotonic()
        step, _, _ = saver.restore(model, fresh)
        assert step == 1
        return time.monotonic() - t0

    secs = {k: [] for k in ("save", "raw_write", "load_cold", "raw_read_cold", "load_warm", "raw_read_warm")}
    save()
    nbytes = sum(p.stat().st_size for p in saver.latest()[1].iterdir() if p.is_file())
    for i in (0, 1, 1, 0):
        secs["save" if i == 0 else "raw_write"].append(save() if i == 0 else raw_write(raw, nbytes))
    os.sync()
    time.sleep(2)  # the disk's write-back of the saves would otherwise slow whichever read comes first
    for cache in ("cold", "warm"):
        for i in (0, 1, 1, 0):
            key = f"load_{cache}" if i == 0 else f"raw_read_{cache}"
            secs[key].append(load(cache) if i == 0 else raw_read(raw, cache))
    raw.unlink()
    return {"bytes": nbytes, "seconds": secs, **checkpoint_ratios(secs, nbytes, sum)}


PAIRS = {"save": ("save", "raw_write"), "load_cold": ("load_cold", "raw_read_cold"),
         "load_warm": ("load_warm", "raw_read_warm")}


def checkpoint_ratios(secs: dict, nbytes: int, agg) -> dict:
    """MB/s of each operation and hpcrl/raw throughput ratios, aggregating the timings with agg."""
    out = {f"{k}_MBps": len(v) * nbytes / agg(v) / 1e6 if agg is sum else nbytes / agg(v) / 1e6
           for k, v in secs.items()}
    out.update({f"{name}_ratio": out[f"{ours}_MBps"] / out[f"{raw}_MBps"] for name, (ours, raw) in PAIRS.items()})
    return out


def drop_cache(paths) -> None:
    """Evict (already fsync'ed) files from the page cache, so the next read comes from the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write(path: Path, nbytes: int) -> float:
    """Seconds for one sequential write + fsync of nbytes."""
    chunk = os.urandom(1 << 20)
    t0 = time.monotonic()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(chunk) + 1):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    return time.monotonic() - t0


def raw_read(path: Path, cache: str) -> float:
    """Seconds for one sequential read of path, from disk ("cold") or the page cache ("warm")."""
    if cache == "cold":
        drop_cache([path])
    t0 = time.monotonic()
    with open(path, "rb") as f:
        while f.read(1 << 22):
            pass
    return time.monotonic() - t0


def median_run(runs: list, key: str = "steps_per_s") -> dict:
    """The run with the median `key`, plus every run's value of it."""
    ok = [r for r in runs if key in r]
    if not ok:
        return runs[0]
    best = sorted(ok, key=lambda r: r[key])[len(ok) // 2]
    return {**best, f"all_{key}": [round(r[key], 3) for r in ok]}


def report(res: dict) -> str:
    b, t = res["builtin"], res.get("trl", {})
    lines = ["| | built-in | TRL GRPOTrainer |", "|---|---|---|",
             f"| steps / s of each repeat | {b.get('all_steps_per_s')} | {t.get('all_steps_per_s', '-')} |"]
    for key, label in (("steps", "RL steps"), ("steps_per_s", "steps / s"), ("reward_last20pct", "train reward, last 20% of steps"),
                       ("eval_reward", "greedy eval reward (128 problems)"), ("eval_accuracy", "greedy eval accuracy")):
        fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)
        lines.append(f"| {label} | {fmt(b.get(key))} | {fmt(t.get(key, '-'))} |")
    if "steps_per_s" in t:
        import statistics

        # repeat i of each ran back to back, so each pair saw the same machine: their ratios
        # are what the drift between repeats leaves alone
        paired = [round(x / y, 2) for x, y in zip(b["all_steps_per_s"], t["all_steps_per_s"])]
        lines.append(f"\nspeed ratio built-in / TRL: **{b['steps_per_s'] / t['steps_per_s']:.2f}x** (ratio of the medians); "
                     f"paired repeats {paired}, median **{statistics.median(paired):.2f}x**")
    r = res["rollout"]
    vllm = f"{r['vllm_tokens_per_s']:.0f}" if "vllm_tokens_per_s" in r else r.get("vllm", "-")
    lines.append(f"\nrollout tokens/s ({r['seqs']} seqs x {r['new_tokens']} tokens): built-in loop {r['hf_tokens_per_s']:.0f}, "
                 f"HF generate {r['hf_generate_tokens_per_s']:.0f}, vLLM {vllm}")
    return "\n".join(lines + [checkpoint_report(res)])


def checkpoint_report(res: dict) -> str:
    import statistics

    runs = res["checkpoint_runs"]
    best = checkpoint_ratios({k: [t for r in runs for t in r["seconds"][k]] for k in runs[0]["seconds"]},
                             runs[0]["bytes"], min)
    lines = [f"\ncheckpoint of {runs[0]['bytes'] / 1e6:.0f} MB, {len(runs)} repeats of A-B-B-A against the raw operation:",
             "| | hpcrl MB/s, best | raw MB/s, best | ratio of the best times | median ratio of the repeats | each repeat |",
             "|---|---|---|---|---|---|"]
    for name, (ours, raw) in PAIRS.items():
        label = {"save": "save (sync)", "load_cold": "load from disk", "load_warm": "load from page cache"}[name]
        each = [round(r[f"{name}_ratio"], 2) for r in runs]
        lines.append(f"| {label} | {best[f'{ours}_MBps']:.0f} | {best[f'{raw}_MBps']:.0f} | {best[f'{name}_ratio']:.2f} | "
                     f"{statistics.median(each):.2f} | {each} |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        trl_worker(*sys.argv[2:5], int(sys.argv[5]), sys.argv[6])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--trl-python", help="python of a venv with trl (and torch==2.13.0); omit to skip TRL")
    ap.add_argument("--out", default="bench_rl.json")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each measurement (median)")
    ap.add_argument("--rollout-only", action="store_true",
                    help="only rollout tokens/s on a fresh tiny model (run it with a venv that has vllm-cpu)")
    ap.add_argument("--seqs", type=int, default=64, help="--rollout-only --model: samples of the prompt")
    ap.add_argument("--new-tokens", type=int, default=32, help="--rollout-only --model: tokens per sample")
    ap.add_argument("--model", help="--rollout-only on this local HF model directory instead of a fresh tiny one")
    ap.add_argument("--checkpoint-only", action="store_true", help="only the checkpoint save/load measurement")
    ns = ap.parse_args()
    if ns.checkpoint_only:
        with tempfile.TemporaryDirectory(prefix="hpcrl-bench-") as tmp:
            runs = [bench_checkpoint(Path(tmp)) for _ in range(ns.repeats)]
        res = {"checkpoint_runs": runs}
        Path(ns.out).write_text(json.dumps(res, indent=1))
        print(checkpoint_report(res))
        return 0
    if ns.rollout_only:
        from hpcrl.rl.tiny import build_tiny_model

        if ns.model:  # e.g. `hpcrl model smollm2 --out DIR`
            print(json.dumps(bench_rollout(Path(ns.model), seqs=ns.seqs, new_tokens=ns.new_tokens, reps=ns.repeats,
                                           chat=True)))
            return 0
        with tempfile.TemporaryDirectory(prefix="hpcrl-bench-") as tmp:
            print(json.dumps(bench_rollout(build_tiny_model(Path(tmp) / "m", max_int=200))))
        return 0
    with tempfile.TemporaryDirectory(prefix="hpcrl-bench-") as tmp:
        work = Path(tmp)
        model, train, test = setup(work)
        # interleaved repeats, medians: this machine is shared and its speed drifts by +-30%
        runs = {"builtin": [], "trl": []}
        for i in range(ns.repeats):
            runs["builtin"].append(bench_builtin(work / f"b{i}", model, train, test, ns.steps))
            if ns.trl_python:
                runs["trl"].append(bench_trl(ns.trl_python, model, train, test, ns.steps, work / f"t{i}"))
        res = {k: median_run(v) for k, v in runs.items() if v}
        res["rollout"] = bench_rollout(model)
        res["checkpoint_runs"] = [bench_checkpoint(work) for _ in range(ns.repeats)]
    Path(ns.out).write_text(json.dumps(res, indent=1))
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
