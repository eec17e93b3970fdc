"""Issue 28, class "privilege": a sample never runs with more privilege than the caller would
give it. Root without CAP_SYS_ADMIN (many containers) cannot make the namespaces level; the
userns level there mapped the sample to uid 0 with every capability, able to write root's files
and the trainer's own code. The level in use is said once per process."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                               reason="needs root and util-linux setpriv to drop CAP_SYS_ADMIN")
REPO = Path(__file__).resolve().parents[2]


def _as_root_without_sys_admin(script: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin",
                           sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


@ROOT_ONLY
def test_root_without_cap_sys_admin_never_runs_a_sample_as_root(tmp_path):
    tmp_path.chmod(0o755)
    target = tmp_path / "trainer-owned.py"
    target.write_text("# the trainer's code\n")
    target.chmod(0o644)
    code = ("import os\n"
            "def f():\n"
            "    try:\n"
            f"        open({str(target)!r}, 'a').write('pwned')\n"
            "    except OSError:\n"
            "        pass\n"
            "    return [os.getuid(), os.geteuid()]\n")
    script = ("import sys\nfrom hpcrl.rewards import sandbox\n"
              "level = sandbox.isolation()\n"
              f"got = sandbox.evaluate({code!r}, ['f()'], level=level)\n"
              "print(level, got)\n")
    out = _as_root_without_sys_admin(script, {"HPCRL_SANDBOX_PLAIN": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    level, _, got = out.stdout.strip().partition(" ")
    assert level != "userns", out.stdout
    assert "pwned" not in target.read_text(), out.stdout
    assert "[0," not in got and "(True" in got, out.stdout


@ROOT_ONLY
def test_plain_refuses_unless_allowed_and_the_level_is_said_once():
    script = ("from hpcrl.rewards import sandbox\n"
              "r = sandbox.run_tests('def f(): return 1', ['assert f() == 1'])\n"
              "sandbox.run_tests('def f(): return 1', ['assert f() == 1'])\n"
              "print(sandbox.isolation(), r.score, r.reason)\n")
    out = _as_root_without_sys_admin(script, {"HPCRL_SANDBOX_PLAIN": "0"})
    assert out.stdout.split() == ["plain", "0.0", "refused"], (out.stdout, out.stderr[-2000:])
    assert out.stderr.count("hpcrl sandbox: isolation level") == 1, out.stderr
    assert "HPCRL_SANDBOX_PLAIN=1" in out.stderr  # says how to allow it
    allowed = _as_root_without_sys_admin(script, {"HPCRL_SANDBOX_PLAIN": "1"})
    assert allowed.stdout.split() == ["plain", "1.0", "ok"], (allowed.stdout, allowed.stderr[-2000:])


@ROOT_ONLY
def test_the_spec_accepts_plain_with_code_allow_plain():
    # the built-in trainer's reward, from its resolved args: refused by default, scored when allowed
    script = ("from hpcrl.rl.config import resolve\n"
              "from hpcrl.rewards import mix as reward_mix\n"
              "ex = [{'data_source': 'code', 'ground_truth': {'tests': ['assert f() == 1']}, 'extra_info': {}, 'messages': []}]\n"
              "for allow in (False, True):\n"
              "    cfg = resolve({'reward': 'code', 'code_allow_plain': allow})\n"
              "    scores, metrics = reward_mix.Reward(cfg)(ex, ['def f(): return 1'])\n"
              "    print(allow, scores[0], sorted(k for k in metrics if k.startswith('reward/reason/')))\n")
    out = _as_root_without_sys_admin(script, {"HPCRL_SANDBOX_PLAIN": "0"})
    assert out.stdout.splitlines() == ["False 0.0 ['reward/reason/refused']", "True 1.0 ['reward/reason/ok']"], \
        (out.stdout, out.stderr[-2000:])


REGULAR = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("runuser") or not Path("/usr/bin/python3").is_file(),
                             reason="needs root to become a regular user (runuser) and a system python3")


@REGULAR
def test_what_a_sample_reaches_as_a_regular_user(tmp_path):
    # Perlmutter's case (a Slurm node, no root): the sandbox's files run by /usr/bin/python3 as
    # uid nobody, next to a file that user owns. The level is userns: the sample's root holds
    # /usr only; the user's files, the network and the host's processes are out of its view.
    import tempfile
    home = Path(tempfile.mkdtemp(prefix="hpcrl-regular-"))
    try:
        home.chmod(0o755)
        for name in ("sandbox", "extract", "cgroups", "cpus", "sandbox_harness", "sandbox_program", "sandbox_tester",
                     "sandbox_server", "sandbox_seccomp"):
            shutil.copy(REPO / "hpcrl" / "rewards" / f"{name}.py", home / f"{name}.py")
        (home / "answers.txt").write_text("1234")
        os.chown(home / "answers.txt", 65534, 65534)
        code = ("import os, socket\n"
                "def top():\n    return sorted(os.listdir('/'))\n"
                f"def mine():\n    return os.path.exists({str(home / 'answers.txt')!r})\n"
                "def procs():\n    return len([p for p in os.listdir('/proc') if p.isdigit()])\n"
                "def net():\n"
                "    try:\n"
                "        socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
                "        return 'reached'\n"
                "    except OSError as e:\n"
                "        return e.strerror\n")
        script = (f"import sys; sys.path.insert(0, {str(home)!r}); import sandbox\n"
                  "level = sandbox.isolation()\n"
                  "served = sandbox._served(level, sys.executable, True)\n"
                  f"print(level, served, sandbox.evaluate({code!r}, ['top()', 'mine()', 'procs()', 'net()', 'os.getuid()']))\n")
        out = subprocess.run(["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-I", "-c", script], cwd=home,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        level, served, got = out.stdout.strip().split(" ", 2)
        # forked from the fork server (the sample makes its own user namespace there), not an exec
        # of util-linux's unshare and an interpreter per sample: ~0.9x a bare spawn, not ~2x
        assert level == "userns" and served == "True", out.stdout
        results = eval(got)  # the test's own printout: a list of (ok, plain value)
        assert all(ok for ok, _ in results), results
        top, mine, procs, net, uid = (v for _, v in results)
        assert set(top) <= {"usr", "bin", "lib", "lib64", "sbin", "dev", "proc", "tmp", "etc"}, top
        assert mine is False and procs <= 3 and net == "Network is unreachable", results
        assert uid == 0  # root of its own user namespace, which is the user outside: no more than they have
    finally:
        shutil.rmtree(home, ignore_errors=True)
