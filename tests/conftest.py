"""Shared fixtures. Tests never touch the real home: HPCRL_HOME and HPCRL_SITES_DIR point into
tmp_path, and the CLI runs as a real subprocess where processes and signals matter. Helpers
(waiting, the CLI, metrics, checkpoints) are in helpers.py."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from helpers import PWNED

try:  # the Slurm fixture lives with the Slurm tests' helpers
    from slurm_fixture import pm_cluster, slurm_cluster  # noqa: F401
except ImportError:
    pass


@pytest.fixture(autouse=True)
def _slurm_locks(request):
    """Slurm and Ray tests run on several xdist workers at once: see slurm_fixture's locks."""
    node = request.node
    slurm = node.get_closest_marker("slurm") and not node.get_closest_marker("stops_slurmctld")
    ray = node.get_closest_marker("uses_ray")
    # a local Ray (the verl tier) too: it shares this machine's ports with the Slurm ones. A job on
    # both nodes is queued only when no other test's is (the Ray tests' two-node jobs included): a
    # two-node job pending behind a busy node reserves the other one, which held every later
    # one-node job back from the main scheduler, and their tests timed out
    network = ray.args if ray else ("slurm-nodes",) if node.get_closest_marker("both_nodes") else None
    if not slurm and network is None:
        yield
        return
    from slurm_fixture import cluster_shared, ray_to_myself

    with contextlib.ExitStack() as stack:
        if slurm:
            stack.enter_context(cluster_shared())
        if network is not None:
            stack.enter_context(ray_to_myself(*network))
        yield


# The tiers: real trainers (MaxText, verl on Ray, SmolLM2 in bf16, vLLM) and the demo beside its CPU
# hog. scripts/test runs the suite as two pytest sessions, HPCRL_TEST_PHASE=light (everything
# else) and =tiers (these files), side by side: the tiers are paced mostly by their walltime
# segments and the rollout doubles' delays (MaxText's trainer sat at ~20% of a core), so one after
# the other (~13 + ~20 minutes) left the machine half idle. A lifecycle test must therefore hold
# beside a busy neighbour, as it must beside any user's. pytest run by hand without the variable
# runs everything in one session. Within a phase, files that run longest go to the xdist workers
# first (scripts/test turns off xdist's own order, which sorts files by their number of tests and
# so started the verl tier, 3 tests and ~8 minutes, last). No light test waits for a tier: the
# Slurm verl run has a node of its own (tests/slurm_fixture.py's locks; test_quick.py checks it).
#
# The tiers' order is for xdist's loadfile scheduler, which hands a worker its next file as soon as
# the worker has two tests or fewer left (not when it is free): within a file the slow tests go
# first (else SmolLM2's three quick checks made its worker take two more files at once, and it
# ran ~1900 s). A file of one or two tests takes its successor at once, so the order pairs them:
# the demo (1 test, ~2 minutes) takes MaxText, the verl tier (2) the vLLM tier, and SmolLM2's worker
# the Slurm verl run (1, ~12 minutes) once its slow test is done. Simulated against xdist's rule
# with each file's measured time, the best of the 720 orders (~1,190 s); q2's order put the vLLM
# tier and the Slurm verl run on one worker (~1,470 s).
TIERS = ("test_demo.py", "test_smollm2.py", "test_verl_tier.py", "test_maxtext_tier.py", "test_vllm_tier.py",
         "test_verl_tier_slurm.py", "test_llm_judge_tier.py", "test_smollm2_code.py", "test_smollm2_repair.py")
PHASES = ("light", "tiers")


