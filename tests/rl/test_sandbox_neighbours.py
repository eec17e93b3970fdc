"""Issue 28, class "neighbours": one sample cannot starve another. Each sample has a uid of its
own (RLIMIT_NPROC counts per uid: every sample was `nobody`) and, where a cgroup can be made
(root here and in CI), one memory and one process limit for its whole tree."""

import pytest

from hpcrl.rewards import cgroups, sandbox

LEVEL = sandbox.isolation()
pytestmark = pytest.mark.skipif(LEVEL != "namespaces", reason=f"per-sample uids and cgroups need root; here: {LEVEL}")

# holds every process its limit allows, for longer than its neighbour runs
HOG = ("import os, time\n"
       "for _ in range(64):\n"
       "    try:\n"
       "        if os.fork() == 0:\n"
       "            time.sleep(8)\n"
       "            os._exit(0)\n"
       "    except OSError:\n"
       "        break\n"
       "time.sleep(8)\n"
       "def f():\n    return 0\n")
# a correct program that forks once, after its neighbour has had time to fill its limit
FORKER = ("import os, time\n"
          "def f():\n"
          "    time.sleep(1.5)\n"
          "    pid = os.fork()\n"
          "    if pid == 0:\n"
          "        os._exit(0)\n"
          "    os.waitpid(pid, 0)\n"
          "    return 1\n")


def test_a_neighbour_holding_its_processes_cannot_fail_a_correct_fork():
    limits = sandbox.Limits(timeout_s=6.0, cpu_s=3)
    hog, good = sandbox.run_batch([(HOG, ["assert f() == 1"]), (FORKER, ["assert f() == 1"])], limits, workers=2,
                                  dedupe=False)
    assert hog.score == 0.0 and good.score == 1.0, (hog, good)


@pytest.mark.skipif(not cgroups.parents(), reason="no cgroup can be made here: memory is limited per process only")
def test_memory_is_bounded_across_a_samples_children():
    # four children each holding 150 MB (written, so resident) under a 256 MB limit: only one
    # may hold it at a time (the rest are OOM-killed, or the sample dies)
    code = ("import os, select\n"
            "def f():\n"
            "    r, w = os.pipe()\n"
            "    for _ in range(4):\n"
            "        if os.fork() == 0:\n"
            "            x = b'x' * (150 << 20)\n"
            "            os.write(w, b'1')\n"
            "            select.select([], [], [], 10)\n"
            "            os._exit(0)\n"
            "    os.close(w)\n"
            "    got = b''\n"
            "    while len(got) < 4:\n"
            "        chunk = os.read(r, 4)\n"
            "        if not chunk:\n"
            "            break\n"
            "        got += chunk\n"
            "    return len(got)\n")
    res = sandbox.run_tests(code, ["assert f() >= 3"], sandbox.Limits(timeout_s=20.0, cpu_s=10, memory_mb=256))
    assert res.score == 0.0, res
    honest = sandbox.run_tests(code.replace("150 << 20", "20 << 20"), ["assert f() == 4"],
                               sandbox.Limits(timeout_s=20.0, cpu_s=10, memory_mb=256))
    assert honest.score == 1.0, honest
