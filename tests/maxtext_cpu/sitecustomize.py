"""Installs the TPU-rollout TEST DOUBLE (hpcrl_test_tpu_rollout_double.py) in a MaxText process.

Python imports `sitecustomize` from the first folder of sys.path that has one, so a test that puts
tests/maxtext_cpu/ on PYTHONPATH reaches every interpreter of the job with it: only where
HPCRL_TEST_TPU_ROLLOUT_DOUBLE=1 does it do anything, and then only for the two MaxText modules
that need vLLM-on-TPU; every other import is untouched. Never shipped (tests/ is not in the wheel).
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_REPLACED = ("maxtext.integration.vllm.maxtext_vllm_adapter", "maxtext.integration.vllm.maxtext_vllm_rollout")


class _DoubleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in _REPLACED:
            return None
        here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hpcrl_test_tpu_rollout_double.py")
        return importlib.util.spec_from_file_location(name, here)


if os.environ.get("HPCRL_TEST_TPU_ROLLOUT_DOUBLE") == "1":
    sys.meta_path.insert(0, _DoubleFinder())
