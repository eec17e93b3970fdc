#!/bin/bash
# hpcrl segment script for run maxtext-llama3.1-8b-grpo on site tpu-v5p-8.
# Rendered by hpcrl 0.1.0; every segment of the run executes this same file.
# What it does: record the segment's start and queue its successor (hpcrl _segment begin),
# set up the environment, run the trainer in the background under the walltime protocol,
# forward USR1/TERM to it, wait until it really exits, then record the outcome (_segment end).
set -uo pipefail
# A USR1 or TERM that reaches this shell before the trainer runs (during the set-up below: the
# segment's start, a venv check, modules, the bootstrap) is remembered and delivered once it does:
# bash's default action would end the segment unrecorded, its checkpoint request lost.
early_signals=""
trap 'early_signals="$early_signals USR1"' USR1
trap 'early_signals="$early_signals TERM"' TERM

export HPCRL_RUN_ID=maxtext-llama3.1-8b-grpo
export HPCRL_RUN_DIR=/var/lib/hpcrl/runs/maxtext-llama3.1-8b-grpo
export HPCRL_CKPT_DIR=/var/lib/hpcrl/runs/maxtext-llama3.1-8b-grpo/checkpoints
export HPCRL_METRICS=/var/lib/hpcrl/runs/maxtext-llama3.1-8b-grpo/metrics.jsonl
hpcrl_py=/usr/bin/python3
export PYTHONPATH=/var/lib/hpcrl/runs/maxtext-llama3.1-8b-grpo/lib${PYTHONPATH:+:$PYTHONPATH}
export HPCRL_JOB_ID="${HPCRL_JOB_ID:?the TPU startup script sets HPCRL_JOB_ID}"

# Which segment this is, its deadline from the job's real end time, and the queued successor.
# Exit status 3 means there is nothing to do (run complete, cancelled or out of budget).
begin_out=$("$hpcrl_py" -m hpcrl.cli _segment begin "$HPCRL_RUN_DIR" --job-id "$HPCRL_JOB_ID")
begin_rc=$?
if [ "$begin_rc" -eq 3 ]; then
  echo "hpcrl: nothing left to do for run $HPCRL_RUN_ID; exiting"
  exit 0
elif [ "$begin_rc" -ne 0 ]; then
  echo "hpcrl: segment start failed (exit $begin_rc); not starting the trainer" >&2
  exit "$begin_rc"
fi
read -r HPCRL_SEGMENT HPCRL_DEADLINE need_successor <<<"$begin_out"
export HPCRL_SEGMENT HPCRL_DEADLINE
if [ "${need_successor:-0}" = 1 ]; then
  # The scheduler did not take the successor (away for a while?): keep trying, with back-off,
  # while the trainer works; the end hook tries too.
  echo "hpcrl: the successor could not be queued yet; retrying in the background"
  "$hpcrl_py" -m hpcrl.cli _segment successor "$HPCRL_RUN_DIR" --job-id "$HPCRL_JOB_ID" &
fi
echo "hpcrl: run $HPCRL_RUN_ID segment $HPCRL_SEGMENT job $HPCRL_JOB_ID on $(hostname) deadline $(date -d "@${HPCRL_DEADLINE%.*}" '+%F %T')"


# Environment (spec and site; secrets are never written here: they come from the submitting
# shell's environment)
export UV_PYTHON_INSTALL_DIR=/var/lib/hpcrl/venvs/python
export PYTHONUNBUFFERED=1


# Site set-up lines (trusted: from the site profile)
command -v python3.12 >/dev/null || { python3 -m pip install --quiet uv && python3 -m uv python install 3.12 && ln -sf "$(python3 -m uv python find 3.12)" /usr/local/bin/python3.12; }


