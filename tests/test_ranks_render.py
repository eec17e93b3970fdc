"""Ranks (resources.nodes x resources.ranks_per_node) in the rendered script: a world of one is
today's plain command; more runs torchrun (standalone here, under srun with a c10d rendezvous on
the first node on Slurm); the stop and exit files replace USR1 and the trainer's exit code, as the
rendered lines themselves show when bash runs them with a stand-in launcher."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from helpers import HOSTILE, hpcrl
from test_render import FIXED, PY, bash_n, check_golden

PM = ["--site", "perlmutter", "--account", "m1234_g", "--hours", "4"]


def render(*args, check=True):
    return hpcrl("render", *args, PY, env=FIXED, check=check)


def command_of(text: str) -> str:
    """The trainer's line: the one inside the status-recording subshell."""
    block = text[text.index("  trap : USR1 TERM INT\n"):text.index('  echo "$?" > "$rc_file"')]
    return block.splitlines()[1].strip()


def test_world_of_one_is_the_plain_command_with_no_stop_or_exit_file():
    for args in (["--site", "local", "--trainer", "builtin"], [*PM, "--trainer", "builtin", "--set",
                                                                 "resources.gpus_per_node=1"]):
        text = render(*args, "--name", "one").stdout
        assert command_of(text) == ('"$trainer_py" -m hpcrl.rl.train --config '
                                    + ("/home/user/.local/share/hpcrl" if "local" in args else "/pscratch/sd/u/user/hpcrl")
                                    + "/runs/one/trainer.json")
        assert "torch.distributed.run" not in text and "srun" not in text
        assert "HPCRL_STOP_FILE" not in text and "HPCRL_EXIT_FILE" not in text
        assert "; forward USR1; fi' USR1" in text  # the one process gets USR1 itself, as before


def test_local_two_ranks_run_standalone_torchrun_and_turn_usr1_into_the_stop_file():
    text = render("--site", "local", "--trainer", "builtin", "--name", "two", "--set", "resources.ranks_per_node=2").stdout
    bash_n(text)
    assert command_of(text) == ('"$trainer_py" -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --standalone '
                                "-m hpcrl.rl.train --config /home/user/.local/share/hpcrl/runs/two/trainer.json")
    assert 'export HPCRL_STOP_FILE="$HPCRL_RUN_DIR/.trainer-stop-$HPCRL_JOB_ID"' in text
    assert 'export HPCRL_EXIT_FILE="$HPCRL_RUN_DIR/.trainer-exit-$HPCRL_JOB_ID"' in text
    assert "; forward USR1'" not in text, "torchrun dies of USR1: it must never get one"
    usr1 = [ln for ln in text.splitlines() if ln.startswith("trap ") and ln.endswith(" USR1")][-1]  # not the early one
    assert 'touch "$HPCRL_RUN_DIR/.checkpointing" "$HPCRL_STOP_FILE"' in usr1
    assert "forward TERM" in text  # torchrun forwards TERM to its ranks
    check_golden("local-builtin-2-ranks.sh", text)


def test_slurm_two_nodes_srun_one_torchrun_per_node_with_c10d_rendezvous_on_the_first():
    text = render(*PM, "--trainer", "builtin", "--name", "pm2", "--nodes", "2").stdout
    bash_n(text)
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=4" in text
    assert command_of(text) == (
        'srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=128 "$trainer_py" '
        "-m torch.distributed.run --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d "
        '--rdzv-endpoint "$hpcrl_rdzv_host:$hpcrl_rdzv_port" --rdzv-id "$HPCRL_JOB_ID" '
        "-m hpcrl.rl.train --config /pscratch/sd/u/user/hpcrl/runs/pm2/trainer.json")
    assert 'hpcrl_rdzv_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    # the rendezvous is set up before the launcher starts
    assert text.index("hpcrl_rdzv_port=") < text.index("srun --nodes=2")
    check_golden("perlmutter-builtin-2x4.sh", text)


def test_rendezvous_port_is_derived_from_the_job_id_and_stays_below_the_ephemeral_range():
    text = render(*PM, "--trainer", "builtin", "--name", "p", "--nodes", "2").stdout
    line = next(ln for ln in text.splitlines() if ln.startswith("hpcrl_rdzv_port="))
    ports = set()
    for job in ("1", "14999", "15000", "987654", "4242_7"):
        out = subprocess.run(["bash", "-c", f"HPCRL_JOB_ID={job}; {line}; echo $hpcrl_rdzv_port"],
                             capture_output=True, text=True, check=True).stdout
        ports.add(int(out))
        assert 15000 <= int(out) < 30000, (job, out)
    assert len(ports) == 5


