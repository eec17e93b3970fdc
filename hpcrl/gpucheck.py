"""Does the venv's torch see every GPU this job was given? The stdlib half: the GPUs given, the
driver's CUDA, and the one-line verdict (`hpcrl doctor` and scripts use it on any interpreter).
The torch half runs in the job: `python -m hpcrl.rl.gpucheck` (hpcrl/rl/gpucheck.py).

A torch built for a newer CUDA than the node's driver supports (a CUDA 13 wheel on a CUDA 12
driver) sees no GPU at all: `torch.cuda.is_available()` is False, a trainer would run on the CPU
or crash at its first CUDA call. The GPUs given are CUDA_VISIBLE_DEVICES's (Slurm's gres sets it);
the driver's CUDA is what `nvidia-smi` prints as "CUDA Version".
"""

from __future__ import annotations

import os
import re
import subprocess


def gpus_given(environ=None) -> int:
    """How many GPUs the job was given: CUDA_VISIBLE_DEVICES's entries (0 when unset or empty)."""
    value = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES", "").strip()
    if not value or value in ("-1", "NoDevFiles"):
        return 0
    return len([v for v in value.split(",") if v.strip()])


def driver_cuda() -> str | None:
    """The CUDA version the driver supports, from nvidia-smi (None: no nvidia-smi, or it failed)."""
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"CUDA Version:\s*([0-9]+\.[0-9]+)", out)
    return m.group(1) if m else None


def verdict(given: int, version: str, build: str | None, seen: int, driver: str | None) -> tuple[bool, str]:
    """(passed, the one line that says so)."""
    facts = (f"driver CUDA {driver or 'unknown (nvidia-smi gave none)'}, the venv's torch {version} "
             f"{'built for CUDA ' + build if build else '(a CPU build)'}")
    if given and seen >= given:
        return True, f"GPU check passed: torch sees all {given} GPUs given ({facts})"
    if not given:
        return False, (f"GPU check failed: this job was given no GPU (CUDA_VISIBLE_DEVICES is empty; {facts}); "
                       f"request GPUs (resources.gpus_per_node) or run on a CPU site")
    fix = ("a CPU build of torch: install a CUDA build (site gpu_stack.cuda_variant) and rebuild the venv" if not build
           else f"install a torch built for CUDA <= {driver or 'the driver'}'s (site gpu_stack.cuda_variant) "
                f"and rebuild the venv (hpcrl venv build)")
    return False, f"GPU check failed: the venv's torch sees {seen} of the {given} GPUs given ({facts}); {fix}"
