"""hpcrl's built-in RL trainer (GRPO, Dr.GRPO, GSPO, GSPO-token). The only place torch,
transformers, pandas and vllm are imported; from the launcher it uses only hpcrl.protocol and
the stdlib-only leaves hpcrl.errors and hpcrl.schemas (its argument table and algorithm registry,
hpcrl/schemas/builtin.py), and nothing outside this package imports it (except `hpcrl data`/`hpcrl model`,
which load hpcrl.rl.commands lazily). Entry point: python -m hpcrl.rl.train --config FILE.
"""
