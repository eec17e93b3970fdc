"""MaxText tier: MaxText 0.2.5's own RL trainer (Tunix GRPO / GSPO) run through `hpcrl submit
--site local` with the seed's recipes, across walltime segments, on this CPU machine.

The environment is scripts/maxtext-env's (a Debian trixie Python 3.13 with maxtext==0.2.5
--no-deps and pinned requirements, built once and cached outside the checkout by the hash of its
pins; the tier skips with the reason when it cannot be built). hpcrl runs MaxText with it exactly
as a user's own venv: `--set site.trainer_python=...`. The recipes are scaled down by user
overrides only (a tiny qwen3-shaped model from random weights, a local tokenizer, local
GSM8K-shaped parquet, CPU hardware keys). The one thing a CPU cannot run, MaxText's
vLLM-on-TPU rollout, is the TEST DOUBLE in tests/maxtext_cpu/ (loaded through PYTHONPATH and
HPCRL_TEST_TPU_ROLLOUT_DOUBLE=1 by the user who submits, never by hpcrl).

Assertions are on files: Orbax's step directories (checkpoints/actor/<step>/), Tunix's
tensorboard events (the steps each segment trained), and the launcher's per-segment record.
JAX compilation dominates each start (~1 min quiet, 2-3 under load): few starts, tiny model.
Measured on the shared 2-core machine at load ~15: the GRPO test 11.0 min (three starts, a
4.2-minute first segment), the GSPO run and the loss check 5.0 min beside it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from helpers import ROOT, dedicated_node, hpcrl, wait_for_run, wait_until

pytestmark = [pytest.mark.slow]
DOUBLE_DIR = ROOT / "tests" / "maxtext_cpu"
TMP_MARK = ".orbax-checkpoint-tmp"

# What a CPU needs (notes/maxtext-cpu.md), as a user passes it: MaxText keys...
CPU_OVERRIDES = [
    "override_model_config=true", "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2",
    "base_mlp_dim=128", "base_num_decoder_layers=2", "head_dim=16", "vocab_size=512",
    "logits_via_embedding=false",  # tied embeddings: every completion of a group alike, zero gradient
    "weight_dtype=float32", "dtype=float32", "remat_policy=full", "convert_checkpoint_if_possible=false",
    "tokenizer_type=huggingface", "dataset_name=openai/gsm8k", "hardware=cpu", "use_pathways=false",
    "skip_jax_distributed_system=true", "log_period=1", "max_prefill_predict_length=160",
    "max_target_length=192", "kv_cache_buffer=16",
]
# ... and environment
CPU_ENV = {"JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HPCRL_TEST_TPU_ROLLOUT_DOUBLE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(autouse=True)
def _dedicated_node(home):
    """The runs' processes get a dedicated node's CPU priority (helpers.dedicated_node says why)."""
    with dedicated_node(home):
        yield


@pytest.fixture(scope="session")
def maxtext_python():
    proc = subprocess.run([str(ROOT / "scripts" / "maxtext-env")], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        pytest.skip(f"maxtext tier: the MaxText environment cannot be built here: "
                    f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A local tokenizer with a chat template (MaxText applies one to every prompt) and
    GSM8K-shaped parquet ('question', 'answer' ending in '#### N')."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("maxtext-tiny")
    hpcrl("model", "tiny", "--out", out / "model", "--hidden-size", "32", "--layers", "1", "--heads", "2",
          "--max-int", "100")
    tok = AutoTokenizer.from_pretrained(out / "model")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(out / "tokenizer")
    rng = random.Random(0)
    for split, n in (("train", 64), ("test", 8)):
        rows = [(rng.randint(1, 40), rng.randint(1, 40)) for _ in range(n)]
        pq.write_table(pa.table({
            "question": [f"Tom has {x} apples and gets {y} more. How many apples does he have?" for x, y in rows],
            "answer": [f"{x} + {y} = {x + y}\n#### {x + y}" for x, y in rows]}), out / f"{split}.parquet")
    return out


def job_env() -> dict:
    """The double's folder on the job's PYTHONPATH, exported by the user who submits or resumes
    (a job inherits that environment, as sbatch's default --export=ALL does)."""
    return {"PYTHONPATH": os.pathsep.join([str(DOUBLE_DIR), os.environ.get("PYTHONPATH", str(ROOT))])}


def submit(name, recipe, maxtext_python, tiny, tmp_path, hours, args: dict, overrides=(), env=None, max_segments=4):
    spec = tmp_path / f"{name}.yaml"
    hpcrl("init", "--recipe", recipe, "--out", spec)
    sets = {"site.trainer_python": maxtext_python, "site.chips_per_vm": 1,
            "args.model_name": "qwen3-0.6b",  # one MaxText has a Hugging Face config for (Tunix looks it up)
            "args.load_parameters_path": "null",  # random initialisation
            "args.base_output_directory": "null", "args.tokenizer_path": tiny / "tokenizer",
            "budget.hours_min": "null", "resources.mem_gb": "null",
            "args.overrides": json.dumps(CPU_OVERRIDES + [f"hf_train_files={tiny / 'train.parquet'}", *overrides])}
    sets.update({f"args.{k}": ("null" if v is None else v) for k, v in args.items()})
    sets.update({f"env.{k}": v for k, v in {**CPU_ENV, **(env or {})}.items()})
    argv = ["submit", spec, "--site", "local", "--name", name, "--hours", hours, "--total-hours", "2",
            "--max-segments", max_segments]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    hpcrl(*argv, env=job_env())


def actor_dir(run) -> Path:
    return run.dir / "maxtext" / run.id / "checkpoints" / "actor"


def committed(run) -> list[int]:
    d = actor_dir(run)
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def temporary(run) -> list[str]:
    d = actor_dir(run)
    return sorted(p.name for p in d.iterdir() if TMP_MARK in p.name) if d.is_dir() else []


def segment_records(run, event: str) -> list[dict]:
    """The launcher's records of one kind: "start" (argv, temporary dirs removed) or "end" (exit code,
    saves seen, why it stopped); a hard-killed segment has a start and no end."""
    path = run.dir / "maxtext-segments.jsonl"
    recs = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
    return [r for r in recs if r["event"] == event]


def trained_steps(maxtext_python, run) -> list[list[int]]:
    """The steps each MaxText start trained, in order (Tunix's actor/train/loss records; one
    tensorboard events file per start), read with the environment's own tensorboardX."""
    script = r"""
import glob, json, struct, sys
from tensorboardX.proto import event_pb2
out = []
for path in sorted(glob.glob(sys.argv[1] + "/events.out.tfevents.*"), key=lambda p: int(p.split(".")[3])):
    data, i, steps = open(path, "rb").read(), 0, []
    while i + 12 <= len(data):
        n = struct.unpack("<Q", data[i:i + 8])[0]
        e = event_pb2.Event()
        e.ParseFromString(data[i + 12:i + 12 + n])
        i += 16 + n
        steps += [e.step for v in e.summary.value if v.tag == "actor/train/loss"]
    out.append(steps)
print(json.dumps(out))
"""
    tb = run.dir / "maxtext" / run.id / "tensorboard"
    proc = subprocess.run([maxtext_python, "-c", script, str(tb)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [s for s in json.loads(proc.stdout) if s]


def job_processes(run) -> list[int]:
    """The segment's batch shell and everything it started (the launcher, MaxText): each has the
    run directory in its environment. Not the local backend's supervisors (the scheduler, which a
    node failure does not take): the successor's, queued from inside the job, inherited that
    environment too."""
    tag = f"HPCRL_RUN_DIR={run.dir}\0".encode()
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit():
                continue
            cmdline = (proc / "cmdline").read_bytes()
            if b"hpcrl.backends.local" in cmdline:
                continue
            if tag in (proc / "environ").read_bytes() or cmdline == b"bash\0" + bytes(run.layout.script) + b"\0":
                out.append(int(proc.name))
        except OSError:
            continue
    return out


def test_grpo_stops_after_a_committed_save_survives_a_hard_kill_and_completes(home, maxtext_python, tiny, tmp_path):
    from hpcrl.runs import Run

    # 48 steps of >= 12 s each in segment 1 (the rollout double's delay, read from a file at every
    # step): its 540 s (the deadline 4 s before) never hold them all however quiet the machine
    # (start-up ~60 s), and hold at least two saves however loaded (start-up took 2.5 to 4 minutes
    # at load 15-24 in CI: a 4.2-minute segment saved nothing once). max_segments 1 stops the
    # chain there, so that segment 2 gets a longer walltime from `resume`; segments 2 and 3 step
    # at >= 4 s. Pre-training evaluation: one batch of the test split.
    total = 48
    pace = tmp_path / "rollout-delay-s"
    pace.write_text("12")
    submit("mgrpo", "maxtext-llama3.1-8b-grpo", maxtext_python, tiny, tmp_path, hours=0.15,
           args={"num_batches": total, "checkpoint_period": 2, "save_time_s": 5, "max_num_checkpoints_to_keep": 50},
           overrides=[f"hf_eval_files={tiny / 'test.parquet'}", "num_test_batches=1"],
           env={"HPCRL_TEST_ROLLOUT_DELAY_S": pace}, max_segments=1)
    state = wait_for_run("mgrpo", timeout=1200, poll=2)
    run = Run.by_id("mgrpo")
    seg1 = state["segments"][0]
    assert state["state"] == "STOPPED" and state["stop"]["kind"] == "max_segments", state
    assert seg1["rc"] == 85, seg1  # stopped by the launcher, not killed by the walltime
    first = committed(run)
    assert first and first[-1] < total, first
    assert temporary(run) == [], "a save was interrupted"
    # the launcher stopped MaxText right after its newest committed save: by its own deadline
    # decision, or by the local backend's USR1 10 s before the limit when a slow step (a loaded
    # machine) brought that save in late; either way nothing was interrupted
    end1 = segment_records(run, "end")
    assert end1[0]["stopped_for"] in ("deadline", "usr1") and end1[0]["last_save"] == first[-1], end1
    assert seg1["end_step"] == first[-1], seg1

    # Segment 2 gets 30 minutes; once it has committed a save of its own, every process of the
    # job is killed (a node failure: nothing could save), and segment 3 resumes from that save.
    pace.write_text("4")
    hpcrl("resume", "mgrpo", "--hours", "0.5", "--max-segments", "3", env=job_env())
    wait_until(lambda: len(segment_records(run, "start")) == 2 and [s for s in committed(run) if s >= first[-1] + 4],
               900, "a save of segment 2", poll=0.5)
    killed_after = max(committed(run))
    for pid in job_processes(run):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    state = wait_for_run("mgrpo", timeout=1500, poll=2)
    segs = [s for s in state["segments"] if s.get("rc") is not None]
    assert state["state"] == "COMPLETED", state
    assert segs[0]["rc"] == 85 and segs[-1]["rc"] == 0, segs
    assert committed(run)[-1] == total and temporary(run) == []

    # The steps each start trained: contiguous across segments, each resume right after the
    # newest committed save (segment 2 after segment 1's last, segment 3 after the kill's)
    starts = trained_steps(maxtext_python, run)
    assert len(starts) == 3, starts
    # (a hard kill takes the newest scalars with it: Tunix writes a step's a step late). Segment 1:
    # the launcher waits for the saved step's scalars before it stops MaxText, but only so long
    # (under load in one CI run they had not come when the wait ran out): its end record says
    # which step's were the last written, and that is at most the saved step's that is missing
    through = end1[0]["metrics_through"]
    assert through in (first[-1], first[-1] - 1), (through, first)
    assert starts[0][:through] == list(range(1, through + 1)), (first, through, starts[0])
    assert starts[1][0] == first[-1] + 1 and starts[1] == list(range(first[-1] + 1, starts[1][-1] + 1)), starts[1]
    assert starts[2] == list(range(killed_after + 1, total + 1)), (killed_after, starts[2])

    # hpcrl's metric records (the launcher reads Tunix's events): segment 1's up to the step its
    # end record names (the launcher waits for the saved step's scalars), segment 3's to
    # the end; the hard kill may take the newest records of segment 2 with it
    recs = [json.loads(ln) for ln in (run.dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    steps = [r["step"] for r in recs]
    assert set(range(1, through + 1)) <= set(steps) and set(range(killed_after + 1, total + 1)) <= set(steps), steps
    assert steps[-1] == total and all(r["trainer"] == "maxtext" and "loss" in r for r in recs)

    # Evaluation before training in segment 1 only (the launcher's record of each argv)
    starts_rec, ends = segment_records(run, "start"), segment_records(run, "end")
    assert [r["segment"] for r in starts_rec] == [1, 2, 3] and [r["segment"] for r in ends] == [1, 3], (starts_rec, ends)
    assert "num_test_batches=0" not in starts_rec[0]["argv"]
    assert all("num_test_batches=0" in r["argv"] for r in starts_rec[1:])


def test_gspo_runs_with_gspo_token_loss(home, maxtext_python, tiny, tmp_path):
    from hpcrl.runs import Run

    submit("mgspo", "maxtext-llama3.1-8b-gspo", maxtext_python, tiny, tmp_path, hours=0.5,
           args={"num_batches": 4, "checkpoint_period": 2}, overrides=["num_test_batches=0"])
    state = wait_for_run("mgspo", timeout=1200, poll=2)
    run = Run.by_id("mgspo")
    assert state["state"] == "COMPLETED", state
    assert committed(run)[-1] == 4 and temporary(run) == []
    assert trained_steps(maxtext_python, run) == [[1, 2, 3, 4]]
    argv = segment_records(run, "start")[0]["argv"]
    assert "loss_algo=gspo-token" in argv


GSPO_CHECK = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from tunix.rl import algo_core, common
from tunix.rl.grpo.grpo_learner import GRPOConfig

class Tiny(nnx.Module):  # Tunix's model call: (tokens, positions, cache, attention_mask) -> (logits, cache)
    def __init__(self, rngs):
        self.emb = nnx.Embed(16, 8, rngs=rngs)
        self.out = nnx.Linear(8, 16, rngs=rngs)
    def __call__(self, tokens, positions, cache, attention_mask, **kw):
        return self.out(jnp.tanh(self.emb(tokens))), None

model = Tiny(nnx.Rngs(0))
rng = np.random.default_rng(0)
ex = dict(prompt_ids=jnp.asarray(rng.integers(1, 16, (4, 3))), prompt_mask=jnp.ones((4, 3), jnp.int32),
          completion_ids=jnp.asarray(rng.integers(1, 16, (4, 5))), completion_mask=jnp.ones((4, 5), jnp.int32),
          advantages=jnp.asarray([1.0, -1.0, 0.5, -0.5]), ref_per_token_logps=None)
graphdef, state = nnx.split(model)
logps = common.compute_per_token_logps(graphdef, state, prompt_tokens=ex["prompt_ids"],
                                       completion_tokens=ex["completion_ids"], pad_id=0, eos_id=15)
old = {"on-policy (num_iterations=1: Tunix passes none)": None,
       "off-policy (num_iterations>1)": logps + jnp.asarray(rng.normal(0, 0.3, logps.shape), jnp.float32)}
out = {}
for case, old_logps in old.items():
    for algo in ("grpo", "gspo-token"):
        cfg = GRPOConfig(loss_algo=algo, beta=0.0, num_generations=2)
        cfg.temperature = 1.0
        train_example = common.TrainExample(**ex, old_per_token_logps=old_logps)
        loss_fn = lambda m: algo_core.grpo_loss_fn(m, train_example, cfg, pad_id=0, eos_id=15)[0]
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        out.setdefault(case, {})[algo] = [float(loss), [np.asarray(g).ravel().tolist() for g in jax.tree.leaves(grads)]]
print(json.dumps(out))
"""


def test_gspo_token_changes_the_loss_only_off_policy(maxtext_python):
    """Tunix 0.1.7's grpo_loss_fn (MaxText's policy_loss_fn='grpo') reads loss_algo: 'gspo-token'
    replaces each token's ratio by the sequence's mean log-ratio (value) with the token's own
    gradient. On-policy (no old log-probs: Tunix passes none when num_iterations == 1, rl.yml's
    default) every ratio is 1 and GSPO-token equals GRPO exactly, loss and gradient; with old
    log-probs (num_iterations > 1) they differ. Run with Tunix's own function on a tiny model."""
    import numpy as np

    proc = subprocess.run([maxtext_python, "-c", GSPO_CHECK], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    on, off = out["on-policy (num_iterations=1: Tunix passes none)"], out["off-policy (num_iterations>1)"]

    def same(a, b):
        return np.isclose(a[0], b[0], rtol=1e-6, atol=1e-7) and all(
            np.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(a[1], b[1]))

    assert same(on["grpo"], on["gspo-token"]), on
    assert not same(off["grpo"], off["gspo-token"]), off
