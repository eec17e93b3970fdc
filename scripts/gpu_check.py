#!/usr/bin/env python3
"""The built-in trainer on one GPU, measured: step time, tokens/s, where a step's time goes,
checkpoint save/load GB/s and peak memory, for a 0.5B-shaped model in bf16 compute.

    scripts/gpu-check                      # one GPU (<= 8 minutes on an H200)
    scripts/gpu-check --cpu --tiny         # the same code path on a CPU, a tiny model (seconds)

Needs only torch, transformers, safetensors, pyyaml and jinja2 (a device image's packages: no
vLLM, no pandas, no network): the model is a randomly initialised Llama with Qwen2.5-0.5B's
shape (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, vocabulary 151,936, tied
embeddings: 494 M parameters), the tokenizer hpcrl's word-level one, the data generated
Countdown rows as JSON lines. The trainer is hpcrl's own RLTrainer run in this process (so the
GPU's peak memory can be read afterwards), with the recipe's dtype: bfloat16; each phase of a
step is timed by wrapping the trainer's own calls (with a device synchronise), not by a model
of them. Prints a table and writes --json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {  # Qwen2.5-0.5B's shape as a Llama; --tiny: seconds on a CPU
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151_936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True),
}


def build_model(out: Path, shape: dict) -> int:
    """A random Llama of `shape` with hpcrl's word-level tokenizer; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from hpcrl.rl.tiny import build_tokenizer

    hf_logging.disable_progress_bar()

    tok = build_tokenizer(max_int=200)
    config = LlamaConfig(**shape, max_position_embeddings=1024, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def write_data(out: Path, rows: int) -> tuple[Path, Path]:
    from hpcrl.rl.data import countdown_rows

    train, test = countdown_rows(rows, 16, seed=0, min_count=2, max_count=2, max_number=9, max_target=100,
                                 template="tiny", disjoint=False)
    paths = out / "train.jsonl", out / "test.jsonl"
    for path, part in zip(paths, (train, test)):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


class Phases:
    """Seconds per phase, summed, each measured between device synchronisations."""

    def __init__(self, device):
        self.device, self.secs, self.depth = device, {}, 0

    def sync(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def timed(self, name):
        outer = self.depth == 0  # a phase inside another (the forward inside the backward's pass) is not counted twice
        self.depth += 1
        if outer:
            self.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.depth -= 1
            if outer:
                self.sync()
                self.secs[name] = self.secs.get(name, 0.0) + time.perf_counter() - t0

    def wrap(self, obj, attr, name):
        fn = getattr(obj, attr)

        def timed(*a, **k):
            with self.timed(name):
                return fn(*a, **k)
        setattr(obj, attr, timed)


def instrument(trainer, phases: Phases):
    """Time the trainer's phases by wrapping the calls it makes (no change to what it does);
    returns a function that puts the two module-level functions back."""
    import torch

    from hpcrl.rl import loop

    phases.wrap(trainer.rollout, "generate", "rollout")
    phases.wrap(trainer.env, "score", "reward")  # args.reward as the environment calls it (its details kept)
    phases.wrap(trainer.optimizer, "step", "optimizer")
    phases.wrap(trainer, "_logprobs_no_grad", "extra forward (reference / old log-probs)")
    real_logprobs = loop.policy.response_logprobs

    def forward(*a, **k):
        with phases.timed("forward"):
            return real_logprobs(*a, **k)
    loop.policy.response_logprobs = forward
    real_backward = torch.Tensor.backward

    def backward(self, *a, **k):
        with phases.timed("backward"):
            return real_backward(self, *a, **k)
    torch.Tensor.backward = backward

    def undo():
        loop.policy.response_logprobs = real_logprobs
        torch.Tensor.backward = real_backward
    return undo


def run(ns) -> dict:
    import torch

    from hpcrl import protocol
    from hpcrl.rl import config
    from hpcrl.rl.loop import RLTrainer
    from hpcrl.rl.metrics import peak_rss_mb

    device = torch.device("cpu" if ns.cpu else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu-check: no CUDA device here (torch.cuda.is_available() is False); use --cpu --tiny for the CPU path")
    work = Path(ns.work or tempfile.mkdtemp(prefix="hpcrl-gpu-check-"))
    shape = SHAPES["tiny" if ns.tiny else "0.5b"]
    t0 = time.monotonic()
    params = build_model(work / "model", shape)
    train, test = write_data(work, 512)
    build_s = time.monotonic() - t0
    cfg = config.resolve({
        "model": str(work / "model"), "data": "files", "train_files": str(train), "val_files": str(test),
        "prompt_template": "tiny", "dtype": "bfloat16", "device": device.type, "algorithm": "grpo",
        "batch_size": ns.batch_size, "group_size": ns.group_size, "max_response_length": ns.response_tokens,
        "micro_batch_size": ns.micro_batch_size,
        "max_prompt_length": 64, "total_steps": ns.steps, "lr": 1e-6, "beta": ns.beta, "eval_before": False,
        "eval_after": False, "save_every": 0, "async_save": False, "keep_last": 2, "seed": 0,
        "threads": ns.threads})
    run_dir = work / "run"
    ctx = protocol.Context(run_dir, run_dir / "checkpoints", 1, None, run_dir / "metrics.jsonl")
    stop = protocol.StopFlag(ctx, install=False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer = RLTrainer(cfg, ctx, stop)
    phases = Phases(trainer.device)
    undo = instrument(trainer, phases)
    t0 = time.monotonic()
    try:
        code = trainer.run()  # steps, then the final (synchronous) save
    finally:
        undo()
    run_s = time.monotonic() - t0
    if code != protocol.EXIT_COMPLETE:
        sys.exit(f"gpu-check: the trainer exited {code}, not {protocol.EXIT_COMPLETE} (complete)")
    peak_gb = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    records = [json.loads(x) for x in ctx.metrics_path.read_text().splitlines()]
    steps = [r for r in records if r.get("phase") == "train"]
    timed = steps[1:] or steps  # the first step includes one-time kernel selection and allocation
    step_s = sum(r["step_time_s"] for r in timed) / len(timed)
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in timed)
    save_gb, save_s = ckpt_bytes(trainer) / 1e9, trainer.ckpt.last_save_s
    load_s = time_load(trainer, cfg)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "params": params, "shape": shape, "dtype": "bfloat16",
        "param_dtype": str(next(trainer.model.parameters()).dtype).replace("torch.", ""),
        "batch": f"{ns.batch_size} prompts x {ns.group_size} = {ns.batch_size * ns.group_size} completions, "
                 f"{ns.response_tokens} new tokens, {ns.micro_batch_size} rows per forward/backward",
        "steps": len(steps), "step_s": step_s, "response_tokens_per_s": tokens / sum(r["step_time_s"] for r in timed),
        "phases_s_per_step": {**{k: v / len(steps) for k, v in phases.secs.items()},
                              "other (the loop, data, logging)": max(0.0, (sum(r["step_time_s"] for r in steps)
                                                                         - sum(phases.secs.values())) / len(steps))},
        "checkpoint_gb": save_gb, "save_gb_per_s": save_gb / save_s if save_s else None,
        "load_gb_per_s": save_gb / load_s, "peak_cuda_gb": peak_gb,
        "peak_rss_gb": peak_rss_mb() / 1e3,
        "build_s": build_s, "run_s": run_s, "work": str(work),
    }


def ckpt_bytes(trainer) -> int:
    _, path = trainer.ckpt.latest()
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def time_load(trainer, cfg) -> float:
    """A resume's load: every file checked against its manifest, read into the model and a new
    optimizer (what the next segment does), timed to the device's synchronisation."""
    import torch

    fresh = torch.optim.AdamW(trainer.model.parameters(), lr=cfg["lr"])
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    t0 = time.perf_counter()
    step, path, _ = trainer.ckpt.restore(trainer.model, fresh)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    if path is None:
        sys.exit("gpu-check: the final checkpoint did not restore")
    return time.perf_counter() - t0


def report(res: dict) -> str:
    ph = res["phases_s_per_step"]
    total = res["step_s"]
    lines = [f"gpu-check: built-in trainer on {res['device']} (torch {res['torch']}), "
             f"{res['params'] / 1e6:.1f} M parameters, bf16 compute (parameters held in {res['param_dtype']})",
             f"  batch: {res['batch']}; {res['steps']} steps",
             f"  step time        {total:.3f} s (mean of steps 2..{res['steps']})",
             f"  tokens/s         {res['response_tokens_per_s']:.0f} response tokens per second",
             "  where a step's time goes (mean per step, all steps):"]
    for k, v in sorted(ph.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {k:<44} {v:.3f} s")
    save = f"{res['save_gb_per_s']:.2f}" if res["save_gb_per_s"] else "-"
    lines += [f"  checkpoint       {res['checkpoint_gb']:.3f} GB: save {save} GB/s, load {res['load_gb_per_s']:.2f} GB/s",
              f"  peak memory      GPU {res['peak_cuda_gb']:.2f} GB" if res["peak_cuda_gb"] is not None
              else "  peak memory      (no GPU)", f"                   host RSS {res['peak_rss_gb']:.2f} GB",
              f"  wall: build {res['build_s']:.0f} s, train + save {res['run_s']:.0f} s"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (the test suite's check of this script)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model instead of the 0.5B shape")
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default 12; 3 with --tiny)")
    ap.add_argument("--batch-size", type=int, default=None, help="prompts per step (default 16; 2 with --tiny)")
    ap.add_argument("--group-size", type=int, default=None, help="completions per prompt (default 8; 2 with --tiny)")
    ap.add_argument("--response-tokens", type=int, default=None, help="new tokens per completion (default 256; 4 with --tiny)")
    # the GPU recipes' 8: one forward over all 128 rows holds their 150k-vocabulary logits in fp32
    # (~20 GB a copy) and ran an H200 out of memory
    ap.add_argument("--micro-batch-size", type=int, default=None, help="rows per forward/backward (default 8; 2 with --tiny)")
    ap.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0 adds the reference's forward)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--work", help="directory to build in (default: a new temporary one, left for inspection)")
    ap.add_argument("--json", help="write the figures here too")
    ns = ap.parse_args(argv)
    small = ns.tiny
    ns.steps = ns.steps or (3 if small else 12)
    ns.batch_size = ns.batch_size or (2 if small else 16)
    ns.group_size = ns.group_size or (2 if small else 8)
    ns.response_tokens = ns.response_tokens or (4 if small else 256)
    ns.micro_batch_size = ns.micro_batch_size or (2 if small else 8)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    res = run(ns)
    print(report(res), flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
