"""Slurm: sbatch to submit, squeue/scontrol for state (sacct only as a last resort), scancel.

The `parse_*` functions are pure and tested against outputs recorded from a real Slurm
(tests/data/slurm/). The I/O methods go through `run_command`, so every failure becomes a one-line
BackendError naming the command and its stderr tail.
"""

from __future__ import annotations

import math
import re
import time

from ..errors import BackendError, SpecError
from ..proc import run_command, stderr_tail
from .base import Backend, Check, JobInfo, JobState, RankLaunch

# Every job state Slurm reports (squeue(1) "JOB STATE CODES"), mapped to ours. Only finished
# states map to a finished JobState: the lifecycle must never treat a job whose processes may
# still run (COMPLETING, STAGE_OUT, SUSPENDED) as over.
SLURM_STATES: dict[str, JobState] = {
    "PENDING": JobState.PENDING,
    "CONFIGURING": JobState.PENDING,  # allocated, nodes booting: the script has not started yet
    "REQUEUED": JobState.PENDING,  # will run again under the same id
    "REQUEUE_FED": JobState.PENDING,
    "REQUEUE_HOLD": JobState.PENDING,  # held after a requeue; runs once released
    "RESV_DEL_HOLD": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "COMPLETING": JobState.RUNNING,  # script done, processes still being cleaned up
    "SUSPENDED": JobState.RUNNING,  # keeps its allocation; resumes in place
    "STOPPED": JobState.RUNNING,  # SIGSTOPped, keeps its allocation
    "SIGNALING": JobState.RUNNING,
    "RESIZING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,  # burst-buffer stage-out after the script ended
    "COMPLETED": JobState.COMPLETED,
    "CANCELLED": JobState.CANCELLED,
    "REVOKED": JobState.CANCELLED,  # federation: a sibling started elsewhere
    "FAILED": JobState.FAILED,
    "NODE_FAIL": JobState.FAILED,
    "BOOT_FAIL": JobState.FAILED,
    "OUT_OF_MEMORY": JobState.FAILED,
    "SPECIAL_EXIT": JobState.FAILED,
    "TIMEOUT": JobState.TIMEOUT,
    "DEADLINE": JobState.TIMEOUT,  # killed at its --deadline: out of time, like a walltime
    "PREEMPTED": JobState.PREEMPTED,
}

# Options of the form --long-name; anything else could smuggle a second option into the line.
_OPTION_RE = re.compile(r"[a-z][a-z0-9-]*\Z")
# Values made only of these need no quoting in an #SBATCH line.
_PLAIN_VALUE_RE = re.compile(r"[A-Za-z0-9_.,:/=+%@-]+\Z")
_JOB_ID_RE = re.compile(r"[0-9]+(_[0-9]+)?\Z")
_NO_TIME = {"", "N/A", "NONE", "UNKNOWN", "NONE_SET"}
POLL_CHUNK = 500  # job ids per squeue/sacct call (argv stays far below ARG_MAX)


def map_state(slurm_state: str) -> JobState:
    """'CANCELLED by 0' (sacct) and 'RUNNING' both work; an unheard-of state is UNKNOWN."""
    word = slurm_state.strip().split(" ")[0].upper().rstrip("+")
    return SLURM_STATES.get(word, JobState.UNKNOWN)


