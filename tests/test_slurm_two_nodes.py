"""Two nodes for real: the verl adapter's Ray bootstrap across nid001 and nid002.

On the Perlmutter-shaped test cluster each node's slurmd (and so each job step) runs in its own
network, UTS and mount namespace, with its own hostname and address. `--nodes 2` makes the adapter
start a Ray head on the first node and a worker on the second through srun. Only verl is replaced,
by a stand-in `verl.trainer.main_ppo` that joins the cluster as verl's driver does, reports what it
sees (nodes, hosts, the GPUs Slurm assigned as Ray resources), and then trains like verl: a step
runs one task on each node and is checkpointed the way verl checkpoints (global_step_N and the
tracker file), resuming from the tracker in the next segment.

One run shows all of it: segment 1 comes up on both nodes; the test kills every process of the
job on the worker node (as a node crash would: Ray's worker, raylet, the srun task); the driver's
step fails, the segment is recorded FAILED, and the successor starts Ray again on both nodes,
resumes from the last checkpoint and completes. No Ray process is left in either namespace.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from helpers import hpcrl, run_dir, run_state, stand_in_verl_inputs, started, wait_for_run, wait_until
from hpcrl.runs import Run

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(480), pytest.mark.uses_ray("slurm-nodes")]
pytest.importorskip("ray", reason="real Ray (scripts/setup installs it) is needed to run the bootstrap")

STEPS = 14

STANDIN_DRIVER = '''\
"""Stand-in for verl.trainer.main_ppo (test double): verl's driver on a 2-node Ray cluster."""
import os
import sys
import time
from pathlib import Path

import ray

ckpt = Path(os.environ["HPCRL_CKPT_DIR"])
tracker = ckpt / "latest_checkpointed_iteration.txt"
steps = int(os.environ["STANDIN_STEPS"])
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR")
alive = [n for n in ray.nodes() if n["Alive"]]
print(f"standin driver: {len(alive)} alive Ray node(s): " + " ".join(
    f"{n['NodeManagerHostname']}@{n['NodeManagerAddress']}:GPU={n['Resources'].get('GPU', 0):g}"
    for n in sorted(alive, key=lambda n: n["NodeManagerHostname"])), flush=True)


@ray.remote(num_gpus=4)
class Worker:
    def where(self):
        import socket
        return (f"{socket.gethostname()} ray_gpus={','.join(str(g) for g in sorted(int(g) for g in ray.get_gpu_ids()))} "
                f"slurm_step_gpus={os.environ.get('SLURM_STEP_GPUS', '-')}")

    def step(self, n):
        time.sleep(0.5)
        return n


workers = [Worker.options(resources={f"node:{n['NodeManagerAddress']}": 0.001}).remote() for n in alive]
for line in sorted(ray.get([w.where.remote() for w in workers])):
    print(f"standin driver: worker on {line}", flush=True)
start = int(tracker.read_text()) if tracker.exists() else 0
print(f"standin driver: resuming at step {start}", flush=True)
for step in range(start + 1, steps + 1):
    try:
        ray.get([w.step.remote(step) for w in workers], timeout=60)
    except Exception as e:  # a node went away: verl's driver fails the same way
        print(f"standin driver: step {step} failed: {type(e).__name__}", flush=True)
        sys.exit(1)
    (ckpt / f"global_step_{step}").mkdir(parents=True, exist_ok=True)
    tmp = ckpt / (tracker.name + ".tmp")
    tmp.write_text(str(step))
    os.replace(tmp, tracker)
    print(f"standin driver: step {step} done", flush=True)