# The inner loop, `scripts/test --quick` (HPCRL_TEST_QUICK=1): the files, relative to tests/, whose
# tests run in this process in seconds: no CLI run waited on, no torchrun or spawned ranks, no
# Slurm, no Ray, no model trained; a `bash -n`, a one-shot render or a fake gcloud call is fine.
# Measured with --durations=0 on the shared 2-core machine (load 4-7): ~75 s of tests in all,
# test_rollout_and_checkpoint the largest (~21 s). Every other file runs only in the full suite, and
# so does a new file until it is listed here (tests/test_quick.py checks the list). A "file::test"
# in NOT_QUICK leaves one slow test of a listed file out; so does a slow, slurm or Ray marker.
QUICK = (
    "test_lifecycle.py", "test_launch_faults.py", "test_layering.py", "test_ckptstore.py", "test_protocol.py",
    "test_slurm_parse.py", "test_trainer_args.py", "test_render.py", "test_ranks_render.py",
    "test_recipes_render.py", "test_maxtext.py", "test_tpu_backend.py",
    "rl/test_algos.py", "rl/test_memory.py", "rl/test_rewards.py", "rl/test_rollout_and_checkpoint.py",
    "rl/test_data_and_commands.py", "rl/test_config.py", "rl/test_walltime.py", "test_samples.py",
    "test_env_documented.py", "test_eval.py", "rl/test_llm_judge.py", "test_issue41_small.py",
    "test_verl_samples.py",
)
NOT_QUICK = (
    "rl/test_rewards.py::test_reward_model_batch_normalisation_is_global_and_truncates_from_the_left",  # ~21 s
    "test_tpu_backend.py::test_real_gcloud_parses_our_argv",  # the real gcloud CLI, 2-7 s a call
    "rl/test_llm_judge.py::test_submit_checks_the_judge_without_calling_it",  # three CLI submits, ~2 s
    # two tiny trainer runs, ~20 s
    "rl/test_llm_judge.py::test_the_trainer_steps_with_a_judge_term_and_fails_in_one_line_when_it_is_down",
)
NOT_QUICK_MARKERS = ("slow", "slurm", "uses_ray", "stops_slurmctld")
TESTS_DIR = Path(__file__).resolve().parent


FILE_SECONDS = TESTS_DIR / "file_seconds.txt"  # scripts/suite_times.py --write-seconds


def _file_seconds() -> dict[str, float]:
    """Each test file's wall time in a measured full run (path relative to tests/ -> seconds)."""
    out = {}
    try:
        lines = FILE_SECONDS.read_text(encoding="utf-8").splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(None, 1)
        if len(parts) == 2 and not line.startswith("#"):
            try:
                out[parts[1].strip()] = float(parts[0])
            except ValueError:
                continue
    return out


def _in_tiers(path: str) -> bool:
    return path.rsplit("/", 1)[-1] in TIERS


def is_quick(item) -> bool:
    """Whether a collected test belongs to the inner loop (see QUICK)."""
    try:
        rel = Path(item.path).resolve().relative_to(TESTS_DIR).as_posix()
    except ValueError:
        return False
    name = item.name.split("[", 1)[0]
    if rel not in QUICK or f"{rel}::{name}" in NOT_QUICK or rel.rsplit("/", 1)[-1] in TIERS:
        return False
    return not any(item.get_closest_marker(m) for m in NOT_QUICK_MARKERS)


def _quick() -> bool:
    return os.environ.get("HPCRL_TEST_QUICK") == "1"


def pytest_ignore_collect(collection_path, config):
    """In the inner loop the other files are not even imported (their imports cost seconds)."""
    if _quick() and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        try:
            rel = collection_path.resolve().relative_to(TESTS_DIR).as_posix()
        except ValueError:
            return None
        return True if rel not in QUICK else None
    return None


