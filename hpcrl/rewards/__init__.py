"""The reward side: a response and its row in, a score (and why) out. Stdlib only except `mix`'s
reward model (torch, loaded lazily); verl's reward workers load these files by path, each finding
the next beside itself, so no module here imports hpcrl outside this folder.

    score.py            compute_score / compute_score_batch (verl's custom-reward signature): the
                        rule rewards (countdown, gsm8k), the code reward, load_reward
    extract.py          answer text -> (code, the shape it was found in): fences read line by line
    sandbox.py          program + tests -> Result: runs the program away from the trainer, and
                        which of a test's names cross to the program (_test_plans)
      sandbox_harness.py  the sample's pid 1: namespaces, its root, the processes below
      sandbox_program.py  the program's process: runs the answer, serves the tests' calls as data
      sandbox_tester.py   the test interpreter: runs the tests with Python's own names, the verdicts
      sandbox_seccomp.py  the sample's no_new_privs and seccomp filter
      sandbox_server.py   the fork server's loop
      cgroups.py, cpus.py a sample's memory/process limits, the pool's width
    mix.py              args.reward ("code + 0.01*length", model:PATH) -> the trainer's batch reward
    llm_judge.py        an LLM judge (rubric, fenced response, score parsed) over an OpenAI-compatible
                        endpoint or `vllm serve`: retries, cache, spending cap (urllib only)

`hpcrl.rl.rewards` and `hpcrl.rl.sandbox` (and the file hpcrl/rl/rewards.py, by path) still name
score.py and sandbox.py: runs and specs made before the move (issue 40) name them.
"""
