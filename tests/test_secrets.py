"""Secrets reach the job through the environment and never land in a script, log or run dir."""

import os
from pathlib import Path

from helpers import hpcrl, run_dir, wait_for_run

SECRETS = {"WANDB_API_KEY": "wandb-sekrit-7f3a9c", "HF_TOKEN": "hf_sekrit_51b2e0", "HUGGING_FACE_HUB_TOKEN": "hf_other_99"}


def test_secrets_reach_the_job_but_no_file(fast_local, home, tmp_path):
    sites = Path(os.environ["HPCRL_SITES_DIR"])
    # a trusted site line that proves the job received the key, without writing the key itself
    (sites / "sec.yaml").write_text("extends: fastlocal\nsetup: ['echo \"wandb key length ${#WANDB_API_KEY}\"']\n")
    hpcrl("submit", "--site", "sec", "--trainer", "smoke", "--name", "sec", "--hours", "0.01",
          "--set", "args.steps=3", "--set", "args.step_time_s=0.05", env=SECRETS)
    state = wait_for_run("sec")
    assert state["state"] == "COMPLETED"
    rdir = run_dir("sec")
    log = next((rdir / "logs").glob("job-*.log")).read_text()
    assert f"wandb key length {len(SECRETS['WANDB_API_KEY'])}" in log
    for root in (rdir, home):
        for path in Path(root).rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                for value in SECRETS.values():
                    assert value.encode() not in data, f"secret found in {path}"
    rendered = hpcrl("render", "--site", "sec", "--trainer", "smoke", "--name", "sec2", env=SECRETS).stdout
    assert not any(v in rendered for v in SECRETS.values())


def test_secret_in_spec_env_is_refused(home, tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("trainer: smoke\nenv:\n  WANDB_API_KEY: abc\n")
    r = hpcrl("submit", str(spec), check=False)
    assert r.returncode == 2 and "env.WANDB_API_KEY: looks like a secret; export it in your shell" in r.stderr
    assert "abc" not in r.stderr