def _sbatch_quote(value: str) -> str:
    # sbatch reads #SBATCH lines itself (bash sees comments): quotes group, a backslash escapes the
    # next character even inside single quotes, an unquoted '#' ends the line. shlex.quote would
    # lose backslashes, so escape '\' and "'" and wrap in single quotes.
    if _PLAIN_VALUE_RE.match(value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def sbatch_directives(opts: dict) -> list[str]:
    """Sorted `#SBATCH --key=value` lines; None/False are left out, True is a bare flag."""
    lines = []
    for key in sorted(opts):
        value = opts[key]
        if not isinstance(key, str) or not _OPTION_RE.match(key):
            raise SpecError(f"sbatch option {key!r}: not a long option name (lowercase letters, digits, '-')")
        if value is None or value is False:
            continue
        if value is True:
            lines.append(f"#SBATCH --{key}")
            continue
        text = str(value)
        if any(c in text for c in "\n\r\0"):
            raise SpecError(f"sbatch option '{key}': value {text!r} contains a newline or NUL; use one line")
        lines.append(f"#SBATCH --{key}={_sbatch_quote(text)}")
    return lines


def walltime_minutes(hours: float) -> int:
    # Slurm limits are whole minutes; round up so a user never gets less than asked (after
    # rounding to whole seconds: 0.0167 h means one minute, not two).
    return max(1, math.ceil(round(hours * 3600) / 60))


def sbatch_options(resolved: dict, run_id: str, layout) -> dict:
    """Every sbatch option of a segment (site and spec scheduler_flags below hpcrl's own)."""
    spec, site = resolved["spec"], resolved["site"]
    res, budget = spec["resources"], spec["budget"]
    opts = {
        "account": site.get("account"),
        "qos": site.get("qos"),
        "partition": site.get("partition"),
        "constraint": site.get("constraint"),
        "nodes": res["nodes"],
        "gpus-per-node": res.get("gpus_per_node") or None,
        "cpus-per-task": res.get("cpus_per_task"),
        "mem": f"{res['mem_gb']:g}G" if res.get("mem_gb") else None,
        "time": walltime_minutes(budget["hours"]),
        "time-min": walltime_minutes(budget["hours_min"]) if budget.get("hours_min") else None,
        "signal": f"B:USR1@{int(site['signal_lead_s'])}",
        "open-mode": "append",
        "job-name": run_id,
        "output": str(layout.log_pattern("%j")),
        "chdir": str(layout.root),  # never the submitter's cwd (a stray ./hpcrl would shadow the snapshot)
        "dependency": "singleton",
    }
    return {**site.get("scheduler_flags", {}), **spec.get("scheduler_flags", {}), **opts}


# --- pure parsers ------------------------------------------------------------------------------

def _epoch(text: str) -> float | None:
    """Slurm's local-time 'YYYY-MM-DDTHH:MM:SS' as unix seconds; N/A, NONE, Unknown -> None."""
    text = text.strip()
    if text.upper() in _NO_TIME:
        return None
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def _exit_code(text: str) -> int | None:
    # 'code:signal'; a job killed by a signal reads as the shell would report it (128 + signal).
    m = re.match(r"(\d+):(\d+)", text.strip())
    if not m:
        return None
    code, signal = int(m.group(1)), int(m.group(2))
    return 128 + signal if signal else code


def _info(job_id: str, state: str, reason: str, start: float | None, end: float | None,
          exit_code: int | None) -> JobInfo:
    mapped = map_state(state)
    # Slurm fills in an *expected* start for pending jobs: JobInfo carries only starts that
    # happened. A running job's end is its limit (start + time limit): exactly what the segment
    # needs for its deadline, so it is kept.
    if mapped is JobState.PENDING:
        start, end = None, None
    if not mapped.finished:
        exit_code = None
    return JobInfo(job_id, mapped, "" if reason == "None" else reason, start, end, exit_code)


def parse_squeue_text(text: str) -> dict[str, JobInfo]:
    """Lines of `squeue -h -o '%i|%T|%r|%S|%e'` (no exit code in this format)."""
    jobs = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 5:
            continue
        job_id, state, reason, start, end = parts
        jobs[job_id] = _info(job_id, state, reason, _epoch(start), _epoch(end), None)
    return jobs


def _json_number(value) -> float | None:
    # 22.05 gives plain ints (0 = unset); 23.02+ gives {"set": bool, "infinite": bool, "number": n}.
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    return value if isinstance(value, (int, float)) and value > 0 else None


def _json_exit_code(value) -> int | None:
    if isinstance(value, int):  # 22.05: the raw wait status (768 = exit 3; 15 = SIGTERM)
        return 128 + (value & 0x7F) if value & 0x7F else value >> 8
    if not isinstance(value, dict):
        return None
    # 23.02+: {"status": [...], "return_code": {"set", "number"}, "signal": {"id": {...}, "name"}}
    signal = _json_number((value.get("signal") or {}).get("id"))
    if signal:
        return 128 + int(signal)
    code = value.get("return_code")
    if isinstance(code, dict):
        return int(code.get("number", 0)) if code.get("set", True) else None
    return code if isinstance(code, int) else None


def parse_squeue_json(data: dict, job_ids=None) -> dict[str, JobInfo]:
    """`squeue --json` output (already json-loaded), limited to `job_ids` when given."""
    wanted = {str(j) for j in job_ids} if job_ids is not None else None
    jobs = {}
    for job in data.get("jobs", []):
        job_id = str(job.get("job_id"))
        if wanted is not None and job_id not in wanted:
            continue
        state = job.get("job_state", "")
        if isinstance(state, list):  # 23.02+: base state first, then flags
            state = state[0] if state else ""
        jobs[job_id] = _info(job_id, state, str(job.get("state_reason", "")),
                             _json_number(job.get("start_time")), _json_number(job.get("end_time")),
                             _json_exit_code(job.get("exit_code")))
    return jobs


def parse_scontrol(text: str) -> dict[str, JobInfo]:
    """`scontrol show job` output: one or more records of Key=Value fields."""
    jobs = {}
    for record in re.split(r"\n\s*\n", text):
        fields = dict(re.findall(r"([A-Za-z][\w/:]*)=(\S*)", record))
        if "JobId" not in fields or "JobState" not in fields:
            continue
        job_id = fields["JobId"]
        jobs[job_id] = _info(job_id, fields["JobState"], fields.get("Reason", ""),
                             _epoch(fields.get("StartTime", "")), _epoch(fields.get("EndTime", "")),
                             _exit_code(fields.get("ExitCode", "")))
    return jobs


def parse_sacct(text: str) -> dict[str, JobInfo]:
    """`sacct -P -n -o JobID,State,ExitCode,Start,End`; step lines (123.batch) are skipped."""
    jobs = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 5 or "." in parts[0]:
            continue
        job_id, state, exit_code, start, end = parts
        jobs[job_id] = _info(job_id, state, "", _epoch(start), _epoch(end), _exit_code(exit_code))
    return jobs


def parse_sbatch_parsable(text: str) -> str:
    """`sbatch --parsable` prints 'ID' or 'ID;cluster'."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    job_id = lines[-1].split(";")[0] if lines else ""
    if not _JOB_ID_RE.match(job_id):
        raise BackendError(f"sbatch --parsable printed {text.strip()[:200]!r}, not a job id")
    return job_id


def parse_walltime(text: str) -> float | None:
    """Slurm's [D-]HH:MM:SS, MM:SS or MM as hours; '' / UNLIMITED / Partition_Limit -> None."""
    text = text.strip()
    if not text or text.upper() in ("UNLIMITED", "INFINITE", "PARTITION_LIMIT", "NONE"):
        return None
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
    parts = [int(p) for p in text.split(":")]
    h, m, sec = ([0, 0] + parts)[-3:] if len(parts) > 1 else (0, parts[0], 0)
    return days * 24 + h + m / 60 + sec / 3600


def parse_sinfo_nodes(text: str) -> list[tuple[str, set, int]]:
    """`sinfo -h -N -o '%N|%f|%G'` lines -> (node, features, GPUs); gres like gpu:4 or gpu:a100:4(S:0)."""
    nodes = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 3:
            continue
        name, features, gres = parts
        gpus = 0
        for item in gres.split(","):
            m = re.match(r"gpu(?::[^:(]+)?:(\d+)", item.strip())
            if m:
                gpus += int(m.group(1))
        nodes.append((name, {f for f in features.split(",") if f and f != "(null)"}, gpus))
    return nodes


def constraint_terms(constraint: str) -> set:
    """The features a constraint needs on one node: 'gpu&hbm80g' -> {gpu, hbm80g} (| and [] not split)."""
    return {t.strip() for t in re.split(r"[&,]", constraint or "") if t.strip()}


def doctor_checks(site: dict, run) -> list[Check]:
    """The Slurm checks of `hpcrl doctor`; `run(argv)` is the command helper (a CommandResult)."""
    import getpass

    checks = []
    try:
        info = run(["sinfo", "-h", "-N", "-o", "%N|%f|%G"])
    except BackendError as e:
        return [Check("scheduler", "fail", str(e), "run doctor on a login node of the cluster, where sinfo answers")]
    if info.returncode != 0:
        return [Check("scheduler", "fail", f"sinfo failed: {stderr_tail(info)}", "is slurmctld up? try `scontrol ping`")]
    nodes = parse_sinfo_nodes(info.stdout)
    checks.append(Check("scheduler", "pass", f"slurmctld answers: {len(nodes)} node(s)"))
    want, gpus = constraint_terms(site.get("constraint") or ""), int(site.get("gpus_per_node") or 0)
    fits = [n for n, feats, g in nodes if want <= feats and g >= gpus]
    if fits:
        checks.append(Check("nodes", "pass", f"{len(fits)} node(s) with {'&'.join(sorted(want)) or 'any features'} "
                                             f"and >= {gpus} GPUs"))
    else:
        have = sorted({f for _, feats, _ in nodes for f in feats})
        most = max((g for _, _, g in nodes), default=0)
        checks.append(Check("nodes", "fail", f"no node has features {sorted(want)} with {gpus} GPUs (features here: "
                                             f"{', '.join(have) or 'none'}; most GPUs on a node: {most})",
                            "fix the site's constraint / gpus_per_node (sinfo -o '%N %f %G' lists them)"))
    user = getpass.getuser()
    account = site.get("account")
    try:
        acc = run(["sacctmgr", "-n", "-P", "show", "associations", "where", f"account={account or ''}",
                   f"user={user}", "format=Account,User,QOS"])
    except BackendError:
        acc = None
    if acc is None or acc.returncode != 0:
        why = stderr_tail(acc) if acc is not None else "sacctmgr is not installed"
        checks.append(Check("account", "warn", f"cannot check accounts here ({why})",
                            "ask your centre which account to use; Slurm refuses a wrong one at submit"))
        return checks
    if not account:
        checks.append(Check("account", "fail", "the site has no account",
                            "pass --account A, export HPCRL_ACCOUNT=A, or add account: to your site profile"))
    elif not any(line.split("|")[:2] == [account, user] for line in acc.stdout.splitlines()):
        checks.append(Check("account", "fail", f"account '{account}' has no association for user {user}",
                            f"check the name (`sacctmgr show associations user={user}` lists yours; GPU "
                            f"accounts end in _g) and pass --account"))
    else:
        checks.append(Check("account", "pass", f"user {user} may charge account '{account}'"))
    qos = run(["sacctmgr", "-n", "-P", "show", "qos", "format=Name,MaxWall"])
    if qos.returncode != 0:
        checks.append(Check("qos", "warn", f"cannot read the QOS table: {stderr_tail(qos)}", "ask your centre"))
        return checks
    limits = {}
    for line in qos.stdout.splitlines():
        name, _, wall = line.partition("|")
        if name.strip():
            limits[name.strip()] = parse_walltime(wall)
    table = site.get("qos_table") or {}
    missing = sorted(q for q in table if q not in limits)
    drift = sorted(f"{q}: profile {((table[q] or {}).get('max_hours'))} h, Slurm {limits[q]} h" for q in table
                   if q in limits and limits[q] is not None and (table[q] or {}).get("max_hours") is not None
                   and abs(limits[q] - table[q]["max_hours"]) > 1e-6)
    if site.get("qos") and limits and site["qos"] not in limits:
        checks.append(Check("qos", "fail", f"the site's QOS '{site['qos']}' does not exist here (Slurm has: "
                                           f"{', '.join(sorted(limits))})", "pass --qos Q or fix the site's qos"))
    elif drift or missing:
        what = "; ".join(drift + [f"{q}: not in Slurm" for q in missing])
        checks.append(Check("qos", "warn", f"the profile's QOS table differs from Slurm's: {what}",
                            "update qos_table in your site profile (sacctmgr show qos format=Name,MaxWall)"))
    else:
        checks.append(Check("qos", "pass", f"{len(table)} QOS limits agree with Slurm's" if table else "no QOS table"))
    return checks


# torchrun's c10d rendezvous port on the first node: derived from the job id, so two jobs that share
# a node (shared QOS, or a test cluster) do not collide and nothing needs configuring. Below Linux's
# ephemeral range (32768+), where outgoing connections take their ports.
RDZV_PORT_BASE, RDZV_PORT_SPAN = 15000, 15000

RANKS_PRELUDE = f"""\
# torchrun's rendezvous: a c10d store on the first node of the job (every node's torchrun meets
# there and numbers the ranks), on a port derived from the job id, the job id as rendezvous id.
hpcrl_rdzv_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
hpcrl_rdzv_port=$(( {RDZV_PORT_BASE} + ${{HPCRL_JOB_ID%%_*}} % {RDZV_PORT_SPAN} ))
echo "hpcrl: torchrun rendezvous at $hpcrl_rdzv_host:$hpcrl_rdzv_port"
"""


def rank_launch(resolved: dict) -> RankLaunch:
    """One torchrun per node under srun; a rank that dies takes the whole step down (torchrun ends
    its node's other ranks, --kill-on-bad-exit every other node's), so the segment fails at once
    instead of hanging in a collective until the walltime."""
    from ..shell import Word

    res = resolved["spec"]["resources"]
    # since Slurm 22.05 srun no longer inherits the job's --cpus-per-task: without it the one task
    # per node (torchrun and all its ranks) would be bound to a single CPU. A job that asked for
    # no CPUs per task gets the node's CPUs of its allocation.
    cpus = int(res["cpus_per_task"]) if res.get("cpus_per_task") else Word('"$SLURM_CPUS_ON_NODE"')
    prefix = ["srun", f"--nodes={int(res['nodes'])}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
              Word(f"--cpus-per-task={cpus}")]
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", Word('"$hpcrl_rdzv_host:$hpcrl_rdzv_port"'),
                  "--rdzv-id", Word('"$HPCRL_JOB_ID"')]
    return RankLaunch(prelude=RANKS_PRELUDE, prefix=prefix, rendezvous=rendezvous)