def test_ranks_per_node_sets_the_gpu_request_and_the_torchrun_ranks():
    text = render(*PM, "--trainer", "builtin", "--name", "r2", "--set", "resources.ranks_per_node=2").stdout
    assert "#SBATCH --gpus-per-node=2" in text and "--nproc-per-node 2" in command_of(text)
    default = render(*PM, "--trainer", "builtin", "--name", "r4").stdout
    assert "#SBATCH --gpus-per-node=4" in default and "--nproc-per-node 4" in command_of(default)


def test_smoke_trainer_stays_one_process_unless_asked_and_then_runs_like_the_builtin():
    text = render(*PM, "--trainer", "smoke", "--name", "s").stdout
    assert command_of(text).startswith('"$trainer_py" -m hpcrl.trainers.smoke ')
    two = render(*PM, "--trainer", "smoke", "--name", "s", "--nodes", "2").stdout
    assert command_of(two).startswith("srun --nodes=2 ") and "--nproc-per-node 1 " in command_of(two)


@pytest.mark.parametrize("args, message", [
    ([*PM, "--trainer", "builtin", "--set", "resources.ranks_per_node=8"],
     "resources.ranks_per_node 8: site 'perlmutter' has 4 GPUs per node and the builtin trainer runs one rank per "
     "GPU; use at most 4"),
    ([*PM, "--trainer", "builtin", "--set", "resources.ranks_per_node=2", "--set", "resources.gpus_per_node=4"],
     "resources.gpus_per_node is 4 and each rank drives one GPU; set both to the same number"),
    (["--site", "local", "--trainer", "builtin", "--set", "resources.ranks_per_node=0"],
     "resources.ranks_per_node: must be at least 1, got 0"),
    (["--site", "local", "--trainer", "builtin", "--set", "resources.ranks_per_node=two"],
     "resources.ranks_per_node: expected a whole number, got 'two'"),
    (["--site", "local", "--trainer", "builtin", "--set", "resources.ranks_per_node=1.5"],
     "resources.ranks_per_node: expected a whole number"),
    (["--site", "local", "--trainer", "builtin", "--set", "resources.ranks_per_node=100000"],
     "resources.ranks_per_node: must be at most 256"),
    (["--site", "local", "--trainer", "builtin", "--nodes", "2"],
     "resources.nodes (--nodes) 2: the local site is this one machine; use nodes: 1 and more ranks on it with "
     "--set resources.ranks_per_node=N"),
    ([*PM, "--trainer", "verl", "--set", "resources.ranks_per_node=4", "--set", "args.model=/m",
      "--set", "args.train_files=/t.parquet", "--set", "args.val_files=/v.parquet"],
     "resources.ranks_per_node: the verl trainer starts its own workers (Ray workers on resources.gpus_per_node "
     "GPUs of each of resources.nodes nodes); leave ranks_per_node out"),
    (["--site", "local", "--trainer", "builtin", "--set", "resources.ranks_per_node=4", "--set", "args.batch_size=2"],
     "args.batch_size 2: fewer prompts per step than the 4 ranks (resources.nodes x ranks_per_node); raise "
     "batch_size to at least 4 or use fewer ranks"),
    (["--site", "tpu-v5p-8", "--trainer", "maxtext", "--set", "resources.ranks_per_node=4"],
     "resources.ranks_per_node: the maxtext trainer starts its own workers"),
])
def test_bad_ranks_are_one_line_errors(args, message):
    r = render(*args, check=False)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert message in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


def test_hostile_run_directory_is_quoted_in_the_torchrun_line(tmp_path):
    sites = tmp_path / "sites"
    sites.mkdir()
    outputs = "/o/" + HOSTILE.replace("\n", " ")
    (sites / "evil.yaml").write_text(f"extends: perlmutter\naccount: m1_g\noutputs: {json.dumps(outputs)}\n")
    text = hpcrl("render", "--site", "evil", "--trainer", "builtin", "--name", "h", "--nodes", "2", PY,
                 env={**FIXED, "HPCRL_SITES_DIR": str(sites)}).stdout
    bash_n(text)
    cmd = command_of(text)
    assert cmd.endswith("--config '/o/a'\"'\"'; touch /tmp/PWNED-hpcrl #\"$(touch /tmp/PWNED-hpcrl2)`touch "
                        "/tmp/PWNED-hpcrl3` x;y/h/trainer.json'"), cmd


# ---------------------------------------------------------------- the rendered lines, run by bash


def _launch_block(text: str) -> str:
    """From the rc file to the decided code, as rendered (the launcher line swapped by the caller)."""
    return text[text.index('rc_file="$HPCRL_RUN_DIR'):text.index('echo "hpcrl: trainer exited')]