ray.shutdown()
'''


def _ns_inode(path: str) -> str:
    return f"net:[{os.stat(path).st_ino}]"


def _procs_in(netns: str, job_id: str | None = None) -> list[tuple[int, str]]:
    """(pid, command) of processes in that network namespace, optionally only the job's."""
    want = _ns_inode(netns)
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.readlink(proc / "ns" / "net") != want:
                continue
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            if job_id is not None and f"SLURM_JOB_ID={job_id}".encode() not in (proc / "environ").read_bytes().split(b"\0"):
                continue
        except OSError:
            continue
        found.append((int(proc.name), cmd))
    return found


def _ray_procs(netns: str) -> list[tuple[int, str]]:
    return [(p, c) for p, c in _procs_in(netns) if "raylet" in c or "gcs_server" in c or "ray.scripts" in c
            or "from ray.scripts" in c or "default_worker.py" in c]


@pytest.fixture
def ray2_site(home, pm_cluster, tmp_path):
    standin = tmp_path / "standin"
    (standin / "verl" / "trainer").mkdir(parents=True)
    (standin / "verl" / "__init__.py").write_text("")
    (standin / "verl" / "trainer" / "__init__.py").write_text("")
    (standin / "verl" / "trainer" / "main_ppo.py").write_text(STANDIN_DRIVER)
    # cpus_per_task as perlmutter's: every Ray srun step asks for all 128 (--overlap beside the batch shell)
    site = {"extends": "testcluster", "gpus_per_node": 4, "constraint": "gpu", "cpus_per_task": 128,
            "setup": [f'export PYTHONPATH={shlex.quote(str(standin))}:"$PYTHONPATH"', f"export STANDIN_STEPS={STEPS}"]}
    (Path(os.environ["HPCRL_SITES_DIR"]) / "ray2.yaml").write_text(yaml.safe_dump(site))
    names: list[str] = []
    yield names
    for name in names:
        subprocess.run(["scancel", "--name", name], capture_output=True)


def test_ray_on_two_nodes_worker_node_killed_segment_fails_and_successor_resumes(ray2_site, pm_cluster, tmp_path):
    head, worker = pm_cluster.nodes[:2]
    for node in (head, worker):
        if _ray_procs(pm_cluster.netns(node)):
            pytest.skip(f"Ray processes already running on {node}: {_ray_procs(pm_cluster.netns(node))}")
    model, train, test = stand_in_verl_inputs(tmp_path)
    spec = tmp_path / "verl-ray2.yaml"
    spec.write_text(textwrap.dedent(f"""\
        name: verl-ray2
        trainer: verl
        args:
          algorithm: grpo
          model: {model}
          train_files: {train}
          val_files: {test}
          reward: verl
          save_time_s: 5
          ray_port: 6390
        resources:
          nodes: 2
    """))
    ray2_site.append("verl-ray2")
    t0 = time.time()
    hpcrl("submit", spec, "--site", "ray2", "--hours", "0.05", "--name", "verl-ray2")
    rdir = run_dir("verl-ray2")
    tracker = rdir / "checkpoints" / "latest_checkpointed_iteration.txt"
    wait_until(lambda: tracker.exists() and int(tracker.read_text() or 0) >= 3, 180,
               "segment 1 to checkpoint step 3 on the two-node Ray cluster",
               describe=lambda: hpcrl("logs", "verl-ray2", check=False).stdout[-2000:])
    victim = next(s for s in run_state("verl-ray2")["segments"] if s["state"] == "RUNNING")
    # The worker node crashes: every process of the job there, Ray's included (slurmd survives).
    procs = [(p, c) for p, c in _procs_in(pm_cluster.netns(worker), victim["job_id"]) if "slurmstepd" not in c]
    assert any("raylet" in c for _, c in procs), procs
    for pid, _ in procs:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    killed_at = time.time()

    state = wait_for_run("verl-ray2", timeout=300)
    segs = started(state)
    layout = Run.by_id("verl-ray2").layout
    logs = [layout.log(s["job_id"]).read_text() for s in segs]
    log = "".join(logs)
    assert state["state"] == "COMPLETED", f"{state}\n{log}"
    assert len(segs) == 2, segs
    assert segs[0]["job_id"] == victim["job_id"] and segs[0]["state"] in ("FAILED", "LOST"), segs
    assert segs[1]["start_step"] >= 3 and segs[1]["end_step"] == STEPS, segs
    assert f"step {STEPS} done" in log, log

    # Both segments: Ray on both nodes, the GPUs Slurm gave each node as Ray's GPU resource.
    nodes_line = (f"standin driver: 2 alive Ray node(s): {head}@{pm_cluster_addr(head)}:GPU=4 "
                  f"{worker}@{pm_cluster_addr(worker)}:GPU=4")
    assert log.count(nodes_line) == 2, log
    for node in (head, worker):
        assert log.count(f"standin driver: worker on {node} ray_gpus=0,1,2,3 slurm_step_gpus=0,1,2,3") == 2, log
    assert log.count("hpcrl: Ray cluster up: 2 node(s)") == 2 and log.count("hpcrl: Ray stopped") == 2, log
    assert "standin driver: resuming at step 0" in logs[0] and "step 3 done" in logs[0], logs[0]
    assert "standin driver: step" in logs[0] and "failed: " in logs[0], logs[0]  # the lost node broke the step
    resumed = int(logs[1].split("standin driver: resuming at step ")[1].split()[0])
    assert resumed == segs[1]["start_step"] and resumed >= 3
    # Ray stopped at each segment's end on both nodes: nothing of it left in either namespace.
    for node in (head, worker):
        assert not _ray_procs(pm_cluster.netns(node)), (node, _ray_procs(pm_cluster.netns(node)))
    print(f"two-node run: {time.time() - t0:.0f} s in all; successor done {time.time() - killed_at:.0f} s after the kill")


def pm_cluster_addr(node: str) -> str:
    out = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True, check=True).stdout
    return out.split("NodeAddr=")[1].split()[0]

