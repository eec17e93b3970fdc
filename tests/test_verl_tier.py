"""verl tier: verl 0.9.1's own trainer (TinyZero's `main_ppo`) run through `hpcrl submit --site
local`, across walltime segments, on this CPU machine.

The venv is scripts/verl-venv's (built once, cached outside the checkout by the hash of its pins;
the tier skips with the reason when it cannot be built). hpcrl runs verl with it exactly as a
user's own venv: `--set site.trainer_python=...`. What the CPU needs is user configuration only:
Hydra overrides, environment, and verl's own plugin hook loading the GPU-platform TEST DOUBLE in
tests/verl_cpu/ (VERL_USE_EXTERNAL_MODULES). Assertions are on files (verl's tracker,
global_step_N, metrics), never on log lines (verl's console loses lines at SIGTERM).

Sized small (notes/verl-cpu.md: start to step 1 ~55 s, later steps 0.6-2 s); one verl run at a
time (uses_ray: the lock the Ray tests share; memory is shared too).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers import ROOT, dedicated_node, hpcrl, log_tails, wait_for_run

pytestmark = [pytest.mark.slow, pytest.mark.uses_ray]
DOUBLE_DIR = ROOT / "tests" / "verl_cpu"
TRACKER = "latest_checkpointed_iteration.txt"

# What verl needs on a CPU (each measured in notes/verl-cpu.md), as a user passes it.
CPU_OVERRIDES = [
    "+ray_kwargs.ray_init.num_gpus=1",  # verl counts only GPU resources: a fake one
    "+ray_kwargs.ray_init.address=local",  # never join another Ray on this machine
    "trainer.device=cpu", "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.rollout.enforce_eager=True", "actor_rollout_ref.rollout.agent.num_workers=1",
    "reward.num_workers=1", "data.dataloader_num_workers=0",
    "actor_rollout_ref.model.use_remove_padding=False", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
    "actor_rollout_ref.actor.use_torch_compile=False", "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
    "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False", "actor_rollout_ref.rollout.dtype=float32",
    "actor_rollout_ref.rollout.max_model_len=128", "+actor_rollout_ref.rollout.enable_sleep_mode=False",
    "actor_rollout_ref.rollout.free_cache_engine=False",
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
]
# ... and for PPO's critic (its own engine settings; its attention: see the test double)
CRITIC_CPU_OVERRIDES = [
    "critic.strategy=fsdp2", "critic.fsdp.use_torch_compile=False", "critic.model.use_remove_padding=False",
    "critic.model.enable_gradient_checkpointing=False",
]
CPU_ENV = {
    "VERL_USE_EXTERNAL_MODULES": "hpcrl_test_cpu_platform_double", "HPCRL_TEST_CPU_DOUBLE": "1",
    "VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda", "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
    # Ray starts its workers at nice 15: beside the rest of the suite (nice 0) verl's start-up then
    # got a few percent of a core and outlasted a 6-minute segment. A GPU node runs nothing else.
    "RAY_worker_niceness": "0",
}
# 64 rows at 4 prompts a step: 16 steps an epoch; 4 responses of 16 tokens each
TINY_ARGS = {
    "train_batch_size": 4, "ppo_mini_batch_size": 4, "micro_batch_size_per_gpu": 4,
    "log_prob_micro_batch_size_per_gpu": 4, "ref_log_prob_micro_batch_size_per_gpu": 4, "rollout_n": 4,
    "max_prompt_length": 32, "max_response_length": 16, "rollout_tp": 1, "test_freq": -1, "save_time_s": 2,
    "logger": "console", "max_ckpt_to_keep": 2, "val_batch_size": None,
}
STEPS_PER_EPOCH = 16
# seconds each training step waits on the driver in the walltime tests (see the CPU double)
STEP_DELAY_S = 2


@pytest.fixture(autouse=True)
def _dedicated_node(home):
    """The runs' processes get a dedicated node's CPU priority (helpers.dedicated_node says why)."""
    with dedicated_node(home):
        yield


@pytest.fixture(scope="session")
def verl_python():
    proc = subprocess.run([str(ROOT / "scripts" / "verl-venv")], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        pytest.skip(f"verl tier: the verl venv cannot be built here: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A tiny Llama with a chat template (verl applies one to every prompt) and tiny Countdown data."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("verl-tiny")
    hpcrl("data", "countdown", "--out", out / "data", "--train", "64", "--test", "8", "--template", "tiny",
          "--max-number", "20", "--max-target", "50")
    hpcrl("model", "tiny", "--out", out / "model", "--hidden-size", "128", "--layers", "2", "--heads", "4",
          "--max-int", "100")
    tok = AutoTokenizer.from_pretrained(out / "model")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(out / "model")
    return out


def submit(name, recipe, verl_python, tiny, tmp_path, hours, args: dict, max_segments=4, overrides=(), check=True,
           env=None):
    spec = tmp_path / f"{name}.yaml"
    hpcrl("init", "--recipe", recipe, "--out", spec)
    sets = {"site.trainer_python": verl_python, "args.model": tiny / "model",
            "args.train_files": tiny / "data" / "train.parquet", "args.val_files": tiny / "data" / "test.parquet",
            "resources.gpus_per_node": 1, "resources.cpus_per_task": 8, "resources.mem_gb": "null",
            "budget.hours_min": "null", "env.RAY_TMPDIR": f"/tmp/hpcrl-vt-{os.getpid()}-{name}",
            "args.overrides": json.dumps(CPU_OVERRIDES + list(overrides))}
    sets.update({f"args.{k}": ("null" if v is None else v) for k, v in {**TINY_ARGS, **args}.items()})
    sets.update({f"env.{k}": v for k, v in {**CPU_ENV, **(env or {})}.items()})
    argv = ["submit", spec, "--site", "local", "--name", name, "--hours", hours, "--total-hours", "2",
            "--max-segments", max_segments]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    return hpcrl(*argv, env=job_env(), check=check)


def job_env() -> dict:
    """The double's folder on the job's PYTHONPATH, exported by the user who submits or resumes
    (a job inherits that environment, as sbatch's default --export=ALL does)."""
    return {"PYTHONPATH": os.pathsep.join([str(DOUBLE_DIR), os.environ.get("PYTHONPATH", str(ROOT))])}


def segment_metrics(run_dir: Path, segment: int) -> list[dict]:
    path = run_dir / "verl-metrics" / f"segment-{segment:03d}.jsonl"
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
    out = []
    for i, ln in enumerate(lines):
        try:
            out.append(json.loads(ln))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise
            # the last line of a segment killed (or read) mid-write
    return out


def trained_steps(records) -> list[int]:
    return [r["step"] for r in records if "timing_s/step" in r["data"]]


def ray_processes() -> list[str]:
    """Processes of this test process's verl runs still alive: each run's RAY_TMPDIR is in the
    environment of every Ray process it started (other Ray users on the machine are not ours)."""
    tag = f"RAY_TMPDIR=/tmp/hpcrl-vt-{os.getpid()}-".encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and tag in (proc / "environ").read_bytes():
                found.append(f"{proc.name} {(proc / 'cmdline').read_bytes()[:120]!r}")
        except OSError:
            continue
    return found


def no_ray_left():
    # verl's driver exits before Ray has reaped its actors (a ray::TaskRunner outlived a COMPLETED
    # run by a few seconds here): every process of the run must be gone soon after, not at once
    from helpers import wait_until

    wait_until(lambda: not ray_processes(), 60, "the run's Ray processes to exit", poll=1, describe=ray_processes)


def tracker_step(run) -> int:
    """The step verl's tracker names (0: none yet, or caught mid-replace)."""
    try:
        return int((run.layout.checkpoints / TRACKER).read_text())
    except (OSError, ValueError):
        return 0


def test_ppo_saves_by_the_deadline_survives_a_hard_kill_and_resumes_exactly(home, verl_python, tiny, tmp_path):
    import signal

    from helpers import wait_until
    from hpcrl.runs import Run

    # PPO (GAE): the critic trains and is saved and restored beside the actor. (GRPO across
    # deadlines, chained by hpcrl itself: test_verl_tier_slurm.py.) Three segments of one run, one
    # verl start-up each (~100 CPU-s: the deadline and the hard kill share a run instead of two):
    # 1. 9.6 minutes for 128 steps (8 epochs) of at least 5 s each (the double's delay, inside
    #    verl's step timer): 640 s of delay alone, so they never all fit however fast the machine,
    #    yet there is room for start-up and a save by the deadline under the full suite's load
    #    (verl's start-up, ~55 s alone, outlasted a 4.8-minute segment twice in CI, at load 15-24,
    #    even at nice -10). verl saves by the deadline (ESI) and the segment exits 85; max_segments
    #    1 stops the run there. The delay, not the step count, fills the segment: 384 steps did,
    #    and the verl tiers were half of the suite's CPU.
    # 2. `resume --hours 0.5` (30 minutes for the rest, STEP_DELAY_S a step: the delay is read
    #    from a file at every step): once a periodic save (every 4 steps) is past segment 1's and
    #    two steps ran past it, every process of the segment is killed (a node failure: no signal
    #    the trainer could act on).
    # 3. The successor resumes from that periodic checkpoint and completes.
    total = 8 * STEPS_PER_EPOCH
    pace = tmp_path / "step-delay-s"
    pace.write_text("5")
    submit("vppo", "tinyzero-countdown-ppo", verl_python, tiny, tmp_path, hours=0.16,
           args={"total_epochs": 8, "save_freq": 4, "critic_lr": 1e-5}, max_segments=1,
           overrides=CRITIC_CPU_OVERRIDES, env={"HPCRL_TEST_VERL_STEP_DELAY_S": pace})
    state = wait_for_run("vppo", timeout=1200, poll=2)
    run = Run.by_id("vppo")
    assert state["state"] == "STOPPED" and state["stop"]["kind"] == "max_segments", (state, log_tails(run.dir))
    first = tracker_step(run)
    assert (run.layout.checkpoints / f"global_step_{first}" / "critic").is_dir()  # the critic saved too
    pace.write_text(str(STEP_DELAY_S))
    hpcrl("resume", "vppo", "--hours", "0.5", "--max-segments", "3", env=job_env())
    wait_until(lambda: tracker_step(run) > first
               and max(trained_steps(segment_metrics(run.dir, 2)) or [0]) >= tracker_step(run) + 2, 900,
               "a periodic save in segment 2 and two steps past it", poll=1, describe=lambda: log_tails(run.dir))
    pids = job_processes(run.layout.script, "vppo")
    assert len(pids) > 3, pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    killed_at = tracker_step(run)
    # (the successor starts at once with the same RAY_TMPDIR: leftovers are checked once the run ends)
    state = wait_for_run("vppo", timeout=2000, poll=2)
    assert state["state"] == "COMPLETED", (state, log_tails(run.dir))
    ran = [s for s in state["segments"] if s.get("started")]
    assert [s["state"] for s in ran] == ["CONTINUE", "LOST", "COMPLETE"], (ran, log_tails(run.dir))
    assert ran[0]["rc"] == 85 and ran[2]["rc"] == 0, ran
    records = [segment_metrics(run.dir, n) for n in (1, 2, 3)]
    seg1, seg2, seg3 = (trained_steps(r) for r in records)
    assert seg1 == list(range(1, seg1[-1] + 1)) and ran[0]["end_step"] == seg1[-1], (ran[0], seg1[-3:])
    assert seg2[0] == seg1[-1] + 1 and seg2[-1] >= killed_at > seg1[-1], (seg2[:3], seg2[-3:], killed_at)
    assert seg3[0] == killed_at + 1, (seg3[:3], killed_at)  # from the periodic save, not from segment 1's
    assert seg1 + [n for n in seg2 if n <= killed_at] + seg3 == list(range(1, total + 1))
    seen_val = [any(r["step"] == 0 and "val-core/countdown/acc/mean@1" in r["data"] for r in recs) for recs in records]
    assert seen_val == [True, False, False], "validation before training in segment 1 only"
    ckpt = run.layout.checkpoints
    assert (ckpt / TRACKER).read_text().strip() == str(total)
    assert (ckpt / f"global_step_{total}" / "actor").is_dir() and (ckpt / f"global_step_{total}" / "critic").is_dir()
    critic_loss = [r["data"].get("critic/vf_loss") for r in records[2] if "timing_s/step" in r["data"]]
    assert all(isinstance(v, (int, float)) for v in critic_loss), "the critic trained at every step of segment 3"
    good = json.loads(hpcrl("status", "vppo", "--json").stdout)[0]["goodput"]
    assert [g["k"] for g in good if g["goodput"] is not None] == [1, 2, 3], good  # verl's goodput, as builtin's
    # the killed segment's steps past its save count as lost (status may not have seen the last one
    # a moment before the kill: q9 counted 1 of the file's 2)
    assert 1 <= good[1]["lost_steps"] <= seg2[-1] - killed_at, good
    # `hpcrl samples` reads verl's own dump of each step (the adapter's trainer.rollout_data_dir):
    # every step once, the killed segment's past its save trained and dumped again, and a step's
    # scores are those verl's metrics averaged
    from hpcrl.job import verl_rollouts

    assert list(verl_rollouts.list_steps(verl_rollouts.rollouts_dir(run.dir))) == list(range(1, total + 1))
    last = [json.loads(ln) for ln in hpcrl("samples", "vppo", "--step", total, "--format", "jsonl").stdout.splitlines()]
    assert len(last) == TINY_ARGS["train_batch_size"] * TINY_ARGS["rollout_n"] and {s["step"] for s in last} == {total}
    assert any(s["turns"][-1]["content"].strip() for s in last), last[:2]
    assert all(s["turns"][0]["content"].startswith("numbers ") and "target" in s["ground_truth"] for s in last)
    score_mean = next(r["data"]["critic/score/mean"] for r in records[2] if r["step"] == total)
    assert sum(s["reward"] for s in last) / len(last) == pytest.approx(score_mean, abs=1e-5)
    shown = hpcrl("samples", "vppo", "--worst", "--limit", "2").stdout
    assert f"{total} steps" in shown and shown.count("assistant:") == 2, shown
    no_ray_left()


def test_more_steps_than_the_data_holds_is_refused_at_submit(home, verl_python, tiny, tmp_path):
    # verl's loop runs out of epochs at step 16 without its last-step save (issue 12's 40 lost
    # steps): submit asks verl's own interpreter for the data's rows and refuses before anything
    # is queued (#31 item 6). The launcher's unsaved-end rule, for what submit cannot see, is
    # tests/test_job.py's test_an_unsaved_end_is_a_failure_with_its_reason_for_status.
    r = submit("vgap", "tinyzero-countdown-grpo", verl_python, tiny, tmp_path, hours=0.1,
               args={"total_epochs": 1, "total_training_steps": 20, "save_freq": 5}, max_segments=1, check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        f"hpcrl: error: args.total_training_steps 20: the data holds 1 epochs x {STEPS_PER_EPOCH} batches = "
        f"{STEPS_PER_EPOCH} steps (64 rows of train_files / train_batch_size 4); verl would stop unsaved at step "
        f"{STEPS_PER_EPOCH}: set args.total_training_steps to at most {STEPS_PER_EPOCH}, or args.total_epochs to 2"]
    assert "vgap" not in hpcrl("status").stdout, "a refused submit leaves no run behind"
    no_ray_left()


def job_processes(script: Path, name: str) -> list[int]:
    """The segment's batch shell (bash RUN/job.sh) and everything it started: the launcher, verl
    and Ray (each has the run's RAY_TMPDIR in its environment, whatever session Ray put it in)."""
    tag = f"RAY_TMPDIR=/tmp/hpcrl-vt-{os.getpid()}-{name}\0".encode()
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (tag in (proc / "environ").read_bytes()
                                        or (proc / "cmdline").read_bytes() == b"bash\0" + bytes(script) + b"\0"):
                out.append(int(proc.name))
        except OSError:
            continue
    return out
