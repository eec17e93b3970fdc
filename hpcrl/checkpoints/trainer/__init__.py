"""The trainer side of checkpointing (torch): imported only by the built-in trainer (hpcrl/rl),
never by the launcher or the CLI. See hpcrl/checkpoints/__init__.py."""
