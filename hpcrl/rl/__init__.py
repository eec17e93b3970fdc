"""hpcrl's built-in RL trainer (GRPO, Dr.GRPO, GSPO, GSPO-token). The only place torch,
transformers, pandas and vllm are imported. From the launcher it uses only what
docs/architecture.md's `rl-may-import` line allows: hpcrl.protocol and the stdlib-only leaves
(hpcrl.checkpoints.store with hpcrl.atomicio, hpcrl.errors, hpcrl.gpucheck, hpcrl.samplestore: the
samples it keeps, and hpcrl.schemas: its argument table and algorithm registry,
hpcrl/schemas/builtin.py). The launcher reaches it only as a process.
Entry point: python -m hpcrl.rl.train --config FILE.
"""
