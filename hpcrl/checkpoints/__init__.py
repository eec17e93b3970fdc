"""Checkpointing of hpcrl's own trainers, one component: the checkpoint as it is written, sealed
and read.

- `trainer/` (torch; imported only by the built-in trainer, hpcrl/rl): the trainer's state
  snapshotted and written (`checkpointer`: model, optimizer, RNG, data position, a background
  save), whole or in parts, one per fsdp rank (`parts`), as streamed, checksummed safetensors
  files (`tensorfile`); and read back on resume.
- `store` (stdlib, the bottom layer): the sealed on-disk layout both sides share: step-N/ with
  its MANIFEST.json, the LATEST pointer, keep-last-K. The launcher reads a run's progress through
  it (the adapters' `checkpoint_step`, `status`, `export`) without torch.

Its readers stay with the verbs they serve: `hpcrl export` (hpcrl/export.py) needs the run's
venv and the trainer adapters, which stand above this package. The parts stand in the layers
docs/architecture.md states (`checkpoints.store` at the bottom, `checkpoints.trainer` on the
trainer side with hpcrl/rl; tests/test_layering.py). This file imports nothing.
"""
