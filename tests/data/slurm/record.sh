#!/usr/bin/env bash
# Re-record the real Slurm outputs that tests/test_slurm_parse.py parses.
#   scripts/slurm-cluster start && tests/data/slurm/record.sh      (takes ~2 minutes)
# Jobs: ok (exit 0), fail (exit 3), run (sleeps; cancelled at the end), tmo (--time=1, sleeps past it),
# dep (afterok on `run`: pending on its dependency, then never satisfied), res (pending: no free CPU).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
eval "$("$here/../../../scripts/slurm-cluster" env)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
sub() { sbatch --parsable -o "$work/%j.out" "$@"; }
# shellcheck disable=SC2016  # the job script's own \$1/\$2
printf '#!/bin/bash\nsleep "${1:-0}"\nexit "${2:-0}"\n' >job.sh

ok=$(sub -J ok job.sh 0 0); fail=$(sub -J fail job.sh 0 3)
sleep 6  # let them finish before the long jobs take both CPUs
run=$(sub -J run job.sh 600); tmo=$(sub -J tmo --time=1 job.sh 600)
dep=$(sub -J dep --dependency=afterok:"$run" job.sh 1); res=$(sub -J res job.sh 1)
all="$ok,$fail,$run,$tmo,$dep,$res"
sleep 7
echo "$ok" >"$here/sbatch_parsable.txt"
squeue --json >"$here/squeue_early.json"
squeue -h -t all -j "$all" -o '%i|%T|%r|%S|%e' >"$here/squeue_early.txt"
scontrol show job "$run" >"$here/scontrol_running.txt"
scontrol show job "$dep" >"$here/scontrol_pending.txt"
scontrol show job "$ok" >"$here/scontrol_completed.txt"
scontrol show job "$fail" >"$here/scontrol_failed.txt"
echo "waiting for job $tmo to hit its 1-minute limit"
until [[ "$(squeue -h -t all -j "$tmo" -o %T)" == TIMEOUT ]]; do sleep 2; done
scancel "$run"; sleep 3
squeue --json >"$here/squeue_late.json"
squeue -h -t all -j "$all" -o '%i|%T|%r|%S|%e' >"$here/squeue_late.txt"
scontrol show job "$tmo" >"$here/scontrol_timeout.txt"
scontrol show job "$run" >"$here/scontrol_cancelled.txt"
# No slurmdbd here: plain sacct fails; `sacct -c` reads the jobcomp file in the same format.
sacct -j "$all" -P -n -o JobID,State,ExitCode,Start,End >"$here/sacct_disabled.txt" 2>&1 || true
sacct -c -j "$all" -P -n -o JobID,State,ExitCode,Start,End >"$here/sacct_jobcomp.txt"
scancel "$dep" "$res" 2>/dev/null || true
echo "jobs: ok=$ok fail=$fail run=$run tmo=$tmo dep=$dep res=$res" | tee "$here/jobs.txt"
