#!/bin/bash
#HPCRL-LOCAL walltime_s=900
#HPCRL-LOCAL signal_lead_s=10
#HPCRL-LOCAL kill_grace_s=5
# hpcrl segment script for run two on site local.
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

export HPCRL_RUN_ID=two
export HPCRL_RUN_DIR=/home/user/.local/share/hpcrl/runs/two
export HPCRL_CKPT_DIR=/home/user/.local/share/hpcrl/runs/two/checkpoints
export HPCRL_METRICS=/home/user/.local/share/hpcrl/runs/two/metrics.jsonl
hpcrl_py=/opt/hpcrl/bin/python
export PYTHONPATH=/home/user/.local/share/hpcrl/runs/two/lib${PYTHONPATH:+:$PYTHONPATH}
export HPCRL_JOB_ID="${HPCRL_JOB_ID:?run this script through hpcrl: the local backend sets HPCRL_JOB_ID}"

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
export HF_HUB_OFFLINE=1
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false

trainer_py="$hpcrl_py"



cd "$HPCRL_RUN_DIR"


# The trainer runs in the background so that the traps below run while it works. A small
# subshell runs it in its foreground and writes its exit status to a file: bash (5.2) can lose a
# child's status when a trap interrupts `wait` just as the child exits, and the status decides
# between "continue" and "failed". The subshell survives the signals meant for the trainer
# (its no-op traps are reset to defaults in the trainer by exec).
rc_file="$HPCRL_RUN_DIR/.trainer-rc-$HPCRL_JOB_ID"
rm -f "$rc_file"
# The ranks run under torchrun (one per node, under srun on Slurm): torchrun dies of USR1 and
# reports any rank's exit as 1, so USR1 becomes a file the ranks look for, and rank 0 writes the
# protocol's exit code to a file once every rank has saved (hpcrl/protocol.py). TERM is forwarded.
export HPCRL_STOP_FILE="$HPCRL_RUN_DIR/.trainer-stop-$HPCRL_JOB_ID"
export HPCRL_EXIT_FILE="$HPCRL_RUN_DIR/.trainer-exit-$HPCRL_JOB_ID"
rm -f "$HPCRL_STOP_FILE" "$HPCRL_EXIT_FILE"
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
trap 'if exited; then late USR1 "nothing to checkpoint"; else echo "hpcrl: USR1: checkpoint and stop (stop file for the ranks)"; touch "$HPCRL_RUN_DIR/.checkpointing" "$HPCRL_STOP_FILE"; fi' USR1
trap 'if exited; then late TERM "nothing to stop"; else echo "hpcrl: TERM: stop now"; hpcrl_term=1; forward TERM; fi' TERM
if [[ " $early_signals " == *" TERM "* ]]; then
  # stop now, before it began: the trainer is not started; its code reads as killed by TERM
  echo "hpcrl: TERM arrived before the trainer started: not starting it"
  echo 143 > "$rc_file"
else
  (
    trap : USR1 TERM INT
    "$trainer_py" -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --standalone -m hpcrl.rl.train --config /home/user/.local/share/hpcrl/runs/two/trainer.json
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
# Every rank exited 0, or torchrun exited 1 only because a TERM reached it (after forwarding it)
# and rank 0 still wrote its code: that code. Otherwise a rank failed: the launcher's code.
if [ "$rc" -eq 0 ] || { [ -n "${hpcrl_term:-}" ] && [ -s "$HPCRL_EXIT_FILE" ]; }; then
  rc=$(cat "$HPCRL_EXIT_FILE" 2>/dev/null)
  case "$rc" in ''|*[!0-9]*) echo "hpcrl: the ranks exited 0 but left no exit code in $HPCRL_EXIT_FILE" >&2; rc=1 ;; esac
fi
rm -f "$HPCRL_STOP_FILE" "$HPCRL_EXIT_FILE"
hpcrl_rc=$rc
echo "hpcrl: trainer exited with code $rc"
"$hpcrl_py" -m hpcrl.cli _segment end "$HPCRL_RUN_DIR" --job-id "$HPCRL_JOB_ID" --rc "$rc"
# The scheduler's record of this job: a segment that stopped to be continued did what it should
# (COMPLETED in sacct, no failure mail); hpcrl's own record above keeps the trainer's code.
if [ "$rc" -eq 85 ]; then
  exit 0
fi
exit "$rc"
