#!/usr/bin/env python
"""fsdp start-up memory and checkpoint-save traffic (issue 19, items 2 and 5).

    PYTHONPATH=. .venv/bin/python scripts/bench_fsdp_mem.py [--repeats 3] [--skip-measured]

1. The 3B recipe (tinyzero-countdown-builtin: Qwen2.5-3B-Instruct's shape, 4 ranks, bf16 compute),
   computed from the code path: the model built by fsdp.build_on_meta (no weights), its parameter
   count and largest decoder layer; what a rank holds at start-up and at its first step, before
   (bf16 weights loaded whole on every rank, deep-copied for the reference, then sharded; AdamW
   in bf16) and after (meta device, sharded, each rank reads its rows; fp32 masters and AdamW).
2. Measured on 2 CPU ranks (torchrun, gloo): each rank's peak RSS growth over the start-up
   (tests/rl/startup_check.py) on the 30 M model, old path vs meta path, A-B-B-A per repeat.
3. Measured on 2 CPU ranks: one checkpoint's gather of a sharded model + AdamW state, the old way
   (full_tensor() of everything on every rank) vs fsdp.owned_part (each tensor to its owner), and
   torch.distributed.checkpoint.save of the same state (each rank writes its own shards), each
   with the bytes it moves between ranks. Writes are to a tmpfs-or-disk temp dir.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QWEN25_3B = {  # Qwen/Qwen2.5-3B-Instruct's config.json (the fields that set the shapes)
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 2048, "intermediate_size": 11008,
    "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936,
    "tie_word_embeddings": True, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
}
GB = 1e9


def recipe_3b(world: int = 4) -> str:
    from hpcrl.rl import fsdp

    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(QWEN25_3B))
        model = fsdp.build_on_meta(d)
    n = sum(p.numel() for p in model.parameters())
    layer = max(sum(p.numel() for p in lyr.parameters()) for lyr in fsdp._decoder_layers(model))
    root = n - sum(sum(p.numel() for p in lyr.parameters()) for lyr in fsdp._decoder_layers(model))
    gather = max(layer, root)  # the largest FSDP unit unsharded at once (bf16) in forward/backward
    # the old start-up in float32 (what fixing item 1 alone would have made it): 2 whole fp32 models
    old_fp32 = 2 * 4 * n
    rows = [
        ("start-up peak (model + reference)", 2 * 2 * n, 2 * 4 * n / world),
        ("first step: weights + reference shards", 2 * 2 * n / world, 2 * 4 * n / world),
        ("first step: gradients (sharded)", 2 * n / world, 4 * n / world),
        ("first step: AdamW's two moments (sharded)", 2 * 2 * n / world, 2 * 4 * n / world),
        ("first step: largest unit gathered (bf16)", 2 * gather, 2 * gather),
    ]
    step_before = sum(b for _, b, _ in rows[1:])
    step_after = sum(a for _, _, a in rows[1:])
    out = [f"Qwen2.5-3B shape built on the meta device by fsdp.build_on_meta: {n / 1e9:.3f} B parameters, "
           f"largest FSDP unit {gather / 1e6:.0f} M; {world} ranks.", "",
           "| per rank | before (bf16 weights, whole-model load) | after (fp32 masters, meta start-up) |",
           "|---|---|---|"]
    out += [f"| {name} | {b / GB:.2f} GB | {a / GB:.2f} GB |" for name, b, a in rows]
    out.append(f"| **first step total (before activations)** | {step_before / GB:.2f} GB | {step_after / GB:.2f} GB |")
    out.append(f"| **start-up peak / first step, larger of the two** | {max(rows[0][1], step_before) / GB:.2f} GB "
               f"| {max(rows[0][2], step_after) / GB:.2f} GB |")
    out += ["", f"The old whole-model start-up with float32 masters would peak at {old_fp32 / GB:.2f} GB per rank "
            f"({old_fp32 / rows[0][2]:.1f}x the meta start-up's {rows[0][2] / GB:.2f} GB)."]
    return "\n".join(out)


def torchrun(script: str, *args, env=None) -> str:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script, *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})})
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return proc.stdout


def measured_startup(model_dir: Path, repeats: int) -> str:
    check = str(REPO / "tests" / "rl" / "startup_check.py")
    got = {"full": [], "meta": []}
    model_mb = None
    for _ in range(repeats):
        for mode in ("full", "meta", "meta", "full"):
            out = torchrun(check, str(model_dir), mode)
            for rank, peak, model in re.findall(r"rank (\d): mode \w+ peak ([\d.]+) MB model ([\d.]+) MB", out):
                got[mode].append(float(peak))
                model_mb = float(model)
    full, meta = max(got["full"]), max(got["meta"])
    return (f"Measured, 2 CPU ranks, a {model_mb:.0f} MB (float32) model and its KL reference: peak RSS growth "
            f"per rank over the start-up, worst of {len(got['full'])} rank-runs each: old path {full:.0f} MB "
            f"({full / model_mb:.2f}x the model), meta path {meta:.0f} MB ({meta / model_mb:.2f}x; ideal 1.00 = half "
            f"of each of two models). Ratio meta / old: {meta / full:.2f}.")


SAVE_SCRIPT = r'''
import sys, time, torch, tempfile, shutil
import torch.distributed as tdist
from torch.distributed.tensor import DTensor
from hpcrl.rl import dist as rl_dist, fsdp
from hpcrl.checkpoints.trainer import checkpointer
d = rl_dist.Dist.from_env({"dist_timeout_s": 300, "device": "cpu"})
model = fsdp.load_sharded(sys.argv[1], torch.device("cpu"), d.rank, d.world)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits.float().pow(2).mean().backward()
opt.step()
out = sys.argv[2]
def old():  # before issue 19: every tensor gathered whole on every rank, then kept by its owner
    for t in list(model.state_dict().values()) + [v for s in opt.state_dict()["state"].values() for v in s.values()]:
        if isinstance(t, DTensor):
            t.full_tensor()
def new():
    part, _ = fsdp.owned_part(model, opt, d.rank, d.world)
    checkpointer.write_part(part, out, d.rank, d.world)
def new_gather_only():
    fsdp.owned_part(model, opt, d.rank, d.world)
def dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out}/dcp")
state_bytes = sum(p.numel() * 4 for p in model.parameters()) * 3
for rep in range(int(sys.argv[3])):
    for name, fn in (("old-gather", old), ("owned-gather", new_gather_only), ("owned+write", new), ("dcp-save", dcp)):
        tdist.barrier(); t0 = time.perf_counter(); fn(); tdist.barrier(); dt = time.perf_counter() - t0
        if d.rank == 0:
            print(f"{name} {dt:.4f} {state_bytes}", flush=True)
'''


def measured_save(model_dir: Path, repeats: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp, "save_bench.py")
        script.write_text(SAVE_SCRIPT)
        out_dir = Path(tmp, "out")
        out_dir.mkdir()
        out = torchrun(str(script), str(model_dir), str(out_dir), str(repeats))
    times: dict = {}
    nbytes = 0
    for name, dt, b in re.findall(r"^(\S+) ([\d.]+) (\d+)$", out, re.M):
        times.setdefault(name, []).append(float(dt))
        nbytes = int(b)
    world = 2
    moved = {"old-gather": (world - 1) * nbytes, "owned-gather": (world - 1) / world * nbytes,
             "owned+write": (world - 1) / world * nbytes, "dcp-save": 0}
    best = {k: min(v) for k, v in times.items()}
    lines = [f"Model + AdamW state {nbytes / 1e6:.0f} MB, 2 CPU ranks (gloo), best of {repeats}:", "",
             "| | time | ratio to old-gather | bytes between ranks |", "|---|---|---|---|"]
    for k in ("old-gather", "owned-gather", "owned+write", "dcp-save"):
        lines.append(f"| {k} | {best[k]:.3f} s | {best[k] / best['old-gather']:.2f} | {moved[k] / 1e6:.0f} MB |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-measured", action="store_true")
    ns = parser.parse_args()
    print(recipe_3b())
    if ns.skip_measured:
        return 0
    from hpcrl.rl.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "m30", hidden_size=512, layers=8, heads=8, max_int=1000)
        print()
        print(measured_startup(model_dir, ns.repeats))
        print()
        print(measured_save(model_dir, ns.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