def pytest_collection_modifyitems(config, items):
    phase = os.environ.get("HPCRL_TEST_PHASE", "")
    if phase and phase not in PHASES:
        raise pytest.UsageError(f"HPCRL_TEST_PHASE={phase!r}: use one of {', '.join(PHASES)} (or leave it unset for all)")
    if _quick():
        slow = [item for item in items if not is_quick(item)]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if is_quick(item)]
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    if phase:
        dropped = [i for path, its in by_file.items() if _in_tiers(path) != (phase == "tiers") for i in its]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        by_file = {path: its for path, its in by_file.items() if _in_tiers(path) == (phase == "tiers")}

    seconds = _file_seconds()

    def rank(path: str):
        name = path.rsplit("/", 1)[-1]
        first = TIERS.index(name) if name in TIERS else len(TIERS)
        # a file that stops slurmctld first: that test waits until no other Slurm test runs, and
        # the tiers' Slurm verl run (~13 minutes) begins ~8 minutes in; later, a light worker
        # could stand idle for all of it
        alone = 0 if any(i.get_closest_marker("stops_slurmctld") for i in by_file[path]) else 1
        # then the longest first (FILE_SECONDS; a file not measured yet counts as long, 600 s), so
        # that the last file a worker takes is a short one: sorted by number of tests, as xdist
        # does, test_dist.py (19 tests, ~900 s) started a third of the way in and ended last
        rel = path.removeprefix("tests/")
        return (first, alone, -seconds.get(rel, 600.0), -len(by_file[path]), path)

    def order(path: str) -> list:  # in the tiers the slow tests first; elsewhere the file's own order
        its = by_file[path]
        return sorted(its, key=lambda i: 0 if i.get_closest_marker("slow") else 1) if _in_tiers(path) else its

    items[:] = [item for path in sorted(by_file, key=rank) for item in order(path)]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An isolated hpcrl home and user-sites dir for one test."""
    h = tmp_path / "home"
    sites = tmp_path / "sites"
    sites.mkdir(parents=True)
    monkeypatch.setenv("HPCRL_HOME", str(h))
    monkeypatch.setenv("HPCRL_SITES_DIR", str(sites))
    monkeypatch.delenv("HPCRL_ACCOUNT", raising=False)
    return h


@pytest.fixture
def fast_local(home):
    """A user site 'fastlocal' with short signal lead/margins so lifecycle tests take seconds."""
    sites = Path(os.environ["HPCRL_SITES_DIR"])
    (sites / "fastlocal.yaml").write_text(
        "extends: local\nsignal_lead_s: 4\nexit_margin_s: 1.5\nkill_grace_s: 3\n", encoding="utf-8")
    return "fastlocal"


@pytest.fixture(autouse=True)
def _no_pwned():
    for p in PWNED:
        p.unlink(missing_ok=True)
    yield
    leaked = [str(p) for p in PWNED if p.exists()]
    assert not leaked, f"a hostile value was executed: {leaked}"


# HPCRL_TEST_TIMES=DIR: each phase's controller appends one line a test phase to DIR/PHASE.tsv
# (worker, start, stop, outcome, when, nodeid), from which scripts/suite_times.py draws each
# worker's timeline and each file's wall time: what the files' order and the cost markers are
# judged by (xdist's --durations shows only the slowest tests, not how the workers were kept busy).
# Each test's own CPU goes to DIR/PHASE-cpu.tsv (nodeid, the pytest process's CPU, its waited-for
# children's): with scripts/cpu_sampler.py's figure for the processes a test leaves running
# (segments, Slurm jobs, Ray), where the suite's CPU goes.
def _phase_name() -> str:
    return os.environ.get("HPCRL_TEST_PHASE") or ("quick" if _quick() else "all")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    where = os.environ.get("HPCRL_TEST_TIMES")
    if not where:
        yield
        return
    import resource

    def cpu(who):
        r = resource.getrusage(who)
        return r.ru_utime + r.ru_stime

    own, kids = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
    yield
    line = f"{item.nodeid}\t{cpu(resource.RUSAGE_SELF) - own:.2f}\t{cpu(resource.RUSAGE_CHILDREN) - kids:.2f}\n"
    with open(Path(where) / f"{_phase_name()}-cpu.tsv", "a", encoding="utf-8") as f:
        f.write(line)


def pytest_runtest_logreport(report):
    where = os.environ.get("HPCRL_TEST_TIMES")
    if not where or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    worker = getattr(getattr(report, "node", None), "gateway", None)
    line = "\t".join([getattr(worker, "id", "main"), f"{report.start:.3f}", f"{report.stop:.3f}",
                      report.outcome, report.when, report.nodeid])
    with open(Path(where) / f"{_phase_name()}.tsv", "a", encoding="utf-8") as f:
        f.write(line + "\n")
