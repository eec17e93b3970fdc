"""The TPU state machine end to end, driven by tests/fake_gcloud/gcloud (a TEST DOUBLE put first on
PATH; no Google Cloud call). When a queued resource turns ACTIVE the fake runs the rendered VM
startup script for real on this machine (gs:// mapped to a local dir) with the smoke trainer:
through a deadline, a preemption (SIGTERM + SUSPENDED) and a resume from the bucket."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, hpcrl, pending, read_metrics, run_dir, run_state, started, trainer_paused, wait_until

FAKE = Path(__file__).resolve().parent / "fake_gcloud"
RECIPES = ROOT / "hpcrl" / "recipes"
QUOTA = "Quota limit 'TPUV5PPreemptiblePodPerProjectPerZone' exceeded. Limit: 0 in zone us-east5-a"


class Cloud:
    """The fake's directories and what it recorded."""

    def __init__(self, root: Path):
        self.dir, self.gcs, self.vm = root / "fake", root / "gcs", root / "vm"
        for d in (self.dir, self.gcs / "fake-bucket", self.vm):
            d.mkdir(parents=True)  # the bucket exists (submit lists it)

    def scenario(self, creates: list[dict], **extra) -> None:
        data = {"config": {}, "vm_env": {"HPCRL_SYNC_S": "0.3"}, "creates": creates, **extra}
        (self.dir / "scenario.json").write_text(json.dumps(data))

    def calls(self, *words: str) -> list[list[str]]:
        """Every recorded gcloud argv (with argv[0]) that contains all `words`."""
        path = self.dir / "calls.jsonl"
        argvs = [["gcloud", *json.loads(ln)["argv"]] for ln in path.read_text().splitlines()] if path.exists() else []
        return [a for a in argvs if all(w in a for w in words)]

    def vm_calls(self, *words: str, vm: bool) -> list[list[str]]:
        """Recorded argvs made by a "VM" (vm=True: its startup script) or by hpcrl here (False)."""
        path = self.dir / "calls.jsonl"
        recs = [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []
        return [["gcloud", *r["argv"]] for r in recs
                if bool(r.get("vm")) == vm and all(w in r["argv"] for w in words)]

    def qrs(self) -> dict:
        path = self.dir / "qrs.json"
        return json.loads(path.read_text())["qrs"] if path.exists() else {}

    def kill_vms(self) -> None:
        for qr in self.qrs().values():
            if qr.get("vm_pid"):
                try:
                    os.killpg(qr["vm_pid"], signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


@pytest.fixture
def cloud(home, tmp_path, monkeypatch):
    c = Cloud(tmp_path)
    monkeypatch.setenv("FAKE_GCLOUD_DIR", str(c.dir))
    monkeypatch.setenv("FAKE_GCS_ROOT", str(c.gcs))
    monkeypatch.setenv("HPCRL_TPU_VM_ROOT", str(c.vm))
    # the fake first, then this interpreter (the fake's `#!/usr/bin/env python3`)
    monkeypatch.setenv("PATH", f"{FAKE}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    for k in ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    sites = Path(os.environ["HPCRL_SITES_DIR"])
    # Short leads so that a segment takes seconds; the launcher on the "VM" is this interpreter.
    (sites / "tputest.yaml").write_text(
        "extends: tpu-v5p-8\nproject: fake-proj\nzone: us-east5-a\nbucket: gs://fake-bucket\n"
        f"hpcrl_python: {json.dumps(sys.executable)}\nsetup: []\nvenv_root: null\nvm_root: {json.dumps(str(c.vm))}\n"
        "signal_lead_s: 1\nexit_margin_s: 0.5\nkill_grace_s: 2\nmax_retries: 2\nreport_margin_s: 2\n")
    yield c
    c.kill_vms()


def submit(name: str, *extra: str, env=None):
    return hpcrl("submit", "--site", "tputest", "--trainer", "smoke", "--name", name, *extra, env=env)


def watch_until_done(name: str, timeout: float = 90) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "hpcrl.cli", "watch", name, "--interval", "0.3"],
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def vm_step(cloud: Cloud) -> int:
    """The last step the VM's trainer logged on the VM's own disk (the bucket's copy lags it)."""
    best = 0
    for path in cloud.vm.glob("**/metrics.jsonl"):
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            try:
                best = max(best, json.loads(line).get("step", 0))
                break
            except ValueError:
                continue
    return best


@contextlib.contextmanager
def vm_trainer_held_after(cloud: Cloud, step: int):
    """The VM's trainer held (SIGSTOP) as soon as it has logged `step` on the VM's disk, until the
    block ends. 150 steps of 0.1 s otherwise raced what a test does next: waiting for the watcher
    to see them (status calls, slow on a loaded machine) and then a CLI call (stop, cancel)."""
    wait_until(lambda: vm_step(cloud) >= step, 300, f"step {step} on the VM", poll=0.05)
    with trainer_paused(cloud.vm, module="hpcrl.trainers.smoke", under=True) as pids:
        yield pids


def assert_resumed_exactly(state: dict, total: int, rdir: Path) -> None:
    assert [m["step"] for m in read_metrics(rdir)] == list(range(1, total + 1)), "every step ran exactly once"
    ran = started(state)
    for prev, nxt in zip(ran, ran[1:]):
        assert nxt["start_step"] == prev["end_step"] > 0, f"segment {nxt['k']} resumed where {prev['k']} stopped"


def test_accepted_active_deadline_resubmit_resume_done(cloud):
    cloud.scenario([{"states": ["ACCEPTED", "PROVISIONING", "ACTIVE"]}])
    # 10.8 s segments for 12 s of steps: under CI's load two 5.4 s segments in a row were all
    # start-up (no step saved), and the run failed as it should (no checkpoint progress)
    submit("dl", "--hours", "0.003", "--set", "args.steps=30", "--set", "args.step_time_s=0.4",
           "--set", "args.save_every=1000")
    first = run_state("dl")
    assert [s["state"] for s in first["segments"]] == ["QUEUED"] and first["segments"][0]["job_id"] == "hpcrl-dl-1"
    rc, out = watch_until_done("dl")
    assert rc == 0, out
    assert "PENDING" in out and "queued resource hpcrl-dl-1: ACCEPTED" in out and "COMPLETED" in out
    state, rdir = run_state("dl"), run_dir("dl")
    assert state["state"] == "COMPLETED"
    ran = started(state)
    assert len(ran) >= 2, "the 10.8 s segment deadline cut the 12 s of training"
    assert all(s["state"] == "CONTINUE" and s["rc"] == 85 for s in ran[:-1]) and ran[-1]["state"] == "COMPLETE"
    assert_resumed_exactly(state, 30, rdir)
    # one queued resource for the whole run, created with the rendered startup script: its VM ran
    # every segment (the deadline stopped the trainer, not the VM) and deleted itself at the end
    creates = cloud.calls("create")
    assert [a[5] for a in creates] == ["hpcrl-dl-1"]
    assert [s["job_id"] for s in state["segments"]] == ["hpcrl-dl-1", *(f"hpcrl-dl-1.{m}" for m in range(2, len(ran) + 1))]
    assert all("--spot" in a and f"--metadata-from-file=startup-script={rdir}/.tpu/{a[5]}.startup.sh" in a
               for a in creates)
    assert cloud.qrs()["hpcrl-dl-1"].get("deleted")
    assert [a[-3:] for a in cloud.vm_calls("delete", vm=True)] == [["--force", "--quiet", "--async"]]
    assert "the run goes on here: segment job hpcrl-dl-1.2" in (rdir / "logs" / "job-hpcrl-dl-1.log").read_text()
    second_log = (rdir / "logs" / f"job-{ran[1]['job_id']}.log").read_text()
    assert f"smoke: segment 2 starts at step {ran[0]['end_step']} of 30" in second_log
    assert "smoke: done at step 30" in hpcrl("logs", "dl").stdout


def test_preempted_vm_is_deleted_recreated_and_resumes_from_the_bucket(cloud):
    # preempted once step 10 is logged on the VM (not at a clock time: the trainer's steps sleep,
    # so on a loaded machine a timed preemption found the run already complete)
    # 150 steps of 0.1 s: the fake's preempting process, starved on a loaded machine, once saw
    # step 10 after 45 steps had ended the run
    cloud.scenario([{"states": ["ACCEPTED", "ACTIVE"], "preempt_after_step": 10},
                    {"states": ["ACCEPTED", "ACTIVE"]}])
    submit("pre", "--hours", "0.05", "--set", "args.steps=150", "--set", "args.step_time_s=0.1",
           "--set", "args.save_every=5")
    rc, out = watch_until_done("pre", timeout=300)
    assert rc == 0, out
    state, rdir = run_state("pre"), run_dir("pre")
    assert state["state"] == "COMPLETED"
    first, second = started(state)
    assert first["job_id"] == "hpcrl-pre-1" and second["job_id"] == "hpcrl-pre-2"
    assert 0 < first["end_step"] < 150  # the SIGTERM of the preemption made the trainer save where it was
    assert_resumed_exactly(state, 150, rdir)
    assert "TERM (preemption or deletion)" in (rdir / "logs" / "job-hpcrl-pre-1.log").read_text()
    record = json.loads((rdir / ".tpu" / "hpcrl-pre-1.json").read_text())
    assert record["outcome"] == "preempted"
    assert cloud.calls("delete", "hpcrl-pre-1"), "the watcher deleted the SUSPENDED queued resource"
    assert any("re-creating it after" in ln or "RESUBMITTED" in ln for ln in out.splitlines())


def test_failed_queued_resource_fails_the_run_with_its_error(cloud):
    cloud.scenario([{"states": ["ACCEPTED", "FAILED"], "failed_error": {"code": 8, "message": QUOTA}}])
    submit("q", "--hours", "0.05")
    rc, out = watch_until_done("q")
    assert rc == 1, out
    state = run_state("q")
    assert state["state"] == "FAILED"
    assert QUOTA in state["reason"] and "quota exceeded for v5p-8 (spot) in us-east5-a" in state["reason"]
    assert state["segments"][0]["state"] == "CANCELLED"  # never started
    assert cloud.calls("delete", "hpcrl-q-1") and not list(cloud.dir.glob("vm-*.log"))
    assert len(cloud.calls("create")) == 1, "a FAILED queued resource is not re-created"


def test_cancel_during_provisioning_deletes_the_queued_resource(cloud):
    cloud.scenario([{"states": ["ACCEPTED", "WAITING_FOR_RESOURCES"]}])
    submit("c", "--hours", "0.05")
    watcher = subprocess.Popen([sys.executable, "-m", "hpcrl.cli", "watch", "c", "--interval", "0.3"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # status shows what the watcher saw (it never asks gcloud itself)
        status = wait_until(lambda: (st := json.loads(hpcrl("status", "c", "--json").stdout)[0])["reason"]
                            .endswith("WAITING_FOR_RESOURCES") and st, 300, "the watcher to see WAITING_FOR_RESOURCES",
                            poll=0.2)
        assert status["state"] == "PENDING" and status["reason"] == "queued resource hpcrl-c-1: WAITING_FOR_RESOURCES"
        assert "cancelled run c" in hpcrl("cancel", "c").stdout
        out, _ = watcher.communicate(timeout=30)
    finally:
        watcher.kill()
    assert watcher.returncode == 1, out
    delete = cloud.calls("delete", "hpcrl-c-1")[0]
    assert delete[:6] == ["gcloud", "compute", "tpus", "queued-resources", "delete", "hpcrl-c-1"]
    assert delete[-3:] == ["--force", "--quiet", "--async"]
    state = run_state("c")
    assert state["state"] == "CANCELLED" and [s["state"] for s in state["segments"]] == ["CANCELLED"]
    assert not list(cloud.dir.glob("vm-*.log")), "no VM ever booted"
    assert "No such" not in out and "Traceback" not in out


def test_quota_error_at_create_is_one_line_and_leaves_no_run(cloud):
    cloud.scenario([{"create_error": {"rc": 1, "stderr": "ERROR: (gcloud.compute.tpus.queued-resources.create) "
                                                         f"RESOURCE_EXHAUSTED: {QUOTA}"}}])
    r = hpcrl("submit", "--site", "tputest", "--trainer", "smoke", "--name", "qq", check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "quota exceeded for v5p-8 (spot) in us-east5-a" in r.stderr and "--set site.zone=Z" in r.stderr
    assert "qq" not in hpcrl("status").stdout


def test_secrets_reach_the_vm_through_the_bucket_only(cloud, home):
    cloud.scenario([{"states": ["ACTIVE"]}])
    sites = Path(os.environ["HPCRL_SITES_DIR"])
    (sites / "tpusec.yaml").write_text("extends: tputest\nsetup: ['echo \"hf token length ${#HF_TOKEN}\"']\n")
    secret = "hf_sekrit_tpu_5c1d"
    hpcrl("submit", "--site", "tpusec", "--trainer", "smoke", "--name", "sec", "--hours", "0.05",
          "--set", "args.steps=3", "--set", "args.step_time_s=0.05", env={"HF_TOKEN": secret})
    secrets_obj = cloud.gcs / "fake-bucket" / "hpcrl-runs" / "sec" / "secrets.env"
    assert secrets_obj.read_text() == f"export HF_TOKEN={secret}\n"
    rc, out = watch_until_done("sec")  # no HF_TOKEN in the watcher's env, and the fake strips it from the VM's
    assert rc == 0, out
    rdir = run_dir("sec")
    assert f"hf token length {len(secret)}" in (rdir / "logs" / "job-hpcrl-sec-1.log").read_text()
    assert not secrets_obj.exists(), "a finished run's secrets leave the bucket"
    for root in (rdir, home, cloud.vm, cloud.gcs, cloud.dir):
        for path in Path(root).rglob("*"):
            if path.is_file():
                assert secret.encode() not in path.read_bytes(), f"secret found in {path}"


def test_logs_follow_reads_the_bucket_copy_with_hostile_vm_path_and_odd_run_name(cloud, monkeypatch):
    # every path on the VM goes through the one quoting function; nothing injected runs (conftest checks).
    # 200 steps of 0.1 s cannot fit one 14.4 s segment, however fast the machine: the log must span
    # two (5.4 s segments, a loaded machine's start-up took most of each)
    hostile_root = str(cloud.vm / "vm root $(touch /tmp/PWNED-hpcrl) 'q'")
    monkeypatch.setenv("HPCRL_TPU_VM_ROOT", hostile_root)  # the fake's "VM disk"
    site_file = Path(os.environ["HPCRL_SITES_DIR"]) / "tputest.yaml"
    site_file.write_text(re.sub(r"(?m)^vm_root: .*$", f"vm_root: {json.dumps(hostile_root)}", site_file.read_text()))
    cloud.scenario([{"states": ["ACCEPTED", "ACTIVE"]}])
    submit("Odd_Run.v2", "--hours", "0.004", "--set", "args.steps=200", "--set", "args.step_time_s=0.1",
           "--set", "args.save_every=1000")
    # (a bound, not a pace: a loaded machine's segments start slowly and make few steps each; 90 s
    # ran out once)
    proc = subprocess.run([sys.executable, "-m", "hpcrl.cli", "logs", "Odd_Run.v2", "-f", "--interval", "0.3"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "smoke: segment 1 starts at step 0 of 200" in out and "smoke: segment 2 starts at step" in out
    assert out.rstrip().endswith("hpcrl: the run needs no more segments; deleting queued resource " +
                                 run_state("Odd_Run.v2")["segments"][0]["job_id"])
    state = run_state("Odd_Run.v2")
    assert state["state"] == "COMPLETED"
    job = state["segments"][0]["job_id"]
    assert job.startswith("hpcrl-odd-run-v2-") and job.endswith("-1") and len(job) <= 63
    assert (cloud.vm / "vm root $(touch /tmp/PWNED-hpcrl) 'q'" / "runs" / "Odd_Run.v2" / "metrics.jsonl").exists()


def test_cancel_while_running_then_resume_continues_from_the_bucket(cloud):
    cloud.scenario([{"states": ["ACTIVE"]}])
    # 150 steps of 0.1 s: the cancel must land while it trains (40 once finished first under load)
    out = submit("cr", "--hours", "0.05", "--set", "args.steps=150", "--set", "args.step_time_s=0.1",
                 "--set", "args.save_every=5").stdout
    assert "keep `hpcrl watch cr` running" in out
    watcher = subprocess.Popen([sys.executable, "-m", "hpcrl.cli", "watch", "cr", "--interval", "0.3"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # held past step 11 (the checkpoint of step 10 written), until the deletion's TERM is pending
        with vm_trainer_held_after(cloud, 11) as pids:
            # running as the watcher sees it (the VM's begin mirrored), with a checkpoint in the
            # bucket: under load the watcher's polls lag the VM, and a cancel before it saw the
            # begin records a segment that never started (CANCELLED), not the running one
            wait_until(lambda: run_state("cr")["segments"][0]["state"] == "RUNNING"
                       and (json.loads(hpcrl("status", "cr", "--json").stdout)[0]["checkpoint_step"] or 0) >= 10,
                       300, "segment 1 running with a checkpoint at step 10", poll=0.2,
                       describe=lambda: run_state("cr")["segments"][0])
            hpcrl("cancel", "cr")
            wait_until(lambda: all(pending(pid, signal.SIGTERM) for pid in pids), 120,
                       "the VM deletion's TERM at the paused trainer")
        watcher.communicate(timeout=120)
    finally:
        watcher.kill()
    state = run_state("cr")
    assert state["state"] == "CANCELLED" and state["segments"][0]["state"] in ("CONTINUE", "LOST")
    assert cloud.calls("delete", "hpcrl-cr-1")
    hpcrl("resume", "cr")
    once = hpcrl("watch", "cr", "--once").stdout  # one poll, one line
    assert once.count("\n") == 1 and "job hpcrl-cr-2" in once
    rc, log = watch_until_done("cr")
    assert rc == 0, log
    state = run_state("cr")
    first, second = started(state)
    assert state["state"] == "COMPLETED" and second["job_id"] == "hpcrl-cr-2"
    assert second["start_step"] >= 10, "the new VM resumed from the checkpoint in the bucket"
    assert sorted({m["step"] for m in read_metrics(run_dir("cr"))}) == list(range(1, 151))


def test_resume_with_new_hours_changes_the_next_segments_length(cloud):
    # state.json's budget is the one record of a segment's hours: the next VM's startup script
    # (rendered at create time from it) must use the new value, not spec.json's.
    cloud.scenario([{"states": ["ACCEPTED", "WAITING_FOR_RESOURCES"]}, {"states": ["ACTIVE"]}])
    # 250 steps of 0.1 s in 18 s segments: two at least, however fast the machine (30 steps in
    # 5.4 s segments needed start-up to be slow, and under a loaded one's start-up no segment got
    # far enough)
    submit("rh", "--hours", "0.05", "--set", "args.steps=250", "--set", "args.step_time_s=0.1",
           "--set", "args.save_every=1000")
    rdir = run_dir("rh")
    assert "segment_s=180\n" in (rdir / ".tpu" / "hpcrl-rh-1.startup.sh").read_text()
    hpcrl("cancel", "rh")
    hpcrl("resume", "rh", "--hours", "0.005")
    assert "segment_s=18\n" in (rdir / ".tpu" / "hpcrl-rh-2.startup.sh").read_text()
    rc, log = watch_until_done("rh", timeout=600)
    assert rc == 0, log
    state = run_state("rh")
    ran = started(state)
    assert state["state"] == "COMPLETED" and len(ran) >= 2, "25 s of training cannot fit one 18 s segment"
    assert ran[0]["ended"] - ran[0]["started"] < 19, "the first resumed segment ran for the new hours"
    assert_resumed_exactly(state, 250, rdir)


BUCKET_FIX = "roles/storage.objectAdmin on gs://fake-bucket"


@pytest.mark.parametrize("denied", [["storage", "compute"], ["storage"]], ids=["cannot-delete-itself", "deletes-itself"])
def test_vm_denied_the_bucket_bills_no_longer_than_its_segment(cloud, denied):
    # The VM's service account (the default Compute Engine one, say) cannot read the bucket: the
    # VM cannot fetch the run. With the TPU role it deletes itself at once; without it, the watcher
    # deletes the queued resource once it has been ACTIVE for the segment (7 s) plus
    # site.report_margin_s (2 s) without a heartbeat. Either way: one create, one delete, the run
    # FAILED with the fix (a VM that never reported is not re-created: the next would fail the same).
    cloud.scenario([{"states": ["ACCEPTED", "ACTIVE"]}], vm_denied=denied)
    submit("deny", "--hours", "0.002")
    rc, out = watch_until_done("deny", timeout=60)
    assert rc == 1, out
    state = run_state("deny")
    assert state["state"] == "FAILED", state["reason"]
    assert "never reported" in state["reason"] and BUCKET_FIX in state["reason"], state["reason"]
    assert cloud.qrs()["hpcrl-deny-1"].get("deleted"), "the queued resource was left to bill"
    by_vm = cloud.vm_calls("queued-resources", "delete", vm=True)
    assert bool(by_vm) and (len(cloud.vm_calls("queued-resources", "delete", vm=False)) >= 1) == (denied != ["storage"])
    assert len(cloud.calls("queued-resources", "create")) == 1, "a VM that cannot reach the bucket is not re-created"
    assert state["segments"][0]["state"] in ("LOST", "CANCELLED")


def maxtext_spec(tmp_path: Path) -> Path:
    spec = tmp_path / "mx.yaml"
    hpcrl("init", "--recipe", "maxtext-llama3.1-8b-grpo", "--out", spec)
    return spec


def test_recipe_paths_take_the_sites_bucket(cloud, tmp_path):
    text = hpcrl("render", maxtext_spec(tmp_path), "--site", "tputest", "--set", "site.bucket=gs://my-bucket",
                 "--name", "mx").stdout
    job = text.split("# " + "=" * 76)[0]
    assert "YOUR_BUCKET" not in job
    assert " base_output_directory=gs://my-bucket/hpcrl " in job
    assert " load_parameters_path=gs://my-bucket/llama3.1-8b-maxtext/0/items " in job
    assert " --ckpt-root gs://my-bucket/hpcrl/mx/checkpoints/actor " in job


@pytest.mark.parametrize("setting, words", [
    ("args.load_parameters_path=gs://<your-bucket>/ckpt/0/items", "args.load_parameters_path: gs://<your-bucket>/ckpt/0/items is a placeholder"),
    ("args.base_output_directory=gs://My_Bucket/out", "args.base_output_directory: gs://My_Bucket/out is not a valid gs:// path"),
    ("env.EXTRA_DATA=gs://YOUR_DATA/x", "the rendered job uses gs://YOUR_DATA/x, which is a placeholder"),
])
def test_submit_refuses_placeholder_and_invalid_gs_paths(cloud, tmp_path, setting, words):
    cloud.scenario([{"states": ["ACTIVE"]}])
    r = hpcrl("submit", maxtext_spec(tmp_path), "--site", "tputest", "--set", setting, "--name", "bad",
              check=False, env={"HF_TOKEN": "hf_x"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert words in r.stderr, r.stderr
    assert not cloud.calls("create") and "bad" not in hpcrl("status").stdout


def test_gated_model_without_hf_token_is_refused_at_submit(cloud, tmp_path):
    cloud.scenario([{"states": ["ACTIVE"]}])
    r = hpcrl("submit", maxtext_spec(tmp_path), "--site", "tputest", "--name", "gated", check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "llama3.1-8b-Instruct is gated" in r.stderr and "export HF_TOKEN=" in r.stderr
    assert not cloud.calls("create") and not cloud.calls("storage")


def test_bucket_the_submitting_account_cannot_list_is_refused(cloud, tmp_path):
    cloud.scenario([{"states": ["ACTIVE"]}], denied=["storage"])
    r = hpcrl("submit", "--site", "tputest", "--trainer", "smoke", "--name", "nob", check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "cannot list gs://fake-bucket with your gcloud account" in r.stderr and "PERMISSION_DENIED" in r.stderr
    assert not cloud.calls("create") and "nob" not in hpcrl("status").stdout


@pytest.mark.parametrize("preempt_after_step, creates", [(None, 1), (8, 2)], ids=["no-preemption", "one-preemption"])
def test_recipe_budget_makes_one_create_per_vm_not_per_segment(cloud, preempt_after_step, creates):
    # maxtext-llama3.1-8b-grpo's budget (4-hour segments, 12 hours, at most 4 segments) scaled by
    # 0.005/4 to 18-second segments; the smoke trainer stands in for MaxText, which cannot run
    # here. A TPU VM has no walltime: the segments' deadlines stop the trainer (checkpoint, exit 85)
    # and the next segment starts on the same VM. A VM is created again only after a preemption.
    # (5-second segments were all start-up twice in a row beside the full suite, CI of 2026-12-07:
    # no checkpoint progress in 2 segments, the crash-loop stop, a FAILED run.)
    budget = yaml.safe_load((RECIPES / "maxtext-llama3.1-8b-grpo.yaml").read_text())["budget"]
    assert (budget["hours"], budget["total_hours"], budget["max_segments"]) == (4, 12, 4)
    scale = 0.005 / budget["hours"]
    # the preemption at step 8, after the first save (every 5): on a quiet machine in the VM's first
    # segment; under load, where start-up eats much of each segment, in its first or second
    first = {"states": ["ACCEPTED", "ACTIVE"], **({"preempt_after_step": preempt_after_step} if preempt_after_step else {})}
    cloud.scenario([first, {"states": ["ACCEPTED", "ACTIVE"]}])
    submit("twelve", "--hours", f"{budget['hours'] * scale:g}", "--total-hours", f"{budget['total_hours'] * scale:g}",
           "--max-segments", str(budget["max_segments"]), "--set", "args.steps=100000",
           "--set", "args.step_time_s=0.1", "--set", "args.save_every=5")
    rc, out = watch_until_done("twelve", timeout=400)  # a bound for a hung run: ~70 s quiet
    state = run_state("twelve")
    assert state["state"] == "STOPPED" and state["stop"]["kind"] in ("budget", "max_segments"), out
    ran = started(state)
    assert len(ran) >= 3, [s["job_id"] for s in state["segments"]]
    assert len(cloud.calls("queued-resources", "create")) == creates, [s["job_id"] for s in state["segments"]]
    vms = sorted({s["job_id"].split(".")[0] for s in ran})
    assert vms == [f"hpcrl-twelve-{n}" for n in range(1, creates + 1)]
    # each segment resumes from the last one's checkpoint: under load a 5-second segment can be all
    # start-up and save nothing (end_step None), and the one after it starts where that one did
    saved = None
    for seg in ran:
        assert seg["start_step"] == saved, f"segment {seg['k']} resumed from the last save ({saved})"
        saved = seg["end_step"] if seg["end_step"] is not None else saved
    assert saved and saved > 0, ran
    for qr in cloud.qrs().values():
        assert qr.get("deleted"), f"{qr['id']} was left to bill"


def test_second_vm_restores_the_venv_from_the_bucket_not_rebuilt(cloud):
    # The first VM builds the venv (real python -m venv + pip) and packs it, with the Python under
    # venv_root, into the run's bucket; it is preempted once that pack is complete; the VM that
    # replaces it (a fresh disk: the double wipes it) restores the pack and trains at once.
    sites = Path(os.environ["HPCRL_SITES_DIR"])
    (sites / "tpuvenv.yaml").write_text(f"extends: tputest\nvenv_root: {json.dumps(str(cloud.vm / 'venvs'))}\n"
                                        f"python: {json.dumps(sys.executable)}\n")
    cloud.scenario([{"states": ["ACCEPTED", "ACTIVE"], "preempt_when_object": "fake-bucket/hpcrl-runs/venv/venv.ok"},
                    {"states": ["ACCEPTED", "ACTIVE"]}])
    hpcrl("submit", "--site", "tpuvenv", "--trainer", "smoke", "--name", "venv", "--hours", "0.05",
          "--set", "requirements=[six]", "--set", "args.steps=300", "--set", "args.step_time_s=0.1",
          "--set", "args.save_every=5")
    rc, out = watch_until_done("venv", timeout=300)
    assert rc == 0, out
    state, rdir = run_state("venv"), run_dir("venv")
    assert state["state"] == "COMPLETED" and len(cloud.calls("queued-resources", "create")) == 2
    first = (rdir / "logs" / "job-hpcrl-venv-1.log").read_text()
    second = (rdir / "logs" / "job-hpcrl-venv-2.log").read_text()
    assert "hpcrl: building venv" in first and "hpcrl: venvs packed into gs://fake-bucket/hpcrl-runs/venv/venv.tar" in first
    assert "hpcrl: venvs restored from gs://fake-bucket/hpcrl-runs/venv/venv.tar" in second
    assert "building venv" not in second, "the second VM rebuilt the venv"
    built = int(re.search(r"venv built in (\d+) s", first).group(1))
    restored = int(re.search(r"venvs restored from \S+ in (\d+) s", second).group(1))
    print(f"venv start-up on the double: built in {built} s, restored in {restored} s")
    assert_resumed_exactly(state, 300, rdir)


def test_stop_saves_on_the_vm_runs_nothing_after_and_resume_continues(cloud):
    """#29: `hpcrl stop` on TPU: the VM finds the stop object in the bucket and gives its segment
    the walltime's USR1; the trainer saves at its last trained step, the watcher queues no next
    VM, the run is STOPPED, and resume continues from that step on a new VM."""
    cloud.scenario([{"states": ["ACTIVE"]}, {"states": ["ACTIVE"]}])
    submit("st", "--hours", "0.05", "--set", "args.steps=150", "--set", "args.step_time_s=0.1",
           "--set", "args.save_every=1000")
    watcher = subprocess.Popen([sys.executable, "-m", "hpcrl.cli", "watch", "st", "--interval", "0.3"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # held past step 10 until the VM's USR1 is pending: the stop object's round trip (a CLI
        # call, then the VM's next poll of the bucket) raced the 150 steps to the end once
        with vm_trainer_held_after(cloud, 10) as pids:
            # running as the watcher sees it, at step 10 (as the cancel test above: a fixed number
            # of status polls ran out under a 2-process hog before the watcher saw the segment begin)
            wait_until(lambda: run_state("st")["segments"][0]["state"] == "RUNNING"
                       and (json.loads(hpcrl("status", "st", "--json").stdout)[0]["step"] or 0) >= 10,
                       300, "segment 1 running at step 10", poll=0.2, describe=lambda: run_state("st")["segments"][0])
            hpcrl("stop", "st")
            wait_until(lambda: all(pending(pid, signal.SIGUSR1) for pid in pids), 120,
                       "the VM's USR1 at the paused trainer")
        out, _ = watcher.communicate(timeout=120)
    finally:
        watcher.kill()
    state = run_state("st")
    assert state["state"] == "STOPPED" and state["stop"]["kind"] == "user_stop", (state["reason"], out)
    (seg,) = started(state)
    trained = max(m["step"] for m in read_metrics(run_dir("st")))
    assert seg["state"] == "CONTINUE" and seg["end_step"] == trained < 150, (seg, trained)
    assert not cloud.calls("create", "hpcrl-st-2"), "no VM after the stopped segment"
    hpcrl("resume", "st")
    rc, log = watch_until_done("st")
    assert rc == 0, log
    second = started(run_state("st"))[1]
    assert second["start_step"] == trained
    assert sorted({m["step"] for m in read_metrics(run_dir("st"))}) == list(range(1, 151))
