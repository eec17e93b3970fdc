"""Does the venv's torch see every GPU this job was given? Seconds, before the trainer starts.

    python -m hpcrl.gpucheck        # the job's trainer python; exit 0 and one line, or 1 and one line

A torch built for a newer CUDA than the node's driver supports (a CUDA 13 wheel on a CUDA 12
driver) sees no GPU at all: `torch.cuda.is_available()` is False, a trainer would run on the CPU
or crash at its first CUDA call. The GPUs given are CUDA_VISIBLE_DEVICES's (Slurm's gres sets it);
the driver's CUDA is what `nvidia-smi` prints as "CUDA Version". Imports torch only when run
(never at CLI import time); stdlib otherwise, so the built-in trainer can ask it too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys


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


def torch_build() -> tuple[str, str | None, int]:
    """(torch version, the CUDA it is built for or None for a CPU build, GPUs it sees)."""
    import torch

    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return torch.__version__, torch.version.cuda, seen


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


def main() -> int:
    given = gpus_given()
    try:
        version, build, seen = torch_build()
    except Exception as e:  # torch itself does not import: the venv is broken
        print(f"GPU check failed: the venv's torch does not import ({type(e).__name__}: {e}); rebuild the venv "
              f"(hpcrl venv build)")
        return 1
    ok, line = verdict(given, version, build, seen, driver_cuda())
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