# The venv: built here (this machine's own disk) once per distinct requirement set, under a lock
# so that concurrent segments never build it twice; a build that died leaves no ready marker and
# is redone. Its requirements (the run's requirements.txt):
#   maxtext[tpu-post-train]==0.2.5
venv=/var/lib/hpcrl/venvs/3bb47bc746f4
mkdir -p "$(dirname "$venv")"
(
  flock 9
  if [ ! -f "$venv/.hpcrl-ready" ] || ! "$venv/bin/python" -c '' 2>/dev/null; then
    echo "hpcrl: building venv $venv"
    t0=$SECONDS
    rm -rf "$venv"
    # as the trainer's packages document it (the trainer's installer)
    bash /var/lib/hpcrl/runs/maxtext-llama3.1-8b-grpo/maxtext/install-venv.sh "$venv" /var/lib/hpcrl/runs/maxtext-llama3.1-8b-grpo/requirements.txt &&
      touch "$venv/.hpcrl-ready" || { echo "hpcrl: venv build failed" >&2; exit 1; }
    echo "hpcrl: venv built in $((SECONDS - t0)) s"
  fi
) 9>"$venv.lock" || { "$hpcrl_py" -m hpcrl.cli _segment end "$HPCRL_RUN_DIR" --job-id "$HPCRL_JOB_ID" --rc 1; exit 1; }
source "$venv/bin/activate"
trainer_py="$venv/bin/python"



cd "$HPCRL_RUN_DIR"


