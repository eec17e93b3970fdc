#!/bin/bash
#SBATCH --account=m1234_g
#SBATCH --chdir=/pscratch/sd/u/user/hpcrl/runs/pm2
#SBATCH --constraint=gpu
#SBATCH --cpus-per-task=128
#SBATCH --dependency=singleton
#SBATCH --gpus-per-node=4
#SBATCH --job-name=pm2
#SBATCH --nodes=2
#SBATCH --open-mode=append
#SBATCH --output=/pscratch/sd/u/user/hpcrl/runs/pm2/logs/job-%j.log
#SBATCH --qos=regular
#SBATCH --signal=B:USR1@300
#SBATCH --time=240
# hpcrl segment script for run pm2 on site perlmutter.
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

export HPCRL_RUN_ID=pm2
export HPCRL_RUN_DIR=/pscratch/sd/u/user/hpcrl/runs/pm2
export HPCRL_CKPT_DIR=/pscratch/sd/u/user/hpcrl/runs/pm2/checkpoints
export HPCRL_METRICS=/pscratch/sd/u/user/hpcrl/runs/pm2/metrics.jsonl
hpcrl_py=/opt/hpcrl/bin/python
export PYTHONPATH=/pscratch/sd/u/user/hpcrl/runs/pm2/lib${PYTHONPATH:+:$PYTHONPATH}
export HPCRL_JOB_ID="$SLURM_JOB_ID"

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


# Modules (site profile)
module load python


# Environment (spec and site; secrets are never written here: they come from the submitting
# shell's environment)
export OMP_NUM_THREADS=8
export HF_HUB_OFFLINE=1
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
# The site's job_env: expanded here, in the job (caches on the job's own $SCRATCH)
export HF_HOME="$SCRATCH/hpcrl/cache/huggingface"
export PIP_CACHE_DIR="$SCRATCH/hpcrl/cache/pip"
export TRITON_CACHE_DIR="$SCRATCH/hpcrl/cache/triton"
export VLLM_CACHE_ROOT="$SCRATCH/hpcrl/cache/vllm"
export XDG_CACHE_HOME="$SCRATCH/hpcrl/cache"


# NCCL across nodes (site gpu_stack.nccl): the network plugin and the interconnect's settings
module load nccl
export FI_CXI_DISABLE_HOST_REGISTER=1
export FI_MR_CACHE_MONITOR=userfaultfd
export NCCL_CROSS_NIC=1
export NCCL_NET_GDR_LEVEL=PHB
export NCCL_SOCKET_IFNAME=hsn


# The venv: built once per distinct requirement set at `hpcrl submit`, on the login side (where
# the software file system is writable: compute nodes may mount it read-only, as Perlmutter's
# /global/common). The job only checks that it is ready and activates it; it writes nothing there.
# Its requirements:
#   --extra-index-url https://download.pytorch.org/whl/cu129
#   torch==2.11.0+cu129
#   transformers>=5.0,<5.20
#   tokenizers>=0.21
#   safetensors>=0.4
#   xxhash>=3.0
#   numpy>=1.26
#   pandas>=2.0
#   pyarrow>=15
venv=/global/cfs/cdirs/m1234/hpcrl/venvs/c96a2b9e9e2f
if [ ! -f "$venv/.hpcrl-ready" ] || ! "$venv/bin/python" -c '' 2>/dev/null; then
  hpcrl_why="venv $venv is missing, unfinished or stale; build it on a login node: "'hpcrl venv build --run pm2'
  echo "hpcrl: $hpcrl_why" >&2
  echo "$hpcrl_why" > "$HPCRL_RUN_DIR/trainer_error.txt"
  "$hpcrl_py" -m hpcrl.cli _segment end "$HPCRL_RUN_DIR" --job-id "$HPCRL_JOB_ID" --rc 1
  exit 1
fi
echo "hpcrl: venv $venv (ready since $(date -r "$venv/.hpcrl-ready" '+%F %T'))"
source "$venv/bin/activate"
trainer_py="$venv/bin/python"



# The venv's torch must see every GPU this job was given: a build for a newer CUDA than the
# driver's sees none (the trainer would run on the CPU or crash at its first CUDA call). Seconds.
# HPCRL_GPUS_REQUIRED: the built-in trainer, too, refuses to fall back to the CPU.
export HPCRL_GPUS_REQUIRED=1
hpcrl_gpu=$("$trainer_py" -m hpcrl.rl.gpucheck 2>&1)
hpcrl_gpu_rc=$?
hpcrl_gpu=$(printf '%s\n' "$hpcrl_gpu" | tail -n 1)  # the verdict; torch's own warnings come before it
if [ "$hpcrl_gpu_rc" -ne 0 ]; then
  echo "hpcrl: $hpcrl_gpu" >&2
  echo "$hpcrl_gpu" > "$HPCRL_RUN_DIR/trainer_error.txt"
  "$hpcrl_py" -m hpcrl.cli _segment end "$HPCRL_RUN_DIR" --job-id "$HPCRL_JOB_ID" --rc 1
  exit 1
fi
echo "hpcrl: $hpcrl_gpu"


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
# torchrun's rendezvous: a c10d store on the first node of the job (every node's torchrun meets
# there and numbers the ranks), on a port derived from the job id, the job id as rendezvous id.
hpcrl_rdzv_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
hpcrl_rdzv_port=$(( 15000 + ${HPCRL_JOB_ID%%_*} % 15000 ))
echo "hpcrl: torchrun rendezvous at $hpcrl_rdzv_host:$hpcrl_rdzv_port"
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
    srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=128 "$trainer_py" -m torch.distributed.run --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint "$hpcrl_rdzv_host:$hpcrl_rdzv_port" --rdzv-id "$HPCRL_JOB_ID" -m hpcrl.rl.train --config /pscratch/sd/u/user/hpcrl/runs/pm2/trainer.json
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
