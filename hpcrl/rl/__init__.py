"""hpcrl's built-in RL trainer (GRPO, Dr.GRPO, GSPO, GSPO-token). The only place torch,
transformers, pandas and vllm are imported; from the launcher it uses only hpcrl.protocol,
hpcrl.ckptstore (with its hpcrl.atomicio) and hpcrl.errors, and nothing outside this package
imports it (except `hpcrl data`/`hpcrl model`, which load hpcrl.rl.commands lazily).
Entry point: python -m hpcrl.rl.train --config FILE.
"""
