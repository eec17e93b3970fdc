"""The inner loop's selection (tests/conftest.py QUICK, `scripts/test --quick`): every entry names
something that exists, a file nobody classified stays in the full suite only, and nothing marked
slow, Slurm or Ray, and no tier, is ever in it (pytest's own collection, as scripts/test runs it)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

def _top_conftest():
    """tests/conftest.py by its path: `from conftest import` finds whichever conftest pytest
    imported last (tests/rl/ has its own)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hpcrl_tests_top_conftest", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_top = _top_conftest()
NOT_QUICK, QUICK, TESTS_DIR, TIERS, is_quick = _top.NOT_QUICK, _top.QUICK, _top.TESTS_DIR, _top.TIERS, _top.is_quick

ROOT = TESTS_DIR.parent


def test_every_entry_names_a_file_or_test_that_exists():
    for rel in QUICK:
        assert (TESTS_DIR / rel).is_file() and Path(rel).name.startswith("test_"), rel
        assert Path(rel).name not in TIERS, rel
    for entry in NOT_QUICK:
        rel, _, name = entry.partition("::")
        assert rel in QUICK, f"{entry}: only a test of a QUICK file needs leaving out"
        assert f"def {name}(" in (TESTS_DIR / rel).read_text(encoding="utf-8"), f"{entry}: no such test"


class _Item:  # what is_quick reads of a pytest item: a stand-in with a path, a name and markers
    def __init__(self, rel, name="test_x", markers=()):
        self.path, self.name, self.markers = TESTS_DIR / rel, name, set(markers)

    def get_closest_marker(self, name):
        return name if name in self.markers else None


def test_an_unlisted_file_a_left_out_test_and_a_slow_marker_stay_out_of_the_inner_loop():
    assert is_quick(_Item("test_lifecycle.py"))  # listed: in
    assert not is_quick(_Item("test_brand_new.py"))  # a new file nobody classified: the full suite only
    assert not is_quick(_Item("rl/test_brand_new.py"))
    rel, _, name = NOT_QUICK[0].partition("::")
    assert is_quick(_Item(rel)) and not is_quick(_Item(rel, f"{name}[param]"))
    for marker in ("slow", "slurm", "uses_ray", "stops_slurmctld"):
        assert not is_quick(_Item("test_lifecycle.py", markers=[marker])), marker


def _collect(*args, quick=True):
    env = {k: v for k, v in os.environ.items() if k not in ("HPCRL_TEST_QUICK", "HPCRL_TEST_PHASE")}
    if quick:
        env["HPCRL_TEST_QUICK"] = "1"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p",
                           "no:xdist", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, [ln.split("[")[0] for ln in proc.stdout.splitlines() if "::" in ln]


def test_pytest_collects_only_quick_files_and_nothing_marked_slow_slurm_or_ray():
    rc, ids = _collect("tests")
    assert rc == 0 and ids
    files = {Path(i.split("::")[0]).relative_to("tests").as_posix() for i in ids}
    assert files == set(QUICK), "every listed file has quick tests, and no other file is collected"
    assert not {f"tests/{entry}" for entry in NOT_QUICK} & set(ids), "a left-out test was collected"
    slow = "slow or slurm or uses_ray or stops_slurmctld"
    rc, ids = _collect("tests", "-m", slow)
    assert rc == 5 and not ids, f"marked tests in the inner loop: {sorted(set(ids))}"
    rc, ids = _collect("tests/rl/test_code_tiny.py", "-m", slow, quick=False)
    assert rc == 0 and ids, "the markers select tests outside the inner loop (else the check above proves nothing)"


def test_the_measured_file_times_name_files_that_exist_and_order_the_longest_first():
    """tests/file_seconds.txt (scripts/suite_times.py --write-seconds) orders the full suite's files
    for the workers: an entry for a renamed file would silently stop counting."""
    seconds = _top._file_seconds()
    assert len(seconds) > 20, "tests/file_seconds.txt is missing or unreadable"
    missing = [rel for rel in seconds if not (TESTS_DIR / rel).is_file()]
    assert not missing, f"tests/file_seconds.txt names files that do not exist: {missing}"
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/rl/test_dist.py", "tests/test_cli.py", "tests/test_protocol.py"],
                         cwd=ROOT, env={**{k: v for k, v in os.environ.items() if k != "HPCRL_TEST_QUICK"},
                                        "HPCRL_TEST_PHASE": "light"}, capture_output=True, text=True)
    files = list(dict.fromkeys(ln.split("::")[0] for ln in out.stdout.splitlines() if "::" in ln))
    assert len(files) == 3, out.stdout[-2000:] + out.stderr[-2000:]
    # test_cli has more tests than test_dist, which is longer: xdist's own order would be reversed
    assert files == sorted(files, key=lambda f: -seconds[f.removeprefix("tests/")]), files


def _ray_networks(path: Path) -> set[str]:
    """The Ray locks a test file's markers take (tests/conftest.py's _slurm_locks): uses_ray(NETWORK),
    uses_ray alone ("host"), both_nodes ("slurm-nodes")."""
    import re

    text = path.read_text(encoding="utf-8")
    nets = {m or "host" for m in re.findall(r'pytest\.mark\.uses_ray(?:\("([a-z-]+)"\))?', text)}
    return nets | ({"slurm-nodes"} if "pytest.mark.both_nodes" in text else set())


def test_no_light_test_shares_a_ray_lock_with_a_tier():
    """The phases run side by side: a light test that waited for a tier's run (~13 minutes holding
    its lock) idled its worker for it, and ran past its own timeout under load."""
    from slurm_fixture import RAY_LOCKS

    files = [p for p in TESTS_DIR.rglob("test_*.py") if p.name != "test_quick.py"]
    tiers = {p.name: _ray_networks(p) for p in files if p.name in TIERS}
    light = {p.name: _ray_networks(p) for p in files if p.name not in TIERS}
    assert tiers["test_verl_tier_slurm.py"] == {"slurm-tier"} and "slurm-nodes" in light["test_slurm_ranks.py"]
    for name, nets in {**tiers, **light}.items():
        assert nets <= set(RAY_LOCKS), (name, nets)
    shared = {(t, n): tiers[t] & nets for t in tiers for n, nets in light.items() if tiers[t] & nets}
    assert not shared, shared


def test_the_venv_holds_the_bytecode_of_what_the_suite_imports():
    """scripts/setup compiles the venv's packages and hpcrl itself: with PYTHONDONTWRITEBYTECODE set
    (as on the test machine) pip compiles nothing and Python writes no __pycache__, and every
    process of the suite compiled torch's sources at each import."""
    import importlib.util

    import torch
    import torch.distributed.run
    import transformers

    import hpcrl.cli

    for module in (torch, torch.distributed.run, transformers, hpcrl.cli):
        assert Path(importlib.util.cache_from_source(module.__file__)).is_file(), module.__file__
