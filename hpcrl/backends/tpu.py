"""The tpu backend: single-host Cloud TPU VMs obtained through gcloud queued resources.

One queued resource (QR) per run, re-created only after a preemption or a loss: its VM runs a
rendered startup script (templates/tpu-startup.sh.j2) that fetches the run's files from the
bucket and runs the run's segments one after the other (the same job.sh every backend runs, each
under its deadline; segment m of QR is job QR.m, queued on the VM by `_segment next`), copies
logs/state/metrics/checkpoints back, sends a heartbeat, and deletes its own QR when the run needs
no more. A TPU VM cannot re-create itself, so `reconciles_outside_job` is True and tpu_watch.py
re-creates preempted VMs, deletes silent ones and starts a VM when the run has none.

Bucket layout (run_uri = BUCKET/hpcrl-runs/RUN/run):
    run_uri/...                     the run dir: spec, job.sh, lib/, checkpoints/, logs/, metrics
    run_uri/state.json              published by the launcher before a segment starts
    run_uri/jobs/QR/state.json      the VM's view while it runs; final.json once it is done; heartbeat
    BUCKET/hpcrl-runs/RUN/venv.tar.zst (.ok)   venv_root packed by the run's first VM
    BUCKET/hpcrl-runs/RUN/secrets.env   WANDB_API_KEY / HF_TOKEN, shell-quoted (never in the run dir)

Pure functions (`*_argv`, `parse_*`, `explain`, `qr_name`, `render_startup`) are separate from
the methods that run gcloud, all through base.run_command.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import time
from pathlib import Path

from ..atomicio import atomic_write_json, atomic_write_text
from ..errors import BackendError, SiteError, SpecError, one_of
from ..names import gs_url_problem
from ..runs import RunLayout
from ..shell import q
from ..proc import run_command, stderr_tail
from .base import Backend, Check, JobInfo, JobState
from .tpu_gcloud import STATES, QrStatus, explain, parse_describe, parse_list  # noqa: F401 (the backend's API)

PROVISIONING = {  # mode -> (gcloud release track, extra create flags)
    "spot": ([], ["--spot"]),
    "reserved": ([], ["--reserved"]),
    "on-demand": ([], []),
    "best-effort": (["alpha"], ["--best-effort"]),
}

WATCH_STALE_S = 600  # a watcher polls every 60 s by default: ten minutes of silence means none runs

# Secrets the VM cannot inherit from the user's shell: passed through the bucket (see module doc).
SECRET_NAMES = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
# Run-dir entries that only the VM writes (copied back from the bucket, never uploaded over it).
_L = RunLayout(".")
VM_OWNED = {p.name for p in (_L.state, _L.logs, _L.checkpoints, _L.metrics, _L.private("queue"), _L.private("tpu"),
                             _L.lock, _L.checkpointing_flag)} | {"jobs"}

_PROJECT_RE = re.compile(r"^([a-z0-9.-]+:)?[a-z][a-z0-9-]{4,61}[a-z0-9]$")
_ZONE_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")
_ACCEL_RE = re.compile(r"^v[0-9]+[a-z]*-[0-9]+$")
_RUNTIME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# No spaces or quotes: the bucket reaches gcloud argv and (quoted) the startup script.
_BUCKET_RE = re.compile(r"^gs://[a-z0-9]([a-z0-9._-]{0,220}[a-z0-9])?(/[A-Za-z0-9._/-]*)?$")


# ---------------------------------------------------------------- site values


def check_site(site: dict) -> None:
    """Every value the tpu backend needs, with a one-line fix for the first that is wrong."""
    name = site.get("name")
    fixes = {"project": "P (or `gcloud config set project P`)", "zone": "Z (or `gcloud config set compute/zone Z`)",
             "bucket": "gs://NAME (create it: gcloud storage buckets create gs://NAME --location=REGION)",
             "accelerator_type": "v5p-8", "runtime_version": "v2-alpha-tpuv5"}
    for key, pattern in (("project", _PROJECT_RE), ("zone", _ZONE_RE), ("accelerator_type", _ACCEL_RE),
                         ("runtime_version", _RUNTIME_RE), ("bucket", _BUCKET_RE)):
        value = site.get(key)
        if value in (None, ""):
            raise SiteError(f"site '{name}': {key} is not set; pass --set site.{key}={fixes[key]}")
        if not isinstance(value, str) or not pattern.match(value):
            raise SiteError(f"site '{name}': {key} {value!r} is not valid; e.g. --set site.{key}={fixes[key]}")
    problem = gs_url_problem(site["bucket"])
    if problem:
        raise SiteError(f"site '{name}': bucket {site['bucket']} {problem}; e.g. --set site.bucket={fixes['bucket']}")
    if site.get("provisioning") not in PROVISIONING:
        raise SiteError(f"site '{name}': provisioning {site.get('provisioning')!r} must be one of {one_of(PROVISIONING)}")
    retries = site.get("max_retries")
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise SiteError(f"site '{name}': max_retries {retries!r} must be a whole number >= 0, e.g. 5")


def complete_site(site: dict) -> dict:
    """Fill project and zone from the user's gcloud configuration when the site leaves them out
    (at render/submit time, so the run's frozen spec records the values used), then check all."""
    for key, prop in (("project", "project"), ("zone", "compute/zone")):
        if site.get(key) in (None, "") and shutil.which("gcloud"):
            out = run_command(["gcloud", "config", "get-value", prop], timeout_s=30, check=False)
            value = out.stdout.strip() if out.returncode == 0 else ""
            site[key] = value if value and value != "(unset)" else None
    site["bucket"] = site["bucket"].rstrip("/") if isinstance(site.get("bucket"), str) else site.get("bucket")
    check_site(site)
    return site


# ---------------------------------------------------------------- names and places


def qr_name(run_id: str, n: int) -> str:
    """The queued-resource (and node) id of segment job n: lowercase letters, digits, '-', at most
    63 characters; a short hash keeps ids unique when the run id had to be changed to fit."""
    import hashlib

    base = re.sub(r"[^a-z0-9]+", "-", run_id.lower()).strip("-")
    suffix = f"-{n}"
    if base != run_id or len("hpcrl-" + base + suffix) > 63:
        digest = hashlib.sha256(run_id.encode()).hexdigest()[:6]
        base = f"{base[:63 - len('hpcrl-') - len(suffix) - 7].rstrip('-')}-{digest}"
    return f"hpcrl-{base}{suffix}"


DEFAULT_VM_ROOT = "/var/lib/hpcrl"  # where runs live on the VM (it runs the startup script as root)


def vm_run_dir(site: dict, run_id: str) -> str:
    return f"{(site.get('vm_root') or DEFAULT_VM_ROOT).rstrip('/')}/runs/{run_id}"


def run_uri(site: dict, run_id: str) -> str:
    return f"{site['bucket'].rstrip('/')}/hpcrl-runs/{run_id}/run"


def secrets_uri(site: dict, run_id: str) -> str:
    return f"{site['bucket'].rstrip('/')}/hpcrl-runs/{run_id}/secrets.env"


def venv_uri(site: dict, run_id: str) -> str:
    """Where the run's first VM packs its venvs (+ .tar.zst or .tar.gz, and .ok once complete)."""
    return f"{site['bucket'].rstrip('/')}/hpcrl-runs/{run_id}/venv"


def _uri(path: Path) -> str:
    # a RunLayout rooted at gs://b/x gives Path("gs:/b/x/..."): put the double slash back
    return str(path).replace("gs:/", "gs://", 1)


# ---------------------------------------------------------------- argv (pure)


def _gcloud(site: dict, *words: str) -> list[str]:
    track, _ = PROVISIONING.get(site.get("provisioning"), ([], []))
    return ["gcloud", *track, "compute", "tpus", "queued-resources", *words]


def _where(site: dict) -> list[str]:
    return [f"--project={site['project']}", f"--zone={site['zone']}"]


def create_argv(site: dict, qr_id: str, startup_file) -> list[str]:
    """`queued-resources create` for the site's provisioning mode (best-effort is alpha-only)."""
    _, flags = PROVISIONING[site["provisioning"]]
    return [*_gcloud(site, "create", qr_id), f"--node-id={qr_id}", *_where(site),
            f"--accelerator-type={site['accelerator_type']}", f"--runtime-version={site['runtime_version']}",
            *flags, f"--metadata-from-file=startup-script={startup_file}", "--quiet"]


def describe_argv(site: dict, qr_id: str) -> list[str]:
    return [*_gcloud(site, "describe", qr_id), *_where(site), "--format=json"]


def delete_argv(site: dict, qr_id: str) -> list[str]:
    # --force deletes the node with it; --async: the VM's shutdown need not hold up hpcrl.
    return [*_gcloud(site, "delete", qr_id), *_where(site), "--force", "--quiet", "--async"]


def list_argv(site: dict) -> list[str]:
    return [*_gcloud(site, "list"), *_where(site), "--format=json"]


# ---------------------------------------------------------------- the VM startup script (pure)


def check_gs_paths(text: str) -> None:
    """Every gs:// path in a rendered script names a real-looking bucket (no recipe placeholder):
    a run that would fail on the VM, after a VM was provisioned, is refused here."""
    for url in sorted(set(re.findall(r"gs://[^\s'\"]*", text))):
        problem = gs_url_problem(url)
        if problem:
            raise SpecError(f"the rendered job uses {url}, which {problem}: set the spec's path to your bucket's "
                            f"(or site.bucket: --set site.bucket=gs://NAME)")


def segment_seconds(hours: float) -> int:
    return max(1, round(float(hours) * 3600))


def stall_seconds(site: dict, hours: float) -> int:
    """How long a VM may go without a heartbeat in the bucket before it is deleted (by itself, or
    by the watcher): its segment, the kill grace and site.report_margin_s (a slow upload)."""
    return segment_seconds(hours) + int(site["kill_grace_s"]) + int(site.get("report_margin_s") or 0)


def render_startup(resolved: dict, run_id: str, qr_id: str) -> str:
    """The VM's startup script for segment job `qr_id` (every user value quoted by hpcrl.shell.q)."""
    import jinja2

    from .. import __version__
    from ..paths import templates_dir

    site = resolved["site"]
    jenv = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, autoescape=False)
    jenv.filters["q"] = q
    return jenv.get_template("tpu-startup.sh.j2").render(
        version=__version__, run_id=run_id, site_name=site["name"], job_id=qr_id,
        run_uri=run_uri(site, run_id), secrets_uri=secrets_uri(site, run_id), run_dir=vm_run_dir(site, run_id),
        hpcrl_python=site.get("hpcrl_python") or "python3",
        segment_s=segment_seconds(resolved["spec"]["budget"]["hours"]),
        signal_lead_s=int(site["signal_lead_s"]), kill_grace_s=int(site["kill_grace_s"]),
        stall_s=stall_seconds(site, resolved["spec"]["budget"]["hours"]),
        delete_command=" ".join(q(a) for a in delete_argv(site, qr_id)),
        venv_root=site.get("venv_root") or "", venv_uri=venv_uri(site, run_id),
    )


