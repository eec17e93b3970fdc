"""The verl adapter's Ray bootstrap, run for real on the throwaway Slurm cluster (both nodes).

Two nodes (`ray_cluster: auto` would start it too): a head on the first, a worker on the second that
joins once Ray's API reports the head alive, the driver once it reports both. Only verl itself is replaced: a stand-in package `verl` whose
`verl.trainer.main_ppo` does what verl's driver does first -- ray.init() on the cluster named by
RAY_ADDRESS -- then runs one task there and reports what it saw. It is put on the job's PYTHONPATH
by a test site's set-up line, so the real adapter, its job-side launcher (hpcrl.job.verl) and the real `ray start`
all run unchanged.
"""

import os
import shlex
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from helpers import hpcrl, stand_in_verl_inputs, wait_for_run

pytestmark = [pytest.mark.slurm, pytest.mark.uses_ray("slurm-nodes")]
pytest.importorskip("ray", reason="real Ray (scripts/setup installs it) is needed to run the bootstrap")

STANDIN_DRIVER = '''\
"""Stand-in for verl.trainer.main_ppo (test double): join the Ray cluster as verl's driver does."""
import os
import sys

import ray

overrides = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
env_key = "+ray_kwargs.ray_init.runtime_env.env_vars.MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR")
alive = [n for n in ray.nodes() if n["Alive"]]
host = ray.get(ray.remote(lambda: __import__("socket").gethostname()).remote())
print(f"standin driver: {len(alive)} alive Ray node(s); task ran on {host}; "
      f"deadline override {'present' if env_key in overrides else 'missing'}", flush=True)
ray.shutdown()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_netns() -> set[str]:
    """The network namespaces the test cluster's jobs run in, as /proc/PID/ns/net reads them:
    each node's own on the Perlmutter-shaped cluster (HPCRL_SLURM_NETNS), else this machine's."""
    paths = [p.split("=", 1)[1] for p in os.environ.get("HPCRL_SLURM_NETNS", "").split(",") if "=" in p]
    return {f"net:[{os.stat(p).st_ino}]" for p in paths if os.path.exists(p)} or {os.readlink("/proc/self/ns/net")}


def _ray_daemons() -> list[str]:
    """Command lines of Ray's node daemons (GCS server, raylet) where the cluster's jobs run. Ray
    elsewhere (the verl tier's, on this machine's own network) runs beside this test, under
    another lock (slurm_fixture.RAY_LOCKS), and is not this test's business."""
    nets = _cluster_netns()
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv0 = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            if os.readlink(proc / "ns" / "net") not in nets:
                continue
        except OSError:
            continue
        if os.path.basename(argv0) in ("gcs_server", "raylet"):
            out.append(f"{proc.name} {argv0}")
    return out


def _wait_job_gone(name: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run(["squeue", "-h", "--name", name, "-t", "PD,R,CG", "-o", "%i"],
                             capture_output=True, text=True).stdout
        if not out.strip():
            return
        time.sleep(0.5)
    raise AssertionError(f"Slurm job {name} still there after {timeout:.0f} s")


@pytest.fixture
def ray_site(home, slurm_cluster, tmp_path):
    """A site 'rayci' = testcluster plus the stand-in verl on the job's PYTHONPATH."""
    standin = tmp_path / "standin"
    (standin / "verl" / "trainer").mkdir(parents=True)
    (standin / "verl" / "__init__.py").write_text("")
    (standin / "verl" / "trainer" / "__init__.py").write_text("")
    (standin / "verl" / "trainer" / "main_ppo.py").write_text(STANDIN_DRIVER)
    line = f'export PYTHONPATH={shlex.quote(str(standin))}:"$PYTHONPATH"'
    site = {"extends": "testcluster", "setup": [line]}
    (Path(os.environ["HPCRL_SITES_DIR"]) / "rayci.yaml").write_text(yaml.safe_dump(site))
    names = []
    yield names
    for name in names:
        subprocess.run(["scancel", "--name", name], capture_output=True)


def test_ray_bootstrap_starts_a_real_cluster_the_driver_joins_and_stops_it(ray_site, tmp_path):
    if _ray_daemons():
        pytest.skip(f"Ray daemons already running on this machine: {_ray_daemons()}")
    model, train, test = stand_in_verl_inputs(tmp_path)
    spec = tmp_path / "verl-ray.yaml"
    spec.write_text(textwrap.dedent(f"""\
        name: verl-ray
        trainer: verl
        args:
          algorithm: grpo
          model: {model}
          train_files: {train}
          val_files: {test}
          reward: verl
          ray_cluster: always
          ray_port: {_free_port()}
        resources:
          nodes: 2
    """))
    ray_site.append("verl-ray")
    hpcrl("submit", spec, "--site", "rayci", "--hours", "0.05", "--name", "verl-ray")
    state = wait_for_run("verl-ray", timeout=150)
    _wait_job_gone("verl-ray", timeout=90)  # Ray is stopped after the segment's end is recorded
    log = hpcrl("logs", "verl-ray").stdout
    assert state["state"] == "COMPLETED", f"{state}\n{log}"
    # both nodes: the worker joined once Ray reported the head alive, the driver once Ray reported 2
    assert "Ray cluster up: 2 node(s)" in log, log
    assert "standin driver: 2 alive Ray node(s); task ran on" in log, log
    assert "deadline override present" in log, "hpcrl.job.verl hands the deadline to Ray's workers"
    assert "hpcrl: Ray stopped" in log, log
    assert "forcing job termination" not in log, "Ray stopped itself on TERM; srun did not have to kill it"
    assert log.index("Ray cluster up") < log.index("standin driver") < log.index("hpcrl: Ray stopped")
    assert not _ray_daemons(), "the segment left Ray running"
