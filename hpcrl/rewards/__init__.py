"""The reward side: a response and its row in, a score (and why) out. Stdlib only except `mix`'s
reward model (torch, loaded lazily); verl's reward workers load these files by path, each finding
the next beside itself, so no module here imports hpcrl outside this folder.

    score.py            compute_score / compute_score_batch (verl's custom-reward signature): the
                        rule rewards (countdown, gsm8k), the code reward, load_reward
    extract.py          answer text -> (code, the shape it was found in): fences read line by line
    sandbox.py          program + tests -> Result: runs the program away from the trainer
      sandbox_harness.py, sandbox_server.py   what runs in the sample, the fork server's loop
      cgroups.py, cpus.py                     a sample's memory/process limits, the pool's width
    judge.py            test text + the program's values -> verdicts, decided in the trainer
    mix.py              args.reward ("code + 0.01*length", model:PATH) -> the trainer's batch reward

`hpcrl.rl.rewards` and `hpcrl.rl.sandbox` (and the file hpcrl/rl/rewards.py, by path) still name
score.py and sandbox.py: runs and specs made before the move (issue 40) name them.
"""