def dry_run(resolved: dict, run_id: str, job_script: str) -> str:
    """What `hpcrl render` shows for a TPU site: job.sh, the create argv and the startup script,
    from the same functions submit uses."""
    site = resolved["site"]
    qr_id = qr_name(run_id, 1)
    startup = f"RUN_DIR/.tpu/{qr_id}.startup.sh"
    argv = create_argv(site, qr_id, startup)
    rule = "# " + "=" * 76
    return "\n".join([
        job_script.rstrip("\n"), "", rule, "# gcloud argv of the first segment (one argument per line; not a shell string):",
        *(f"#   {a}" for a in argv), "# as a command line:", f"#   {shlex.join(argv)}", rule,
        f"# {startup}: the VM's startup script (--metadata-from-file=startup-script=...)", rule,
        render_startup(resolved, run_id, qr_id).rstrip("\n"), "",
    ])


# ---------------------------------------------------------------- the backend (runs gcloud)


class TpuBackend(Backend):
    name = "tpu"
    reconciles_outside_job = True  # the VM cannot queue its successor: backends/tpu_watch.py does
    job_id_missing = "the TPU startup script sets HPCRL_JOB_ID"
    jobs_share_this_environment = False  # the VM has its own Python, venvs and disk
    site_keys = {"project": None, "zone": None, "accelerator_type": None, "runtime_version": None,
                 "provisioning": None, "bucket": None, "max_retries": None, "vm_root": DEFAULT_VM_ROOT,
                 "report_margin_s": 900}

    def job_layout(self, run_id: str, layout):
        return RunLayout(vm_run_dir(self.site, run_id))

    def next_job_here(self, state: dict, job_id: str) -> str:
        """The VM runs the run's next segment itself (one VM per run, re-created only after a
        preemption or a failure): segment m of queued resource Q is job Q.m."""
        from .tpu_watch import vm_jobs

        qr = job_id.split(".", 1)[0]
        return f"{qr}.{len(vm_jobs(qr, [s.get('job_id') for s in state['segments']])) + 1}"

    def submit_hint(self, run_id: str) -> list[str]:
        return [f"  keep `hpcrl watch {run_id}` running (e.g. under nohup): it re-creates preempted VMs "
                "and deletes silent ones"]

    def reconcile(self, run, ops, interval_s: float) -> dict:
        from . import tpu_watch

        return tpu_watch.tick(run, self, ops, interval_s)

    def follow(self, run, ops, interval_s: float) -> None:
        from . import tpu_watch

        tpu_watch.follow_in_background(run, self, interval_s, ops)

    def doctor(self, site: dict) -> list[Check]:
        if shutil.which("gcloud") is None:
            return [Check("gcloud", "fail", "gcloud is not installed",
                          "install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install)")]
        checks = []
        auth = run_command(["gcloud", "auth", "list", "--filter=status:ACTIVE", "--format=value(account)"],
                           timeout_s=30, check=False)
        who = auth.stdout.strip().splitlines() if auth.returncode == 0 else []
        checks.append(Check("gcloud auth", "pass", f"authenticated as {who[0]}") if who else
                      Check("gcloud auth", "fail", "no active gcloud account", "run `gcloud auth login`"))
        try:
            complete_site(site)
        except (SiteError, BackendError) as e:
            return checks + [Check("site", "fail", str(e), "set the value in your site profile or with --set")]
        checks.append(Check("site", "pass", f"project {site['project']}, zone {site['zone']}, bucket {site['bucket']}"))
        ls = run_command(["gcloud", "storage", "ls", site["bucket"]], timeout_s=60, check=False)
        checks.append(Check("bucket", "pass", f"{site['bucket']} is readable") if ls.returncode == 0 else
                      Check("bucket", "fail", f"{site['bucket']}: {stderr_tail(ls)}",
                            explain(ls.stderr, site) or f"create it: gcloud storage buckets create {site['bucket']}"))
        types = run_command(["gcloud", "compute", "tpus", "accelerator-types", "list", f"--zone={site['zone']}",
                             f"--project={site['project']}", "--format=value(name)"], timeout_s=60, check=False)
        offered = {t.strip().rsplit("/", 1)[-1] for t in types.stdout.splitlines() if t.strip()}
        if types.returncode != 0:
            checks.append(Check("accelerator", "fail", f"zone {site['zone']}: {stderr_tail(types)}",
                                explain(types.stderr, site) or "check the zone name (--set site.zone=Z)"))
        elif site["accelerator_type"] in offered:
            checks.append(Check("accelerator", "pass", f"zone {site['zone']} offers {site['accelerator_type']}"))
        else:
            checks.append(Check("accelerator", "fail", f"zone {site['zone']} does not offer {site['accelerator_type']} "
                                                       f"(it has: {', '.join(sorted(offered)) or 'none'})",
                                "pick a zone that does: gcloud compute tpus accelerator-types list --zone=Z"))
        return checks

    def explain(self, message: str) -> str | None:
        return explain(message, self.site)

    def settled(self, run) -> bool:
        from . import tpu_watch

        return tpu_watch.open_record(run) is None

    def status_note(self, run, state: dict) -> str | None:
        from . import tpu_watch
        from ..lifecycle import is_active

        if not is_active(state):
            return None
        seen = tpu_watch.last_tick(run)
        if seen is None or time.time() - seen > WATCH_STALE_S:
            when = "never" if seen is None else time.strftime("%m-%d %H:%M", time.localtime(seen))
            return f"no watcher has looked at this run lately (last: {when}); keep `hpcrl watch {run.id}` running"
        return None

    def after_change(self, run) -> None:
        self.publish_state(run.dir)

    def complete_site(self, site: dict) -> dict:
        return complete_site(site)

    def dry_run(self, resolved: dict, run_id: str, job_script: str) -> str:
        return dry_run(resolved, run_id, job_script)

    def gcloud(self, argv: list[str], timeout_s: float = 120, check: bool = True, input_text: str | None = None):
        """Run gcloud; a failure becomes a one-line BackendError that says how to fix it."""
        if shutil.which("gcloud") is None:
            raise BackendError("gcloud is not installed: install the Google Cloud CLI "
                               "(https://cloud.google.com/sdk/docs/install), then `gcloud auth login`")
        res = run_command(argv, timeout_s=timeout_s, check=False, input_text=input_text)
        if check and res.returncode != 0:
            fix = explain(res.stderr, self.site)
            verb = " ".join(a for a in argv[1:6] if not a.startswith("-"))
            raise BackendError(f"gcloud {verb} failed: {fix}" if fix else f"gcloud {verb} failed: {stderr_tail(res)}")
        return res

    # -- segments

    def submit(self, run, resolved: dict, after: str | None = None) -> str:
        run_dir = run.dir
        check_site(self.site)
        tdir = run.layout.private("tpu")
        tdir.mkdir(exist_ok=True)
        n = 1 + len(list(tdir.glob("*.json")))  # called inside the run's lock: no race
        qr_id = qr_name(run_dir.name, n)
        if n == 1:  # the first create: refuse what could only fail on the VM
            check_gs_paths(run.layout.script.read_text(encoding="utf-8"))
            self.check_bucket()
        startup = tdir / f"{qr_id}.startup.sh"
        atomic_write_text(startup, render_startup(resolved, run_dir.name, qr_id), mode=0o644)
        self.stage(run_dir)
        if self.upload_secrets(run_dir.name):
            (tdir / "secrets-dropped").unlink(missing_ok=True)  # the watcher removes them again at the end
        argv = create_argv(self.site, qr_id, startup)
        self.gcloud(argv)
        atomic_write_json(tdir / f"{qr_id}.json", {"qr_id": qr_id, "n": n, "created": time.time(), "argv": argv,
                                                   "closed": None, "outcome": None,
                                                   "stall_s": stall_seconds(self.site, resolved["spec"]["budget"]["hours"])})
        return qr_id

    def check_bucket(self) -> None:
        """The submitting account can list the bucket (the run's files are uploaded there next)."""
        res = self.gcloud(["gcloud", "storage", "ls", self.site["bucket"]], check=False, timeout_s=60)
        if res.returncode != 0:
            raise BackendError(f"cannot list {self.site['bucket']} with your gcloud account ({stderr_tail(res)}): "
                               f"create it (gcloud storage buckets create {self.site['bucket']} --location=REGION) "
                               f"or get roles/storage.objectAdmin on it")

    def stage(self, run_dir: Path) -> None:
        """Upload the run's launcher-owned files (spec, job.sh, hpcrl snapshot, trainer files)."""
        items = sorted(str(p) for p in Path(run_dir).iterdir() if p.name not in VM_OWNED)
        self.gcloud(["gcloud", "storage", "cp", "--recursive", *items, run_uri(self.site, Path(run_dir).name) + "/"],
                    timeout_s=600)

    def publish_state(self, run_dir: Path) -> None:
        """The committed state.json, which the VM waits for before it starts the segment."""
        layout = RunLayout(run_dir)
        self.gcloud(["gcloud", "storage", "cp", str(layout.state), f"{run_uri(self.site, layout.root.name)}/{layout.state.name}"])

    def upload_secrets(self, run_id: str) -> bool:
        # Through stdin, so the values touch no file here; only when this shell has them (a
        # watcher started without them keeps what the submitting shell uploaded).
        lines = [f"export {k}={q(os.environ[k])}" for k in SECRET_NAMES if os.environ.get(k)]
        if lines:
            self.gcloud(["gcloud", "storage", "cp", "-", secrets_uri(self.site, run_id)], input_text="\n".join(lines) + "\n")
        return bool(lines)

    def checkpoint_stop(self, job_ids: list[str], run=None) -> None:
        # No scheduler signal reaches a TPU VM: its startup script looks for this object in the
        # bucket while the segment runs and gives the segment its walltime's USR1 when it appears
        for job_id in job_ids:
            self.gcloud(["gcloud", "storage", "cp", "-", f"{run_uri(self.site, run.id)}/jobs/{job_id}/stop"],
                        input_text="stop\n")

    def drop_secrets(self, run_id: str) -> None:
        self.gcloud(["gcloud", "storage", "rm", secrets_uri(self.site, run_id)], check=False)

    # -- state

    def describe(self, qr_id: str) -> QrStatus | None:
        """The queued resource's status; None when it no longer exists."""
        res = self.gcloud(describe_argv(self.site, qr_id), check=False)
        if res.returncode != 0:
            if re.search(r"NOT_FOUND|was not found|could not be found", res.stderr):
                return None
            self.gcloud(describe_argv(self.site, qr_id))  # raises the explained error
        return parse_describe(res.stdout)

    def query(self, job_ids: list[str], run=None) -> dict[str, JobInfo]:
        out = {}
        for job_id in job_ids:
            st = self.describe(job_id)
            out[job_id] = (JobInfo(job_id, JobState.UNKNOWN, "no such queued resource") if st is None else
                           JobInfo(job_id, st.job_state, f"{st.state}: {st.error}" if st.error else st.state))
        return out

    def delete(self, qr_id: str) -> None:
        res = self.gcloud(delete_argv(self.site, qr_id), check=False)
        if res.returncode != 0 and not re.search(r"NOT_FOUND|was not found", res.stderr):
            self.gcloud(delete_argv(self.site, qr_id))

    def cancel(self, job_ids: list[str], run=None) -> None:
        for job_id in job_ids:
            self.delete(job_id)

    def end_time(self, job_id: str, run, environ) -> float | None:
        value = environ.get("HPCRL_JOB_END_TIME")  # set by the startup script from the segment hours
        return float(value) if value else None

    # -- what the VM copied to the bucket

    def fetch_vm_state(self, run_id: str, qr_id: str) -> tuple[dict | None, bool]:
        """(the VM's state.json, whether the VM finished the segment and uploaded everything)."""
        base = f"{run_uri(self.site, run_id)}/jobs/{qr_id}"
        for name, done in (("final.json", True), ("state.json", False)):
            res = self.gcloud(["gcloud", "storage", "cat", f"{base}/{name}"], check=False)
            if res.returncode == 0:
                try:
                    return json.loads(res.stdout), done
                except ValueError:
                    continue  # a torn upload: the next poll reads it whole
        return None, False

    def fetch_heartbeat(self, run_id: str, qr_id: str) -> str | None:
        """The VM's last heartbeat (its clock, as text: only its changes count), None before the first."""
        res = self.gcloud(["gcloud", "storage", "cat", f"{run_uri(self.site, run_id)}/jobs/{qr_id}/heartbeat"], check=False)
        return res.stdout.strip() or None if res.returncode == 0 else None

    def silent_vm_fix(self) -> str:
        return (f"give the VM's service account (the project's default Compute Engine account unless the image "
                f"says otherwise) roles/storage.objectAdmin on {self.site['bucket']} and roles/tpu.admin (to delete "
                f"itself): gcloud storage buckets add-iam-policy-binding {self.site['bucket']} "
                f"--member=serviceAccount:SA --role=roles/storage.objectAdmin")

    def pull_outputs(self, run_dir: Path) -> None:
        """Logs, metrics and the checkpoint pointer into the local run dir (for status and logs)."""
        here, vm = RunLayout(run_dir), RunLayout(run_uri(self.site, Path(run_dir).name))
        here.checkpoints.mkdir(exist_ok=True)
        pointer = "LATEST"  # hpcrl.checkpoints.store's pointer file: all that `status` reads of checkpoints
        for argv in (["rsync", "--recursive", _uri(vm.logs), str(here.logs)],
                     ["cp", _uri(vm.metrics), str(here.metrics)],
                     ["cp", _uri(vm.checkpoints / pointer), str(here.checkpoints / pointer)]):
            self.gcloud(["gcloud", "storage", *argv], check=False)  # absent until the VM wrote them