# --- I/O ---------------------------------------------------------------------------------------

class SlurmBackend(Backend):
    name = "slurm"

    job_id_variable = "SLURM_JOB_ID"

    def directives(self, resolved: dict, run_id: str, layout) -> list[str]:
        return sbatch_directives(sbatch_options(resolved, run_id, layout))

    def rank_launch(self, resolved: dict) -> RankLaunch:
        return rank_launch(resolved)

    def doctor(self, site: dict) -> list[Check]:
        return doctor_checks(site, lambda argv: run_command(argv, timeout_s=30, check=False))

    def submit(self, run, resolved: dict, after: str | None = None) -> str:
        return self.sbatch(run.layout.script, after)

    def sbatch(self, script, after: str | None = None) -> str:
        """Queue one script. Job name, output path and resources are #SBATCH lines in the rendered script, so that
        the script alone says how it runs; only the chain link is decided at submit time."""
        argv = ["sbatch", "--parsable"]
        if after:
            # The command line replaces the script's --dependency=singleton: keep both.
            argv.append(f"--dependency=afterany:{after},singleton")
        argv.append(str(script))
        return parse_sbatch_parsable(run_command(argv).stdout)

    def query(self, job_ids: list[str], run=None) -> dict[str, JobInfo]:
        """State of each job, with exit codes of finished ones; a job that no command knows any
        more is UNKNOWN. One squeue, then scontrol per finished job (squeue's format has no exit
        code), then one sacct for the rest and for finished jobs still without an exit code: for a
        few jobs (a segment asking for its own)."""
        ids = [str(j) for j in job_ids]
        if not ids:
            return {}
        found = self._squeue(ids)
        for job_id in [j for j in ids if j not in found or found[j].state.finished]:
            found.update(self._scontrol(job_id))
        # sacct too for a finished job whose exit code neither told: squeue's COMPLETED with nothing
        # from scontrol was seen after a slurmctld outage, and a job's record then had no exit code
        missing = [j for j in ids if j not in found or (found[j].state.finished and found[j].exit_code is None)]
        if missing:
            found.update({j: info for j, info in self._sacct(missing).items()
                          if j not in found or info.exit_code is not None})
        return {j: found.get(j) or JobInfo(j, JobState.UNKNOWN, "not known to squeue, scontrol or sacct")
                for j in ids}

    def poll(self, jobs: list[tuple]) -> dict[str, JobInfo]:
        """Many jobs of many runs: one squeue per POLL_CHUNK job ids, one sacct for the ids squeue
        no longer lists; never a call per job (a centre notices O(runs) RPCs per `status`)."""
        ids = sorted({str(j) for _, j in jobs})
        found: dict[str, JobInfo] = {}
        for i in range(0, len(ids), POLL_CHUNK):
            found.update(self._squeue(ids[i:i + POLL_CHUNK]))
        missing = [j for j in ids if j not in found]
        for i in range(0, len(missing), POLL_CHUNK):
            found.update(self._sacct(missing[i:i + POLL_CHUNK]))
        return {j: found.get(j) or JobInfo(j, JobState.UNKNOWN, "not known to squeue or sacct") for j in ids}

    def _squeue(self, ids: list[str]) -> dict[str, JobInfo]:
        # Text with -j, not --json: Slurm 22.05's --json ignores -j and dumps every job on the
        # cluster (tens of MB on a large site). -t all: finished jobs too, until MinJobAge.
        argv = ["squeue", "-h", "-t", "all", "-o", "%i|%T|%r|%S|%e", "-j", ",".join(ids)]
        # Slurm's own client gives up on an unresponsive slurmctld after ~20 s (MessageTimeout
        # twice); the bound here is only for a client that hangs.
        result = run_command(argv, check=False, timeout_s=45)
        if result.returncode == 0:
            return parse_squeue_text(result.stdout)
        if "Invalid job id" in result.stderr:  # none of the ids is known any more
            return {}
        raise BackendError(f"squeue failed: {stderr_tail(result)}")

    def _scontrol(self, job_id: str) -> dict[str, JobInfo]:
        result = run_command(["scontrol", "show", "job", job_id], check=False)
        return parse_scontrol(result.stdout) if result.returncode == 0 else {}

    def _sacct(self, ids: list[str]) -> dict[str, JobInfo]:
        # Often unavailable (no slurmdbd: "accounting storage is disabled"); then we know nothing.
        argv = ["sacct", "-P", "-n", "-X", "-o", "JobID,State,ExitCode,Start,End", "-j", ",".join(ids)]
        try:
            result = run_command(argv, check=False)
        except BackendError:  # sacct not installed
            return {}
        return parse_sacct(result.stdout) if result.returncode == 0 else {}

    def checkpoint_stop(self, job_ids: list[str], run=None) -> None:
        # To the batch shell only, as the walltime's --signal=B:USR1 does: its trap sets the
        # checkpointing flag and forwards USR1 to the trainer (or the stop file to the ranks).
        ids = [str(j) for j in job_ids]
        if not ids:
            return
        result = run_command(["scancel", "--signal=USR1", "--batch", *ids], check=False)
        if result.returncode != 0 and "Invalid job id" not in result.stderr:
            raise BackendError(f"scancel --signal=USR1 failed: {stderr_tail(result)}")

    def cancel(self, job_ids: list[str], run=None) -> None:
        ids = [str(j) for j in job_ids]
        if not ids:
            return
        result = run_command(["scancel", *ids], check=False)
        # Cancelling a job that already ended is not an error for us: the goal state holds.
        if result.returncode != 0 and "Invalid job id" not in result.stderr:
            raise BackendError(f"scancel failed: {stderr_tail(result)}")