STANDINS = {
    # (stand-in for torchrun, signal the script gets) -> the segment's code
    "rank 0 wrote 85, all exited 0": ('printf "85\\n" > "$HPCRL_EXIT_FILE"; exit 0', None, 85),
    "complete": ('printf "0\\n" > "$HPCRL_EXIT_FILE"; exit 0', None, 0),
    "exited 0, no exit file": ("exit 0", None, 1),
    "a rank failed (torchrun: 1) after rank 0 wrote 85": ('printf "85\\n" > "$HPCRL_EXIT_FILE"; exit 1', None, 1),
    "garbage in the exit file": ('printf "x5" > "$HPCRL_EXIT_FILE"; exit 0', None, 1),
    # USR1 -> the stop file: the stand-in waits for it, then "saves" and writes 85
    "USR1 becomes the stop file": ('while [ ! -e "$HPCRL_STOP_FILE" ]; do sleep 0.05; done; '
                                   'printf "85\\n" > "$HPCRL_EXIT_FILE"; exit 0', "USR1", 85),
    # TERM is forwarded; torchrun then exits 1 whatever its ranks did: rank 0's code counts
    "TERM forwarded, rank 0 saved": ("trap 'printf \"85\\n\" > \"$HPCRL_EXIT_FILE\"; exit 1' TERM; "
                                     "while :; do sleep 0.05; done", "TERM", 85),
    "TERM forwarded, nothing saved": ("trap 'exit 1' TERM; while :; do sleep 0.05; done", "TERM", 1),
}


@pytest.mark.parametrize("case", list(STANDINS))
def test_rendered_lines_take_the_code_from_the_exit_file_only_when_the_launcher_allows(tmp_path, case):
    standin, sig, want = STANDINS[case]
    text = render("--site", "local", "--trainer", "smoke", "--name", "x", "--set", "resources.ranks_per_node=2").stdout
    block = _launch_block(text)
    command = command_of(text)
    (tmp_path / "launcher.sh").write_text(standin + "\n")
    block = block.replace(command, f"bash {tmp_path / 'launcher.sh'}")
    send = ""
    if sig:
        # the stand-in is up (its trap set) before the signal comes, as a scheduler's would be later
        send = ("(sleep 0.5; kill -" + sig + " $$) &\n")
    script = send + block + 'echo "rc=$rc"\nls -a "$HPCRL_RUN_DIR" > "$HPCRL_RUN_DIR/../left"\n'
    run = tmp_path / "run"
    run.mkdir()
    env = {"HPCRL_RUN_DIR": str(run), "HPCRL_JOB_ID": "7", "PATH": os.environ["PATH"]}
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert f"rc={want}\n" in proc.stdout, (proc.stdout, proc.stderr)
    left = set((tmp_path / "left").read_text().split()) - {".", "..", ".checkpointing"}
    assert not left, f"the stop, exit and rc files are removed: {left}"
    if want == 1 and "no exit file" in case:
        assert "left no exit code" in proc.stderr


def test_stop_and_exit_files_are_cleaned_before_the_launcher_starts(tmp_path):
    # A stale stop file (a previous segment's, same job id on a requeue) must not stop the next one at once.
    text = render("--site", "local", "--trainer", "smoke", "--name", "x", "--set", "resources.ranks_per_node=2").stdout
    block = _launch_block(text).replace(command_of(text), '[ ! -e "$HPCRL_STOP_FILE" ] && [ ! -e "$HPCRL_EXIT_FILE" ] '
                                                          '&& printf "0\\n" > "$HPCRL_EXIT_FILE"')
    run = tmp_path / "run"
    run.mkdir()
    (run / ".trainer-stop-7").write_text("")
    (run / ".trainer-exit-7").write_text("85\n")
    env = {"HPCRL_RUN_DIR": str(run), "HPCRL_JOB_ID": "7", "PATH": os.environ["PATH"]}
    out = subprocess.run(["bash", "-c", block + 'echo "rc=$rc"'], capture_output=True, text=True, timeout=30, env=env)
    assert "rc=0" in out.stdout, out


def test_adapters_without_ranks_keep_their_scripts():
    """No template change for trainers that place their own workers: the shipped goldens stand."""
    golden = Path(__file__).parent / "golden"
    for name in ("verl-multinode-perlmutter.sh", "recipe-tinyzero-countdown-grpo-perlmutter.sh"):
        assert "HPCRL_STOP_FILE" not in (golden / name).read_text()
    assert re.search(r"hpcrl_term", (golden / "perlmutter-smoke-4h.sh").read_text()) is None
