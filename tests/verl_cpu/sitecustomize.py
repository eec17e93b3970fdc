"""TEST DOUBLE helper, tests only: Python's site module imports it at start-up in every process
whose PYTHONPATH holds this folder (the verl tests give the job that PYTHONPATH). It is a no-op
unless HPCRL_TEST_CPU_DOUBLE=1, and imports nothing heavy.

What it changes: vLLM's shared-memory message queue reader never spins. It busy-loops
(sched_yield) for a second after every message (SpinCondition, busy_loop_s=1), meant for a GPU
node's idle cores; on this 2-core machine the vLLM worker spun at ~0.4 of a core through a whole
verl run (60% of a PPO run's steady CPU), and the engine core after each reply, taken from the
trainer and the rest of the suite. The reader now waits in its poll at once (the wake-up path
vLLM itself takes after a second idle), for at most 10 ms at a time: without the spin a missed
wake-up held a weight sync or a generation until the next message, ~5 s later.

Here rather than in hpcrl_test_cpu_platform_double.py because vLLM's engine core process imports
neither verl nor that module (verl's plugin hook loads it), and its reader spins too.
"""

import os
import sys

_NAME = "vllm.distributed.device_communicators.shm_broadcast"


def _patch(mod):
    cls = mod.SpinCondition
    if getattr(cls, "_hpcrl_no_spin", False):
        return
    init, wait = cls.__init__, cls.wait

    def __init__(self, is_reader, context, notify_address, busy_loop_s=1):
        init(self, is_reader, context, notify_address, busy_loop_s=0)

    def wait_briefly(self, timeout_ms=None):
        wait(self, timeout_ms=10 if timeout_ms is None else min(timeout_ms, 10))

    cls.__init__, cls.wait, cls._hpcrl_no_spin = __init__, wait_briefly, True


if os.environ.get("HPCRL_TEST_CPU_DOUBLE") == "1":
    import importlib.abc
    import importlib.machinery

    class _PatchShmBroadcast(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != _NAME:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                _patch(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    if _NAME in sys.modules:
        _patch(sys.modules[_NAME])
    else:
        sys.meta_path.insert(0, _PatchShmBroadcast())
