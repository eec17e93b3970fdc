"""The tpu backend's pure parts: argv goldens per provisioning mode (and the real gcloud's parser
accepting them, when it is installed), JSON parsing of the documented describe/list shapes,
gcloud error -> one-line fix, names, site checks, and `hpcrl render` for the TPU sites."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import HOSTILE, hpcrl
from hpcrl.backends.base import JobState
from hpcrl.backends.tpu import (PROVISIONING, STATES, TpuBackend, check_site, create_argv, delete_argv, describe_argv,
                                explain, list_argv, parse_describe, parse_list, qr_name, render_startup)
from hpcrl.errors import BackendError, SiteError
from hpcrl.backends.tpu_watch import retries_in_a_row
from test_render import bash_n, check_golden

FAKE = Path(__file__).resolve().parent / "fake_gcloud"
SITE = {"name": "tpu-v5p-8", "project": "my-proj", "zone": "us-east5-a", "accelerator_type": "v5p-8",
        "runtime_version": "v2-alpha-tpuv5", "provisioning": "spot", "bucket": "gs://my-bucket/x", "max_retries": 5,
        "signal_lead_s": 300, "kill_grace_s": 30, "hpcrl_python": "/usr/bin/python3"}
FIXED = {"HPCRL_HOME": "/home/user/.local/share/hpcrl", "HPCRL_SITES_DIR": "/nonexistent/sites"}
RULE = "# " + "=" * 76 + "\n"  # between the parts of `hpcrl render` for a TPU site
TPU_SETS = ["--set", "site.project=my-proj", "--set", "site.zone=us-east5-a", "--set", "site.bucket=gs://bkt"]


def site(**changes) -> dict:
    return {**SITE, **changes}


def argv_text(s: dict) -> str:
    qr = qr_name("llama-grpo", 1)
    blocks = [create_argv(s, qr, "/runs/llama-grpo/.tpu/startup.sh"), describe_argv(s, qr), delete_argv(s, qr),
              list_argv(s)]
    return "\n\n".join("\n".join(b) for b in blocks) + "\n"


# ---------------------------------------------------------------- argv


@pytest.mark.parametrize("mode", sorted(PROVISIONING))
def test_argv_golden_per_provisioning_mode(mode):
    text = argv_text(site(provisioning=mode))
    create = text.split("\n\n")[0].splitlines()
    prefix = ["gcloud", "alpha"] if mode == "best-effort" else ["gcloud"]  # --best-effort exists only in alpha
    assert create[:len(prefix) + 5] == [*prefix, "compute", "tpus", "queued-resources", "create", "hpcrl-llama-grpo-1"]
    flags = {"spot": ["--spot"], "reserved": ["--reserved"], "on-demand": [], "best-effort": ["--best-effort"]}[mode]
    for other in ("--spot", "--reserved", "--best-effort", "--guaranteed"):
        assert (other in create) == (other in flags), f"{mode}: {other}"
    assert "--metadata-from-file=startup-script=/runs/llama-grpo/.tpu/startup.sh" in create
    assert ("alpha" in text.split()) == (mode == "best-effort")  # every command on the same track
    assert text.split("\n\n")[2].splitlines()[-3:] == ["--force", "--quiet", "--async"]
    check_golden(f"tpu-{mode}.txt", text)


def _real_gcloud():
    path = shutil.which("gcloud", path=os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                                       if Path(p).resolve() != FAKE.resolve()))
    if path is None:
        pytest.skip("the Google Cloud CLI is not installed here: cannot check its parser")
    return path


@pytest.mark.parametrize("mode", sorted(PROVISIONING))
def test_real_gcloud_parses_our_argv(mode, tmp_path):
    """The installed gcloud (never authenticated here) must fail on the missing account, which it
    checks after parsing: an unknown flag would exit 2 with 'unrecognized arguments' first."""
    gcloud = _real_gcloud()
    s = site(provisioning=mode)
    startup = tmp_path / "startup.sh"
    startup.write_text("#!/bin/bash\n")
    env = {**os.environ, "CLOUDSDK_CONFIG": str(tmp_path / "cfg"), "CLOUDSDK_CORE_CHECK_GCE_METADATA": "false",
           "CLOUDSDK_CORE_DISABLE_USAGE_REPORTING": "true", "CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK": "true"}
    others = [delete_argv(s, "hpcrl-r-1"), describe_argv(s, "hpcrl-r-1")] if mode in ("spot", "best-effort") else []
    for argv in (create_argv(s, "hpcrl-r-1", startup), *others):  # only create differs within a release track
        proc = subprocess.run([gcloud, *argv[1:]], capture_output=True, text=True, env=env, timeout=300,
                              stdin=subprocess.DEVNULL)
        if "alpha" in argv and "component" in proc.stderr.lower() and "install" in proc.stderr.lower():
            pytest.skip("gcloud's alpha component is not installed")
        assert proc.returncode == 1 and "active account" in proc.stderr, (argv, proc.stderr)


# ---------------------------------------------------------------- parsing


DESCRIBE = {
    "name": "projects/my-proj/locations/us-east5-a/queuedResources/hpcrl-r-1",
    "createTime": "2025-06-20T10:00:00.123Z",
    "tpu": {"nodeSpec": [{"parent": "projects/my-proj/locations/us-east5-a", "nodeId": "hpcrl-r-1",
                          "node": {"acceleratorType": "v5p-8", "runtimeVersion": "v2-alpha-tpuv5",
                                   "networkConfig": {"enableExternalIps": True}}}]},
    "spot": {},
    "queueingPolicy": {"validUntilDuration": "21600s"},
    "state": {"state": "ACTIVE", "stateInitiator": "SERVICE", "activeData": {}},
    "aFieldFromNextYear": {"nested": [1, {"deeper": None}]},
}


def test_parse_describe_documented_shape_with_unknown_fields():
    st = parse_describe(json.dumps(DESCRIBE))
    assert (st.qr_id, st.state, st.job_state, st.initiator, st.error) == ("hpcrl-r-1", "ACTIVE", JobState.RUNNING,
                                                                          "SERVICE", "")


def test_parse_failed_shows_failed_data_error():
    failed = {**DESCRIBE, "state": {"state": "FAILED", "stateInitiator": "SERVICE", "newKey": 1,
                                    "failedData": {"error": {"code": 8, "message": "Quota exceeded for v5p",
                                                             "details": [{"@type": "x"}]}}}}
    st = parse_describe(json.dumps(failed))
    assert st.job_state == JobState.FAILED and st.error == "Quota exceeded for v5p"


@pytest.mark.parametrize("raw, want", [
    ("CREATING", JobState.PENDING), ("ACCEPTED", JobState.PENDING), ("WAITING_FOR_RESOURCES", JobState.PENDING),
    ("PROVISIONING", JobState.PENDING), ("ACTIVE", JobState.RUNNING), ("SUSPENDING", JobState.PREEMPTED),
    ("SUSPENDED", JobState.PREEMPTED), ("FAILED", JobState.FAILED), ("DELETING", JobState.CANCELLED),
    ("SOME_FUTURE_STATE", JobState.UNKNOWN)])
def test_state_table(raw, want):
    assert parse_describe(json.dumps({**DESCRIBE, "state": {"state": raw}})).job_state == want
    assert STATES.get(raw, JobState.UNKNOWN) == want


def test_parse_tolerates_missing_state_and_list_shape():
    assert parse_describe('{"name": "x/qr"}').job_state == JobState.UNKNOWN
    assert parse_describe('{"name": "x/qr", "state": "weird"}').state == "STATE_UNSPECIFIED"
    two = parse_list(json.dumps([DESCRIBE, {**DESCRIBE, "name": "a/b/hpcrl-r-2", "state": {"state": "SUSPENDED"}}]))
    assert [(s.qr_id, s.job_state) for s in two] == [("hpcrl-r-1", JobState.RUNNING), ("hpcrl-r-2", JobState.PREEMPTED)]
    assert parse_list("[]") == []
    for bad, fn in (("not json", parse_describe), ('{"a": 1}', parse_list), ("[1]", parse_list)):
        with pytest.raises(BackendError):
            fn(bad)


# ---------------------------------------------------------------- errors, one line with the fix


@pytest.mark.parametrize("stderr, fix", [
    ("ERROR: (gcloud.compute.tpus.queued-resources.create) You do not currently have an active account selected.\n"
     "Please run:\n\n  $ gcloud auth login", "gcloud is not authenticated: run `gcloud auth login`"),
    ("ERROR: (gcloud.x) There was a problem refreshing your current auth tokens: Reauthentication failed.",
     "gcloud auth login"),
    ("ERROR: (gcloud.compute.tpus.queued-resources.describe) Error parsing [queued_resource].\nFailed to find "
     "attribute [project].", "--set site.project=P"),
    ("ERROR: (gcloud.config) The required property [project] is not currently set.", "--set site.project=P"),
    ("ERROR: RESOURCE_EXHAUSTED: Quota limit 'TPUV5sPodPerProjectPerZoneForTPUAPI' has been exceeded.",
     "quota exceeded for v5p-8 (spot) in us-east5-a"),
    ("ERROR: INVALID_ARGUMENT: Accelerator type v5p-8 is not available in zone us-central1-a.",
     "zone us-east5-a does not offer v5p-8"),
    ("ERROR: (gcloud) INVALID_ARGUMENT: Invalid accelerator type: v5p-8", "accelerator-types list"),
    ("ERROR: PERMISSION_DENIED: Cloud TPU API has not been used in project 123 before or it is disabled. Enable "
     "it by visiting https://console.developers.google.com/apis/api/tpu.googleapis.com", "gcloud services enable"),
])
def test_gcloud_errors_map_to_a_fix(stderr, fix):
    assert fix in explain(stderr, SITE) and "\n" not in explain(stderr, SITE)


def test_unknown_error_keeps_gcloud_tail_and_missing_gcloud_says_install(monkeypatch, tmp_path):
    assert explain("ERROR: something new", SITE) is None
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcloud at all
    with pytest.raises(BackendError, match=r"gcloud is not installed: install the Google Cloud CLI"):
        TpuBackend(SITE).describe("hpcrl-r-1")


# ---------------------------------------------------------------- names, site values


def test_qr_names_fit_gcloud_rules_and_stay_unique():
    import re

    names = [qr_name(r, n) for r in ("llama", "My_Run.v2", "my-run-v2", "x" * 64, "x" * 64 + "y") for n in (1, 12)]
    assert qr_name("llama", 3) == "hpcrl-llama-3"
    assert len(set(names)) == len(names)
    for n in names:
        assert re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", n) and len(n) <= 63, n


@pytest.mark.parametrize("changes, message", [
    ({"project": None}, "project is not set; pass --set site.project=P"),
    ({"zone": None}, "zone is not set; pass --set site.zone=Z"),
    ({"bucket": None}, "bucket is not set; pass --set site.bucket=gs://NAME"),
    ({"bucket": "my-bucket"}, "bucket 'my-bucket' is not valid"),
    ({"bucket": "gs://bkt/$(id)"}, "is not valid"),
    ({"project": "a'; id"}, "project \"a'; id\" is not valid"),
    ({"provisioning": "cheap"}, "provisioning 'cheap' must be one of best-effort, on-demand, reserved, spot"),
    ({"max_retries": -1}, "max_retries -1 must be a whole number >= 0"),
])
def test_site_checks_name_the_key_and_the_fix(changes, message):
    with pytest.raises(SiteError) as e:
        check_site(site(**changes))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_retries_count_preemptions_in_a_row_since_the_last_resume():
    recs = [{"n": i, "created": t, "closed": t + 1, "outcome": o}
            for i, (t, o) in enumerate([(10, "preempted"), (20, "done"), (30, "preempted"), (40, "lost")], 1)]
    assert retries_in_a_row({"resumed_at": None}, recs) == 2
    assert retries_in_a_row({"resumed_at": 35}, recs) == 1
    assert retries_in_a_row({}, recs[:2]) == 0


# ---------------------------------------------------------------- the startup script and `hpcrl render`


def test_startup_script_is_valid_bash_and_quotes_hostile_values(monkeypatch):
    resolved = {"site": site(hpcrl_python=HOSTILE, vm_root="/tmp/vm root $(touch /tmp/PWNED-hpcrl)"),
                "spec": {"budget": {"hours": 0.5}}}
    text = render_startup(resolved, "run-1", "hpcrl-run-1-1")
    bash_n(text)
    assert HOSTILE not in text and "segment_s=1800" in text
    assert "run_uri=gs://my-bucket/x/hpcrl-runs/run-1/run" in text
    assert "run_dir='/tmp/vm root $(touch /tmp/PWNED-hpcrl)/runs/run-1'" in text
    assert "delete hpcrl-run-1-1 --project=my-proj --zone=us-east5-a --force --quiet --async" in text


@pytest.mark.parametrize("site_name, chips, accel, runtime", [("tpu-v5p-8", 4, "v5p-8", "v2-alpha-tpuv5"),
                                                              ("tpu-v6e-8", 8, "v6e-8", "v2-alpha-tpuv6e")])
def test_render_maxtext_recipe_prints_argv_and_startup_script(home, tmp_path, site_name, chips, accel, runtime):
    spec = tmp_path / "hpcrl.yaml"
    hpcrl("init", "--recipe", "maxtext-llama3.1-8b-grpo", "--out", spec)
    text = hpcrl("render", spec, "--site", site_name, *TPU_SETS, "--hours", "4", "--name", "mx", env=FIXED).stdout
    job, argv, _, startup = text.split(RULE)
    bash_n(job)
    bash_n(startup)
    assert f"chips_per_vm={chips}" in job and "export HPCRL_RUN_DIR=/var/lib/hpcrl/runs/mx" in job
    # the pinned venv, installed from requirements.txt (the script lists the requirements in comments only)
    commands = "\n".join(ln for ln in job.splitlines() if not ln.lstrip().startswith("#"))
    assert "maxtext[tpu-post-train]==0.2.5" not in commands and "-m venv" not in commands
    # built as MaxText documents it, by the adapter's installer (tests/test_maxtext.py reads it)
    assert 'bash /var/lib/hpcrl/runs/mx/maxtext/install-venv.sh "$venv" /var/lib/hpcrl/runs/mx/requirements.txt' in job
    assert "#   maxtext[tpu-post-train]==0.2.5\n" in job
    for line in ("#   create", "#   hpcrl-mx-1", "#   --project=my-proj", "#   --zone=us-east5-a",
                 f"#   --accelerator-type={accel}", f"#   --runtime-version={runtime}", "#   --spot",
                 "#   --metadata-from-file=startup-script=RUN_DIR/.tpu/hpcrl-mx-1.startup.sh"):
        assert line in argv.splitlines()
    assert startup.startswith("#!/bin/bash\n") and "segment_s=14400" in startup
    assert "run_uri=gs://bkt/hpcrl-runs/mx/run" in startup
    if site_name == "tpu-v5p-8":
        check_golden("tpu-v5p-8-maxtext-render.txt", text)


def test_project_and_zone_default_to_gcloud_config(home, tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    env = {**FIXED, "FAKE_GCLOUD_DIR": str(fake), "PATH": f"{FAKE}{os.pathsep}{Path(sys.executable).parent}"
                                                          f"{os.pathsep}{os.environ['PATH']}"}
    (fake / "scenario.json").write_text(json.dumps({"config": {"project": "cfg-proj", "compute/zone": "us-east5-b"},
                                                    "creates": []}))
    out = hpcrl("render", "--site", "tpu-v6e-8", "--trainer", "smoke", "--set", "site.bucket=gs://bkt", "--name", "s",
                env=env).stdout
    assert "#   --project=cfg-proj" in out and "#   --zone=us-east5-b" in out
    calls = [json.loads(ln)["argv"] for ln in (fake / "calls.jsonl").read_text().splitlines()]
    assert calls == [["config", "get-value", "project"], ["config", "get-value", "compute/zone"]]
    (fake / "scenario.json").write_text(json.dumps({"config": {}, "creates": []}))  # gcloud has no project set
    r = hpcrl("render", "--site", "tpu-v6e-8", "--trainer", "smoke", "--set", "site.bucket=gs://bkt", check=False, env=env)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
    assert "site 'tpu-v6e-8': project is not set; pass --set site.project=P" in r.stderr


def test_no_gcloud_and_no_project_is_one_line(home, tmp_path):
    env = {**FIXED, "PATH": str(tmp_path)}  # neither gcloud nor anything else
    r = hpcrl("render", "--site", "tpu-v5p-8", "--trainer", "smoke", "--set", "site.bucket=gs://bkt", check=False, env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--set site.project=P" in r.stderr
    r = hpcrl("render", "--site", "tpu-v5p-8", "--trainer", "smoke", "--set", "site.project=my-proj",
              "--set", "site.zone=us-east5-a", check=False, env=env)
    assert r.returncode == 2 and "bucket is not set; pass --set site.bucket=gs://NAME" in r.stderr