# The trainer runs in the background so that the traps below run while it works. A small
# subshell runs it in its foreground and writes its exit status to a file: bash (5.2) can lose a
# child's status when a trap interrupts `wait` just as the child exits, and the status decides
# between "continue" and "failed". The subshell survives the signals meant for the trainer
# (its no-op traps are reset to defaults in the trainer by exec).
rc_file="$HPCRL_RUN_DIR/.trainer-rc-$HPCRL_JOB_ID"
rm -f "$rc_file"
# The signals' own traps, set before the trainer starts (those at the top only remember).
runner=""
# A trainer still starting (its interpreter importing, no USR1 handler yet) would die of USR1, the
# default action, and the segment would read as failed (exit 138): the USR1 waits until the trainer
# catches it (SigCgt in /proc/PID/status), or exits. A site.trainer_python that is a wrapper script
# running Python as its child (no exec) never catches it: then the first of its children that
# does gets it. TERM goes at once (stop now).
usr1=$(kill -l USR1)
catches() {
  local mask
  mask=$(sed -n 's/^SigCgt:[[:space:]]*//p' "/proc/$1/status" 2>/dev/null)
  [ -n "$mask" ] && (( (16#$mask >> ($2 - 1)) & 1 ))
}
# The runner forks the trainer a moment after it starts: a signal in between (one that came
# during the set-up is delivered right then) finds no child yet, and was lost (a USR1 under load
# let the trainer run to its end). A waiter then delivers it once the trainer exists.
forward() {
  [ -n "$runner" ] || return 0
  local kids
  kids=$(pgrep -P "$runner")
  if [ -z "$kids" ]; then
    ( while kill -0 "$runner" 2>/dev/null; do
        kids=$(pgrep -P "$runner")
        if [ -n "$kids" ]; then forward_to "$1" $kids; break; fi
        sleep 0.1
      done ) &
    return 0
  fi
  forward_to "$1" $kids
}
forward_to() {
  local sig=$1 pid
  shift
  for pid in "$@"; do
    if [ "$sig" != USR1 ] || catches "$pid" "$usr1"; then
      kill "-$sig" "$pid" 2>/dev/null
    else
      ( while kill -0 "$pid" 2>/dev/null; do
          for taker in "$pid" $(pgrep -P "$pid"); do
            if catches "$taker" "$usr1"; then kill -USR1 "$taker" 2>/dev/null; break 2; fi
          done
          sleep 0.2
        done ) &
    fi
  done
}
# A signal once the trainer has exited (the walltime's USR1 may come late: Slurm checks limits on
# a 30 s tick; a trainer may finish just before it) has nothing to save or stop: it is recorded as
# such, never announced as a checkpoint, and sets no CHECKPOINTING flag that outlives the segment.
exited() { [ -n "${hpcrl_done:-}" ] || [ -e "$rc_file" ]; }
late() {
  echo "hpcrl: $1 arrived after the trainer had exited${hpcrl_rc:+ (code $hpcrl_rc)}: $2"
}
trap 'if exited; then late USR1 "nothing to checkpoint"; else echo "hpcrl: USR1: checkpoint and stop"; touch "$HPCRL_RUN_DIR/.checkpointing"; forward USR1; fi' USR1
trap 'if exited; then late TERM "nothing to stop"; else echo "hpcrl: TERM: stop now"; forward TERM; fi' TERM
if [[ " $early_signals " == *" TERM "* ]]; then
  # stop now, before it began: the trainer is not started; its code reads as killed by TERM
  echo "hpcrl: TERM arrived before the trainer started: not starting it"
  echo 143 > "$rc_file"
else
  (
    trap : USR1 TERM INT
    "$trainer_py" -m hpcrl.job.maxtext --python "$trainer_py" --ckpt-root gs://hpcrl-demo-bucket/hpcrl/maxtext-llama3.1-8b-grpo/checkpoints/actor --period 50 --total-steps 3738 --save-time-s 120 --eval first -- model_name=llama3.1-8b-Instruct run_name=maxtext-llama3.1-8b-grpo base_output_directory=gs://hpcrl-demo-bucket/hpcrl chips_per_vm=4 loss_algo=grpo enable_checkpointing=true checkpoint_period=50 max_num_checkpoints_to_keep=3 load_parameters_path=gs://hpcrl-demo-bucket/llama3.1-8b-maxtext/0/items num_batches=3738
    echo "$?" > "$rc_file"
  ) &
  runner=$!
  for sig in $early_signals; do
    echo "hpcrl: $sig arrived before the trainer started; delivering it now"
    kill "-$sig" $$
  done
fi
# `wait` returns early when a trap fires: wait again until the runner has really exited.
while kill -0 "$runner" 2>/dev/null; do
  wait "$runner"
done
hpcrl_done=1
rc=$(cat "$rc_file" 2>/dev/null) || rc=1
rm -f "$rc_file"
hpcrl_rc=$rc
echo "hpcrl: trainer exited with code $rc"
"$hpcrl_py" -m hpcrl.cli _segment end "$HPCRL_RUN_DIR" --job-id "$HPCRL_JOB_ID" --rc "$rc"
# The scheduler's record of this job: a segment that stopped to be continued did what it should
# (COMPLETED in sacct, no failure mail); hpcrl's own record above keeps the trainer's code.
if [ "$rc" -eq 85 ]; then
  exit 0
fi
exit "$rc"

# ============================================================================
# gcloud argv of the first segment (one argument per line; not a shell string):
#   gcloud
#   compute
#   tpus
#   queued-resources
#   create
#   hpcrl-maxtext-llama3-1-8b-grpo-e2fe7d-1
#   --node-id=hpcrl-maxtext-llama3-1-8b-grpo-e2fe7d-1
#   --project=hpcrl-demo
#   --zone=us-east5-a
#   --accelerator-type=v5p-8
#   --runtime-version=v2-alpha-tpuv5
#   --spot
#   --metadata-from-file=startup-script=RUN_DIR/.tpu/hpcrl-maxtext-llama3-1-8b-grpo-e2fe7d-1.startup.sh
#   --quiet
# as a command line:
#   gcloud compute tpus queued-resources create hpcrl-maxtext-llama3-1-8b-grpo-e2fe7d-1 --node-id=hpcrl-maxtext-llama3-1-8b-grpo-e2fe7d-1 --project=hpcrl-demo --zone=us-east5-a --accelerator-type=v5p-8 --runtime-version=v2-alpha-tpuv5 --spot --metadata-from-file=startup-script=RUN_DIR/.tpu/hpcrl-maxtext-llama3-1-8b-grpo-e2fe7d-1.startup.sh --quiet
# ============================================================================
# RUN_DIR/.tpu/hpcrl-maxtext-llama3-1-8b-grpo-e2fe7d-1.startup.sh: the VM's startup script (--metadata-from-file=startup-script=...)
# ============================================================================
#!/bin/bash
# hpcrl TPU VM startup script: run maxtext-llama3.1-8b-grpo, queued resource hpcrl-maxtext-llama3-1-8b-grpo-e2fe7d-1, site tpu-v5p-8.
# Rendered by hpcrl 0.1.0; passed to `queued-resources create` as the startup-script
# metadata, so the VM runs it as root on every boot. What it does: fetch the run's files from the
# bucket, wait for the launcher's state that lists this job, then run the run's segments on this
# one VM, one after the other: each the SAME segment script (job.sh) every backend runs, with a
# deadline (USR1 before it, TERM at it, KILL after the grace), so that the trainer checkpoints
# and stops and the next segment starts here, on the same disk and venv (a TPU VM has no
# walltime: re-creating it would re-queue for capacity and rebuild everything). Logs, state,
# metrics and checkpoints go to the bucket while it works; when the run needs no more segments
# the VM deletes its own queued resource (an idle TPU VM bills). A preemption (TERM) ends it:
# the watcher re-creates it and the new VM resumes from the bucket.
set -uo pipefail

export HPCRL_QR=hpcrl-maxtext-llama3-1-8b-grpo-e2fe7d-1   # this VM's queued resource; its first segment's job id
export HPCRL_JOB_ID="$HPCRL_QR"
run_uri=gs://hpcrl-demo-bucket/hpcrl-runs/maxtext-llama3.1-8b-grpo/run
secrets_uri=gs://hpcrl-demo-bucket/hpcrl-runs/maxtext-llama3.1-8b-grpo/secrets.env
run_dir=/var/lib/hpcrl/runs/maxtext-llama3.1-8b-grpo
hpcrl_py=/usr/bin/python3
segment_s=14400
signal_lead_s=300
kill_grace_s=30
# No report to the bucket for this long (the segment, its grace and site.report_margin_s): the VM
# deletes itself, and the watcher deletes a VM it has not heard from for as long.
stall_s=15330
# The storage command and the copy period are variables so that tests can map gs:// to a local
# directory and copy often.
: "${HPCRL_GS:=gcloud storage}"
: "${HPCRL_SYNC_S:=60}"
gs() { $HPCRL_GS "$@"; }  # unquoted on purpose: the command is two words

mkdir -p "$run_dir/logs" "$run_dir/checkpoints"
log="$run_dir/logs/job-$HPCRL_JOB_ID.log"
exec >>"$log" 2>&1
echo "hpcrl: VM $(hostname) starts segment job $HPCRL_JOB_ID"

# Copy what the VM wrote to the bucket: its state goes to jobs/<job>/ (the launcher owns
# run_uri/state.json), then everything else but hpcrl's snapshot and unfinished checkpoints.
sync_up() {
  gs rsync --recursive --exclude='^(state\.json|\.lock|lib/.*|.*\.tmp-.*)$' "$run_dir" "$run_uri" >/dev/null 2>&1 ||
    echo "hpcrl: copying to $run_uri failed; retrying later"
  gs cp "$run_dir/state.json" "$run_uri/jobs/$HPCRL_QR/${1:-state}.json" >/dev/null 2>&1
}
give_up() {
  echo "hpcrl: $1; deleting queued resource $HPCRL_QR (an idle TPU VM bills)"
  gs cp "$log" "$run_uri/logs/" >/dev/null 2>&1
  gcloud compute tpus queued-resources delete hpcrl-maxtext-llama3-1-8b-grpo-e2fe7d-1 --project=hpcrl-demo --zone=us-east5-a --force --quiet --async >/dev/null 2>&1 ||
    echo "hpcrl: could not delete the queued resource (the VM's account lacks roles/tpu.admin); the watcher will"
  exit 1
}

# The heartbeat, from boot to the end: the watcher deletes a VM whose heartbeat stops (one that
# cannot write the bucket never sends one), and the VM deletes itself when it cannot send it
# for stall_s (a dead man's switch; job.sh's own hangs end at its deadline).
beat_file="$run_dir/.hpcrl-heartbeat"
touch "$beat_file"
(
  while :; do
    date +%s | gs cp - "$run_uri/jobs/$HPCRL_QR/heartbeat" >/dev/null 2>&1 && touch "$beat_file"
    [ $(( $(date +%s) - $(stat -c %Y "$beat_file") )) -le "$stall_s" ] ||
      give_up "no report could reach $run_uri for ${stall_s}s"
    sleep "$HPCRL_SYNC_S"
  done
) &
heart=$!

# 1. The run's files: spec, job.sh, hpcrl's snapshot, checkpoints (not old logs or VM states).
gs rsync --recursive --exclude='^(logs|jobs)/.*$' "$run_uri" "$run_dir" >/dev/null ||
  give_up "cannot read $run_uri: give the VM's service account read/write access to the bucket"

# 2. The launcher publishes the run's state right after creating this queued resource: wait
#    until it lists this job, so that budget and history are current (go on after 10 minutes).
for _ in $(seq 1 120); do
  gs cp "$run_uri/state.json" "$run_dir/state.json" >/dev/null 2>&1
  "$hpcrl_py" -c 'import json, sys; st = json.load(open(sys.argv[1]))
sys.exit(0 if any(s.get("job_id") == sys.argv[2] for s in st["segments"]) else 1)' \
    "$run_dir/state.json" "$HPCRL_JOB_ID" 2>/dev/null && break
  sleep 5
done

# 3. Secrets (WANDB_API_KEY, HF_TOKEN) from the run's secrets object into this environment
#    only: never into a file on the VM.
if secrets=$(gs cat "$secrets_uri" 2>/dev/null); then
  eval "$secrets"
fi
unset secrets

# 3b. The venvs (and the Python they were built with) under venv_root, packed into the bucket by
#     the run's first VM once built: a later VM (after a preemption) restores them instead of
#     rebuilding. venv.ok, written after a complete upload, marks a usable pack.
venv_root=/var/lib/hpcrl/venvs
venv_uri=gs://hpcrl-demo-bucket/hpcrl-runs/maxtext-llama3.1-8b-grpo/venv
if command -v zstd >/dev/null; then venv_zip=--zstd; venv_obj="$venv_uri.tar.zst"; else venv_zip=--gzip; venv_obj="$venv_uri.tar.gz"; fi
packer=""
if [ -n "$venv_root" ]; then
  mkdir -p "$venv_root"
  t0=$SECONDS
  if gs cat "$venv_uri.ok" >/dev/null 2>&1 && gs cat "$venv_obj" 2>/dev/null | tar -x $venv_zip -C "$venv_root"; then
    echo "hpcrl: venvs restored from $venv_obj in $((SECONDS - t0)) s (not rebuilt)"
  else
    (
      until compgen -G "$venv_root/*/.hpcrl-ready" >/dev/null; do sleep "$HPCRL_SYNC_S"; done
      touch "$venv_root.packing"
      t0=$SECONDS
      # The line is written before venv.ok: a preemption can follow venv.ok at once, and the TERM
      # it sends every process here would otherwise cut it (a complete pack the log never named).
      if tar -c $venv_zip -C "$venv_root" --exclude='*.lock' . | gs cp - "$venv_obj" >/dev/null 2>&1; then
        echo "hpcrl: venvs packed into $venv_obj in $((SECONDS - t0)) s"
        date +%s | gs cp - "$venv_uri.ok" >/dev/null 2>&1 || echo "hpcrl: could not mark the venv pack complete; a later VM rebuilds"
      else
        echo "hpcrl: could not pack the venvs"
      fi
    ) &
    packer=$!
  fi
fi

# 4. The segments, each in its own session so that the walltime can stop all of it.
( while sleep "$HPCRL_SYNC_S"; do sync_up; done ) &
syncer=$!
job=""
terminated=""
# SIGTERM: the VM is shutting down (spot preemption with ~30 s notice, or deletion).
trap 'terminated=1; echo "hpcrl: TERM (preemption or deletion): stopping the segment"; kill -TERM -- "-$job" 2>/dev/null' TERM
while :; do
  export HPCRL_JOB_END_TIME=$(( $(date +%s) + segment_s ))
  setsid bash "$run_dir/job.sh" &
  job=$!
  # `hpcrl stop`: the launcher leaves jobs/<job>/stop in the bucket; the segment gets the USR1 of
  # its walltime (save, exit for continuation), and nothing runs after it on this VM.
  ( while sleep "$HPCRL_SYNC_S"; do
      if gs cat "$run_uri/jobs/$HPCRL_JOB_ID/stop" >/dev/null 2>&1; then
        echo "hpcrl: stop asked (hpcrl stop): USR1"; kill -USR1 "$job"; break
      fi
    done ) &
  stopper=$!
  (
    until_t() { local s=$(( $1 - $(date +%s) )); [ "$s" -gt 0 ] && sleep "$s"; }
    until_t $(( HPCRL_JOB_END_TIME - signal_lead_s )); kill -USR1 "$job" 2>/dev/null
    until_t "$HPCRL_JOB_END_TIME"; kill -TERM -- "-$job" 2>/dev/null
    until_t $(( HPCRL_JOB_END_TIME + kill_grace_s )); kill -KILL -- "-$job" 2>/dev/null
  ) &
  timer=$!
  # `wait` returns early when a trap fires; wait again until job.sh has really exited, then once
  # more for its own status (bash keeps a reaped child's status).
  while kill -0 "$job" 2>/dev/null; do
    wait "$job"
  done
  wait "$job"
  rc=$?
  for p in "$timer" "$stopper"; do
    pkill -P "$p" 2>/dev/null
    kill "$p" 2>/dev/null
  done
  echo "hpcrl: segment script exited with code $rc"
  [ -z "$terminated" ] || break
  # stopped by `hpcrl stop`: no next segment here (`hpcrl resume` continues the run)
  ! gs cat "$run_uri/jobs/$HPCRL_JOB_ID/stop" >/dev/null 2>&1 || break
  # The run's next segment, on this VM (none when it is complete, failed or out of budget).
  next=$(PYTHONPATH="$run_dir/lib${PYTHONPATH:+:$PYTHONPATH}" \
    "$hpcrl_py" -m hpcrl.cli _segment next "$run_dir" --job-id "$HPCRL_JOB_ID") || break
  [ -z "$terminated" ] || break
  read -r HPCRL_JOB_ID segment_s <<<"$next"
  echo "hpcrl: the run goes on here: segment job $HPCRL_JOB_ID"
  exec >>"$run_dir/logs/job-$HPCRL_JOB_ID.log" 2>&1
  echo "hpcrl: VM $(hostname) (queued resource $HPCRL_QR) starts segment job $HPCRL_JOB_ID"
  sync_up
done
pkill -P "$syncer" 2>/dev/null
kill "$syncer" 2>/dev/null
if [ -n "$packer" ]; then
  # a pack under way is finished (a later VM needs it); one still waiting for a venv is not
  if [ -e "$venv_root.packing" ] && [ -z "$terminated" ]; then wait "$packer"; fi
  pkill -P "$packer" 2>/dev/null
  kill "$packer" 2>/dev/null
fi

# 5. Everything to the bucket; final.json, written last, tells the watcher the copy is complete.
# The log's last line is written before that copy: the watcher may finish the segment (and
# `hpcrl logs -f` stop) as soon as final.json lands.
if [ -z "$terminated" ]; then
  echo "hpcrl: the run needs no more segments; deleting queued resource $HPCRL_QR"
fi
sync_up final
pkill -P "$heart" 2>/dev/null
kill "$heart" 2>/dev/null
if [ -z "$terminated" ]; then
  gcloud compute tpus queued-resources delete hpcrl-maxtext-llama3-1-8b-grpo-e2fe7d-1 --project=hpcrl-demo --zone=us-east5-a --force --quiet --async >/dev/null 2>&1 || echo "hpcrl: could not delete the queued resource; the watcher will"
fi
exit "$rc"
