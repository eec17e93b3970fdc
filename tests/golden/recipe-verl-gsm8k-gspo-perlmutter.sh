#!/bin/bash
#SBATCH --account=m1234_g
#SBATCH --chdir=/pscratch/sd/u/user/hpcrl/runs/verl-gsm8k-gspo
#SBATCH --constraint=gpu
#SBATCH --cpus-per-task=128
#SBATCH --dependency=singleton
#SBATCH --gpus-per-node=4
#SBATCH --job-name=verl-gsm8k-gspo
#SBATCH --nodes=1
#SBATCH --open-mode=append
#SBATCH --output=/pscratch/sd/u/user/hpcrl/runs/verl-gsm8k-gspo/logs/job-%j.log
#SBATCH --qos=regular
#SBATCH --signal=B:USR1@300
#SBATCH --time=240
#SBATCH --time-min=60
# hpcrl segment script for run verl-gsm8k-gspo on site perlmutter.
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

export HPCRL_RUN_ID=verl-gsm8k-gspo
export HPCRL_RUN_DIR=/pscratch/sd/u/user/hpcrl/runs/verl-gsm8k-gspo
export HPCRL_CKPT_DIR=/pscratch/sd/u/user/hpcrl/runs/verl-gsm8k-gspo/checkpoints
export HPCRL_METRICS=/pscratch/sd/u/user/hpcrl/runs/verl-gsm8k-gspo/metrics.jsonl
hpcrl_py=/opt/hpcrl/bin/python
export PYTHONPATH=/pscratch/sd/u/user/hpcrl/runs/verl-gsm8k-gspo/lib${PYTHONPATH:+:$PYTHONPATH}
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
export PYTHONUNBUFFERED=1
# The site's job_env: expanded here, in the job (caches on the job's own $SCRATCH)
export HF_HOME="$SCRATCH/hpcrl/cache/huggingface"
export PIP_CACHE_DIR="$SCRATCH/hpcrl/cache/pip"
export TRITON_CACHE_DIR="$SCRATCH/hpcrl/cache/triton"
export VLLM_CACHE_ROOT="$SCRATCH/hpcrl/cache/vllm"
export XDG_CACHE_HOME="$SCRATCH/hpcrl/cache"


# The venv: built once per distinct requirement set at `hpcrl submit`, on the login side (where
# the software file system is writable: compute nodes may mount it read-only, as Perlmutter's
# /global/common). The job only checks that it is ready and activates it; it writes nothing there.
# Its size: 4.5 GB of wheels for Linux x86_64 (256 packages), ~11 GB installed (estimate)
# Its requirements:
#   --extra-index-url https://download.pytorch.org/whl/cu129
#   --extra-index-url https://wheels.vllm.ai/0.24.0/cu129
#   verl[vllm]==0.9.1
#   torch==2.11.0+cu129
#   torchvision==0.26.0+cu129
#   torchaudio==2.11.0+cu129
#   vllm==0.24.0+cu129
#   transformers==5.9.0
venv=/global/cfs/cdirs/m1234/hpcrl/venvs/7d82806332e6
if [ ! -f "$venv/.hpcrl-ready" ] || ! "$venv/bin/python" -c '' 2>/dev/null; then
  hpcrl_why="venv $venv is missing, unfinished or stale; build it on a login node: "'hpcrl venv build --run verl-gsm8k-gspo'
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

# Trainer bootstrap (from the trainer adapter)
# --- Ray's environment (hpcrl verl adapter): one GPU list; a token for this segment, never on disk ---
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then unset ROCR_VISIBLE_DEVICES; fi
if [ -z "${RAY_AUTH_MODE:-}" ]; then
    export RAY_AUTH_MODE=token
    RAY_AUTH_TOKEN=$("$trainer_py" -c 'import secrets; print(secrets.token_hex(32))')
    export RAY_AUTH_TOKEN
fi



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
    "$trainer_py" -m hpcrl.job.verl --python "$trainer_py" --ckpt-dir /pscratch/sd/u/user/hpcrl/runs/verl-gsm8k-gspo/checkpoints --save-mode deadline --save-freq 20 --save-every-s 1800 --save-time-s 300 --logger auto --keep 2 -- 'data.train_files='"'"'$SCRATCH/hpcrl/data/gsm8k/train.parquet'"'"'' 'data.val_files='"'"'$SCRATCH/hpcrl/data/gsm8k/test.parquet'"'"'' data.train_batch_size=128 data.max_prompt_length=512 data.max_response_length=1024 'actor_rollout_ref.model.path='"'"'$SCRATCH/models/Qwen2.5-0.5B-Instruct'"'"'' actor_rollout_ref.actor.optim.lr=1e-06 actor_rollout_ref.actor.ppo_mini_batch_size=64 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=16 actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 +actor_rollout_ref.model.override_config.attn_implementation=sdpa actor_rollout_ref.model.use_remove_padding=False algorithm.adv_estimator=grpo actor_rollout_ref.actor.policy_loss.loss_mode=gspo actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean actor_rollout_ref.actor.clip_ratio_low=0.0003 actor_rollout_ref.actor.clip_ratio_high=0.0004 actor_rollout_ref.actor.clip_ratio_c=10.0 actor_rollout_ref.actor.use_kl_loss=False algorithm.use_kl_in_reward=False reward.custom_reward_function.path=/pscratch/sd/u/user/hpcrl/runs/verl-gsm8k-gspo/verl/rewards.py reward.custom_reward_function.name=compute_score trainer.default_local_dir=/pscratch/sd/u/user/hpcrl/runs/verl-gsm8k-gspo/checkpoints trainer.resume_mode=auto trainer.nnodes=1 trainer.n_gpus_per_node=4 trainer.total_epochs=15 trainer.test_freq=10 trainer.project_name=hpcrl-gsm8k trainer.experiment_name=verl-gsm8k-gspo trainer.max_actor_ckpt_to_keep=2 trainer.max_critic_ckpt_to_keep=2 trainer.use_v1=False trainer.esi_redundant_time=300 trainer.rollout_data_dir=/pscratch/sd/u/user/hpcrl/runs/verl-gsm8k-gspo/verl/rollouts ray_kwargs.ray_init.num_cpus=128
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
