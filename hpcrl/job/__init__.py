"""Job-side code: what runs inside the batch job, in the trainer's own interpreter, from the run's
lib/ snapshot of hpcrl (the segment script puts it on PYTHONPATH). Stdlib only, like the protocol
it speaks: `supervisor` runs a foreign trainer (one that handles no signal of hpcrl's) under the
walltime protocol; `verl` and `maxtext` hold what is particular to each (`python -m hpcrl.job.verl`);
`verl_rollouts` reads what verl dumps of each step (the job prunes it, `hpcrl samples` shows it).
"""
