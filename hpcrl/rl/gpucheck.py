"""The check every GPU segment starts with (seconds, before the trainer):

    python -m hpcrl.rl.gpucheck     # the job's trainer python; exit 0 and one line, or 1 and one line

torch's side of hpcrl/gpucheck.py: which torch, built for which CUDA, and how many GPUs it sees.
"""

from __future__ import annotations

import sys

from ..gpucheck import driver_cuda, gpus_given, verdict


def torch_build() -> tuple[str, str | None, int]:
    """(torch version, the CUDA it is built for or None for a CPU build, GPUs it sees)."""
    import torch

    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return torch.__version__, torch.version.cuda, seen


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
