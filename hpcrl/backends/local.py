"""The local backend: this machine as a one-node scheduler with a simulated walltime.

Each job is the rendered segment script run by bash in its own process group, watched by a
detached supervisor process (`python -m hpcrl.backends.local supervise RECORD`). Like Slurm it
sends USR1 to the batch shell `signal_lead_s` before the limit, SIGTERM to the whole group at
the limit and SIGKILL after `kill_grace_s`; it honours an `after` job (afterany) and runs one job
of a run at a time (singleton). Its queue and job ids live in RUN_DIR/.queue/: ID.json is written
only by the job's supervisor, ID.cancel by `cancel`, so no two processes write the same file.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from ..atomicio import atomic_write_json
from ..errors import BackendError
from ..runs import RunLayout
from .base import Backend, Check, JobInfo, JobState, RankLaunch

POLL_S = 0.1


def queue_dir(run_dir: Path) -> Path:
    return RunLayout(run_dir).private("queue")


def _record_path(run_dir: Path, job_id: str) -> Path:
    return queue_dir(run_dir) / f"{job_id}.json"


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _next_id(run_dir: Path) -> str:
    qd = queue_dir(run_dir)
    qd.mkdir(parents=True, exist_ok=True)
    # O_EXCL creation makes the id unique even when two submits race.
    n = 1 + max((int(p.stem) for p in qd.glob("*.json") if p.stem.isdigit()), default=0)
    while True:
        try:
            fd = os.open(qd / f"{n}.json", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            os.close(fd)
            return str(n)
        except FileExistsError:
            n += 1


def parse_local_header(script_text: str) -> dict[str, float]:
    """The `#HPCRL-LOCAL key=value` lines of a rendered script (its walltime and signal timing)."""
    out = {}
    for line in script_text.splitlines():
        if line.startswith("#HPCRL-LOCAL "):
            key, _, value = line[len("#HPCRL-LOCAL "):].partition("=")
            out[key.strip()] = float(value)
    return out


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"hpcrl.backends.local" in cmdline  # the pid was not reused by something else


def local_directives(resolved: dict) -> list[str]:
    """The simulated walltime and signal timing, read back by the supervisor from the script."""
    site, hours = resolved["site"], resolved["spec"]["budget"]["hours"]
    return [f"#HPCRL-LOCAL walltime_s={hours * 3600:g}", f"#HPCRL-LOCAL signal_lead_s={site['signal_lead_s']:g}",
            f"#HPCRL-LOCAL kill_grace_s={site['kill_grace_s']:g}"]


class LocalBackend(Backend):
    name = "local"

    def directives(self, resolved: dict, run_id: str, layout) -> list[str]:
        return local_directives(resolved)

    def doctor(self, site: dict) -> list[Check]:
        return [Check("scheduler", "pass", "this machine: segments are process groups with a simulated walltime")]

    def rank_launch(self, resolved: dict) -> RankLaunch:
        nodes = resolved["spec"]["resources"]["nodes"]
        if nodes != 1:
            from ..errors import SpecError

            raise SpecError(f"resources.nodes (--nodes) {nodes}: the local site is this one machine; use nodes: 1 "
                            f"and more ranks on it with --set resources.ranks_per_node=N")
        # torchrun's own single-machine rendezvous on a free port: runs side by side never collide
        return RankLaunch(prelude="", prefix=[], rendezvous=["--standalone"])

    def submit(self, run, resolved: dict, after: str | None = None) -> str:
        import subprocess  # here: `hpcrl render` loads this module and starts nothing

        run_dir, script = run.dir, run.layout.script
        job_id = _next_id(run_dir)
        path = _record_path(run_dir, job_id)
        atomic_write_json(path, {"job_id": job_id, "name": run.id, "script": str(script), "after": after,
                                 "state": JobState.PENDING.value, "submitted": time.time()})
        log = open(queue_dir(run_dir) / "supervisor.log", "ab")
        try:
            # A new session: the supervisor outlives the submitting command and the job that
            # queued it (a successor is submitted from inside the running segment).
            proc = subprocess.Popen([sys.executable, "-m", "hpcrl.backends.local", "supervise", str(path)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                    env=_supervisor_env())
        except OSError as e:
            path.unlink()
            raise BackendError(f"local backend: cannot start the job supervisor: {e}") from None
        finally:
            log.close()
        (queue_dir(run_dir) / f"{job_id}.pid").write_text(str(proc.pid))
        return job_id

    def query(self, job_ids: list[str], run=None) -> dict[str, JobInfo]:
        run_dir = run.dir if run is not None else None
        out = {}
        for job_id in job_ids:
            rec = _read(_record_path(run_dir, job_id)) if run_dir else None
            out[job_id] = _info(job_id, rec, run_dir)
        return out

    def cancel(self, job_ids: list[str], run=None) -> None:
        run_dir = run.dir
        for job_id in job_ids:
            path = queue_dir(run_dir) / f"{job_id}.cancel"
            if _record_path(run_dir, job_id).exists():
                path.write_text("cancel\n")

    def checkpoint_stop(self, job_ids: list[str], run=None) -> None:
        for job_id in job_ids:  # the supervisor sends USR1 as at the walltime's signal lead
            if _record_path(run.dir, job_id).exists():
                (queue_dir(run.dir) / f"{job_id}.usr1").write_text("usr1\n")

    def end_time(self, job_id: str, run, environ) -> float | None:
        value = environ.get("HPCRL_JOB_END_TIME")
        if value:
            return float(value)
        rec = _read(_record_path(run.dir, job_id)) or {}
        return rec.get("end_time")


def _supervisor_env() -> dict:
    env = dict(os.environ)
    pkg_parent = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _info(job_id: str, rec: dict | None, run_dir: Path | None) -> JobInfo:
    if rec is None or "state" not in rec:
        return JobInfo(job_id, JobState.UNKNOWN, "no such job")
    state = JobState(rec["state"])
    if not state.finished:
        pid_file = queue_dir(run_dir) / f"{job_id}.pid"
        pid = int(pid_file.read_text() or 0) if pid_file.exists() else rec.get("supervisor_pid")
        if pid_file.exists() and not _alive(pid):
            # The supervisor died (e.g. the machine rebooted): the job is gone.
            return JobInfo(job_id, JobState.FAILED, "supervisor lost", rec.get("started"), rec.get("ended"))
    return JobInfo(job_id, state, rec.get("reason", ""), rec.get("started"), rec.get("ended"), rec.get("exit_code"))


# ---------------------------------------------------------------- the supervisor process


class _Supervisor:
    def __init__(self, record_path: Path):
        self.path = record_path
        self.qdir = record_path.parent
        self.run_dir = self.qdir.parent
        self.rec = _read(record_path)
        self.job_id = self.rec["job_id"]

    def save(self, **changes) -> None:
        self.rec.update(changes)
        atomic_write_json(self.path, self.rec)

    def cancelled(self) -> bool:
        return (self.qdir / f"{self.job_id}.cancel").exists()

    def _blocked(self) -> bool:
        after = self.rec.get("after")
        if after:
            dep = _info(after, _read(_record_path(self.run_dir, after)), self.run_dir)
            if not dep.state.finished:
                return True
        for p in self.qdir.glob("*.json"):  # singleton: one running job per run
            if p != self.path:
                other = _info(p.stem, _read(p), self.run_dir)
                if other.state == JobState.RUNNING:
                    return True
        return False

    def wait_turn(self) -> bool:
        while True:
            if self.cancelled():
                self.save(state=JobState.CANCELLED.value, reason="cancelled while pending", ended=time.time())
                return False
            if not self._blocked():
                return True
            time.sleep(POLL_S * 2)

    def run(self) -> None:
        import subprocess

        if not self.wait_turn():
            return
        script = Path(self.rec["script"])
        timing = parse_local_header(script.read_text(encoding="utf-8"))
        start = time.time()
        end = start + timing.get("walltime_s", 3600)
        self.save(state=JobState.RUNNING.value, started=start, end_time=end, supervisor_pid=os.getpid())
        layout = RunLayout(self.run_dir)
        layout.logs.mkdir(exist_ok=True)
        env = dict(os.environ, HPCRL_JOB_ID=self.job_id, HPCRL_JOB_END_TIME=f"{end:.3f}")
        with open(layout.log(self.job_id), "ab") as log:
            proc = subprocess.Popen(["bash", str(script)], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=self.run_dir, env=env, start_new_session=True)
        self.save(pgid=proc.pid)
        outcome = self.watch(proc, end, timing)
        _killpg(proc.pid, signal.SIGKILL)  # like a scheduler: nothing of the job outlives it
        state = outcome or (JobState.COMPLETED if proc.returncode == 0 else JobState.FAILED)
        self.save(state=state.value, ended=time.time(), exit_code=proc.returncode,
                  reason={JobState.TIMEOUT: "TimeLimit", JobState.CANCELLED: "cancelled"}.get(state, ""))

    def watch(self, proc, end: float, timing: dict) -> JobState | None:
        lead, grace = timing.get("signal_lead_s", 0), timing.get("kill_grace_s", 5)
        usr1_sent, term_at, outcome = False, None, None
        while proc.poll() is None:
            now = time.time()
            if not usr1_sent and (now >= end - lead or (self.qdir / f"{self.job_id}.usr1").exists()):
                _signal(proc.pid, signal.SIGUSR1)  # the batch shell only, like Slurm's --signal=B:
                usr1_sent = True
            if term_at is None and (now >= end or self.cancelled()):
                outcome = JobState.CANCELLED if self.cancelled() else JobState.TIMEOUT
                _killpg(proc.pid, signal.SIGTERM)
                term_at = now
            if term_at is not None and now >= term_at + grace:
                _killpg(proc.pid, signal.SIGKILL)
            time.sleep(POLL_S)
        return outcome


def _signal(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _killpg(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "supervise":
        print("usage: python -m hpcrl.backends.local supervise RECORD.json", file=sys.stderr)
        return 2
    _Supervisor(Path(argv[1])).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
