"""verl tier through the Slurm test cluster: verl 0.9.1's own trainer, submitted with `hpcrl submit
--site testcluster`, on a Ray cluster that hpcrl's bootstrap starts on the job's node (`srun ray
start --head`, `ray_cluster: always`: what a multi-node run does, on one node) and verl's driver
joins, across two walltime segments of a real Slurm job chain.

The same venv, tiny model and CPU configuration as tests/test_verl_tier.py (its fixtures and
constants), less what only a local Ray takes: verl joins the bootstrap's cluster, which brings its
own (fake) GPU count from resources.gpus_per_node. Assertions are on files, never on log lines.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from helpers import dedicated_node, hpcrl, log_tails, wait_for_run
from test_verl_tier import (CPU_ENV, CPU_OVERRIDES, STEP_DELAY_S, STEPS_PER_EPOCH, TINY_ARGS, TRACKER, job_env, no_ray_left,  # noqa: F401 (fixtures)
                            segment_metrics, tiny, trained_steps, verl_python)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.uses_ray("slurm-tier"), pytest.mark.timeout(2100)]


@pytest.fixture(autouse=True)
def _dedicated_node(home):
    """The runs' processes get a dedicated node's CPU priority (helpers.dedicated_node says why)."""
    with dedicated_node(home):
        yield


def test_grpo_through_slurm_on_the_ray_bootstrap_saves_at_each_deadline_and_resumes(home, slurm_cluster, verl_python,
                                                                                     tiny, tmp_path):
    from hpcrl.runs import Run

    if not slurm_cluster.tier_partition:
        pytest.skip("the Slurm test cluster has no tier partition (started by an older scripts/slurm-cluster): "
                    "scripts/slurm-cluster stop, then start")
    name = "vslurm"
    spec = tmp_path / f"{name}.yaml"
    hpcrl("init", "--recipe", "tinyzero-countdown-grpo", "--out", spec)
    # a local Ray's settings (address=local, its own GPU count) cannot be given to a driver that
    # joins a running cluster: the bootstrap's `ray start --num-gpus` gives the fake GPU instead
    overrides = [o for o in CPU_OVERRIDES if not o.startswith("+ray_kwargs.ray_init.")]
    sets = {"site.trainer_python": verl_python, "args.model": tiny / "model",
            "args.train_files": tiny / "data" / "train.parquet", "args.val_files": tiny / "data" / "test.parquet",
            "args.ray_cluster": "always", "args.ray_port": 6391,
            # the node kept for this run: on a default-partition node it held back for 12 minutes
            # every two-node job of the light phase's Slurm tests
            "site.partition": slurm_cluster.tier_partition,
            "resources.gpus_per_node": 1, "resources.cpus_per_task": 8, "resources.mem_gb": "null",
            "budget.hours_min": "null", "env.RAY_TMPDIR": f"/tmp/hpcrl-vt-{os.getpid()}-{name}",
            "args.overrides": json.dumps(overrides)}
    # 10,000 steps never finish: each of the two segments must end by its deadline (verl's ESI
    # save, exit 85), however fast this machine is today; max_segments then stops the run. Each
    # step waits 2 x STEP_DELAY_S (the CPU double) so that a segment is a few dozen steps of CPU,
    # not hundreds: time, not steps, fills these segments.
    sets.update({f"args.{k}": ("null" if v is None else v) for k, v in {**TINY_ARGS, "total_training_steps": 10_000,
                                                                         "total_epochs": 1000, "save_freq": 1000}.items()})
    # wandb offline (no network): verl's own tracking in its Ray actor writes a run per segment
    sets.update({f"env.{k}": v for k, v in {**CPU_ENV, "WANDB_MODE": "offline",
                                            "HPCRL_TEST_VERL_STEP_DELAY_S": 2 * STEP_DELAY_S}.items()})
    sets["args.logger"] = "wandb"
    # 9-minute segments: under heavy load verl's start-up alone took a 3-minute one, once all of a
    # 4.8-minute one, then all of two 6-minute ones (CI of 2026-12-06: killed at the walltime, exit
    # 134), and with the dedicated node's priority a resumed one's start-up and first step
    # still outlasted 6 minutes once (CI of 2026-12-07)
    argv = ["submit", spec, "--site", "testcluster", "--name", name, "--hours", "0.15", "--total-hours", "1",
            "--max-segments", "2"]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    hpcrl(*argv, env=job_env())
    try:
        state = wait_for_run(name, timeout=1600, poll=2)
    finally:
        hpcrl("cancel", name, check=False)
    run = Run.by_id(name)
    # shown with a failure, whole (an assertion's message is cut short): the run's events, each
    # segment's hpcrl lines and the last of its log
    print(json.dumps(state["events"], indent=1), file=sys.stderr)
    for log in sorted((run.dir / "logs").glob("job-*.log")):
        lines = log.read_text(errors="replace").splitlines()
        print(f"--- {log.name}", *[ln for ln in lines if ln.startswith("hpcrl")], "...", *lines[-25:],
              sep="\n", file=sys.stderr)
    segs = [s for s in state["segments"] if s.get("rc") is not None]
    assert state["state"] == "STOPPED" and state["stop"]["kind"] == "max_segments", (state, log_tails(run.dir))
    assert [s["rc"] for s in segs] == [85, 85], (segs, log_tails(run.dir))
    script = run.layout.script.read_text()
    assert "start --head" in script and "RAY_AUTH_MODE=token" in script  # the bootstrap ran, not verl's own Ray
    first, second = trained_steps(segment_metrics(run.dir, 1)), trained_steps(segment_metrics(run.dir, 2))
    assert_trained_through_the_boundary(run, segs, first, second)
    assert_one_wandb_run(run)
    no_ray_left()


def assert_trained_through_the_boundary(run, segs, first, second):
    """Training, not only records: each segment ends on a checkpoint of its last trained step
    (the tracker hpcrl read at the segment's end), the next one resumes from exactly that step,
    and verl's own step counter and epoch (its data position) run on without a gap."""
    assert first and first == list(range(1, len(first) + 1)), first
    assert segs[0]["end_step"] == first[-1], (segs, first[-3:])  # segment 1's checkpoint = its last trained step
    assert second and second[0] == segs[0]["end_step"] + 1, (segs, second[:3])  # resumed right after it
    assert second == list(range(second[0], second[-1] + 1)) and segs[1]["end_step"] == second[-1], (segs, second)
    for n in (1, 2):
        for rec in segment_metrics(run.dir, n):
            if "timing_s/step" in rec["data"]:
                assert rec["data"]["training/global_step"] == rec["step"], rec
                # an epoch that does not match the step is a skipped or repeated batch
                assert rec["data"]["training/epoch"] == (rec["step"] - 1) // STEPS_PER_EPOCH, (n, rec["step"], rec["data"]["training/epoch"])
    ckpt = run.layout.checkpoints
    assert (ckpt / TRACKER).read_text().strip() == str(second[-1])
    assert (ckpt / f"global_step_{second[-1]}" / "actor").is_dir()


def assert_one_wandb_run(run):
    """Both segments logged to one wandb run: wandb offline writes a run directory per process
    (offline-run-<date_time>-<id>); the id is the run's, the same in each segment."""
    dirs = sorted((run.dir / "wandb").glob("offline-run-*"))
    ids = {d.name.split("-", 3)[-1] for d in dirs}
    assert len(dirs) == 2 and ids == {run.id}, [d.name for d in dirs]
