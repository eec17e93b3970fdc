"""Issue 40, classes 4 and 6: what one sample leaves in the kernel for another, and setuid
binaries. The kernel's key store (keys outlive the sample's uid and cgroup, listed in /proc/keys)
and inotify (a watch on the shared read-only /usr sees a concurrent sample's opens) carried answers
between samples; setuid binaries kept their power inside the sample. Each channel test first runs
the call on this host, outside any sandbox: where the host itself blocks it, there is nothing for
the sandbox to close, and the test says so in its skip."""

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from hpcrl.rewards import sandbox

LEVEL = sandbox.isolation()
MACHINE = os.uname().machine
FILTERED = pytest.mark.skipif(MACHINE not in ("x86_64", "aarch64"),
                              reason=f"the seccomp filter has syscall tables for x86_64 and aarch64, not {MACHINE}")
NR = {"x86_64": {"add_key": 248, "keyctl": 250, "inotify_init1": 294, "inotify_add_watch": 254, "cachestat": 451},
      "aarch64": {"add_key": 217, "keyctl": 219, "inotify_init1": 26, "inotify_add_watch": 27, "cachestat": 451}}.get(MACHINE, {})


def host_blocks(snippet: str):
    """None if `snippet` (which prints the call's result, then its errno) succeeds on this host
    outside any sandbox, else why not: the host's own filter, an old kernel, ..."""
    out = subprocess.run([sys.executable, "-c", "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n" + snippet],
                         capture_output=True, text=True, timeout=60)
    result, _, errno = out.stdout.strip().partition(" ")
    if out.returncode != 0 or not result.lstrip("-").isdigit():
        return f"the probe failed on the host: {out.stderr[-300:]}"
    return None if int(result) >= 0 else f"the host itself blocks it: {os.strerror(int(errno or 0))}"


def skip_if_host_blocks(what: str, snippet: str) -> None:
    why = host_blocks(snippet)
    if why is not None:
        pytest.skip(f"{what}: {why}; nothing for the sandbox to close here")


# the key store: a key in the user keyring, every permission for everyone (KEYCTL_SETPERM)
PLANT = ("import ctypes\n"
         "def plant(tag, answer):\n"
         "    libc = ctypes.CDLL(None, use_errno=True)\n"
         f"    key = libc.syscall({NR.get('add_key')}, b'user', ('%s=%d' % (tag, answer)).encode(), b'x', 1, -4)\n"
         "    if key < 0:\n"
         "        return -ctypes.get_errno()\n"
         f"    libc.syscall({NR.get('keyctl')}, 5, key, 0x3f3f3f3f)\n"
         "    return key\n"
         "def planted(tag):\n"
         "    try:\n"
         "        lines = open('/proc/keys').read().splitlines()\n"
         "    except OSError:\n"
         "        return -1\n"
         "    for line in lines:\n"
         "        if (tag + '=') in line:\n"
         "            return int(line.split(tag + '=')[1].split(':')[0])\n"
         "    return -1\n")


@FILTERED
def test_a_sample_cannot_add_a_key_or_see_one_in_proc_keys():
    skip_if_host_blocks("add_key", f"r = libc.syscall({NR['add_key']}, b'user', b'hpcrl-probe', b'x', 1, -2)\n"
                                   "print(r, ctypes.get_errno())")  # -2: this process's keyring, gone with it
    tag = "hpcrl-" + uuid.uuid4().hex[:12]
    got = sandbox.evaluate(PLANT, [f"plant({tag!r}, 42)", f"planted({tag!r})"])
    assert got == [(True, -1), (True, -1)], got  # EPERM, and nothing of it in /proc/keys


@FILTERED
def test_a_key_added_by_one_sample_does_not_answer_the_next():
    # the honest sample computes 42 and leaves it in the key store; the next sample of the same
    # prompt returns what it finds there. Keys outlived the first sample's uid and cgroup.
    skip_if_host_blocks("add_key", f"r = libc.syscall({NR['add_key']}, b'user', b'hpcrl-probe', b'x', 1, -2)\n"
                                   "print(r, ctypes.get_errno())")
    tag = "hpcrl-" + uuid.uuid4().hex[:12]
    honest = PLANT + f"def f(x):\n    plant({tag!r}, x * 7)\n    return x * 7\n"
    copier = PLANT + f"def f(x):\n    return planted({tag!r})\n"
    first = sandbox.run_tests(honest, ["assert f(6) == 42"])
    second = sandbox.run_tests(copier, ["assert f(6) == 42"])
    assert first.score == 1.0, first
    assert second.score == 0.0, second


# inotify: the sender opens one file of /usr/bin over and over (which one is its answer); the
# watcher, in the same batch, watches /usr/bin (the same inodes in every sample's root) for opens
WATCH = ("import ctypes, os, select, struct, time\n"
         "def f():\n"
         "    names = sorted(os.listdir('/usr/bin'))\n"
         "    libc = ctypes.CDLL(None, use_errno=True)\n"
         f"    fd = libc.syscall({NR.get('inotify_init1')}, os.O_NONBLOCK)\n"
         "    if fd < 0:\n"
         "        return -1\n"
         f"    if libc.syscall({NR.get('inotify_add_watch')}, fd, b'/usr/bin', 0x20) < 0:\n"
         "        return -1\n"
         "    seen, end = {}, time.monotonic() + 8\n"
         "    while time.monotonic() < end and max(seen.values(), default=0) < 50:\n"
         "        select.select([fd], [], [], 0.5)\n"
         "        try:\n"
         "            buf = os.read(fd, 1 << 16)\n"
         "        except BlockingIOError:\n"
         "            continue\n"
         "        at = 0\n"
         "        while at < len(buf):\n"
         "            n = struct.unpack_from('iIII', buf, at)[3]\n"
         "            name = buf[at + 16:at + 16 + n].rstrip(b'\\0').decode()\n"
         "            seen[name] = seen.get(name, 0) + 1\n"
         "            at += 16 + n\n"
         "    if not seen:\n"
         "        return -2\n"
         "    return names.index(max(seen, key=seen.get))\n")
SEND = ("import os, time\n"
        "def f():\n"
        "    answer = 6 * 7\n"
        "    path = '/usr/bin/' + sorted(os.listdir('/usr/bin'))[answer]\n"
        "    end = time.monotonic() + 6\n"
        "    while time.monotonic() < end:\n"
        "        os.close(os.open(path, os.O_RDONLY))\n"
        "        time.sleep(0.002)\n"
        "    return answer\n")


@FILTERED
def test_inotify_carries_nothing_between_concurrent_samples_of_a_batch():
    skip_if_host_blocks("inotify_init1", f"print(libc.syscall({NR['inotify_init1']}, 0), ctypes.get_errno())")
    assert len(os.listdir("/usr/bin")) > 42
    limits = sandbox.Limits(timeout_s=15.0, cpu_s=10)
    sender, watcher = sandbox.run_batch([(SEND, ["assert f() == 42"]), (WATCH, ["assert f() == 42"])], limits,
                                        workers=2, dedupe=False)
    assert sender.score == 1.0, sender
    assert watcher.score == 0.0, watcher


@FILTERED
def test_the_page_caches_exact_state_is_not_readable():
    # preadv2(RWF_NOWAIT) reads only what is cached (EAGAIN: a shared file's page is cold), and
    # cachestat() counts a file's cached pages: both said which /usr files another sample read.
    # Plain reads still work; their timing stays a residual channel (docs/adapt.md). Kernels since
    # 6.15 or so refuse cachestat on a file the caller cannot write (6.18 here), as mincore since 5.2.
    if not hasattr(os, "preadv") or not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("this Python has no os.preadv with RWF_NOWAIT")
    skip_if_host_blocks("preadv2(RWF_NOWAIT)", "fd = os.open('/usr/bin/env', os.O_RDONLY)\n"
                                               "os.read(fd, 1)\n"
                                               "print(os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT), 0)")
    code = ("import ctypes, os\n"
            "def probe():\n"
            "    fd = os.open('/usr/bin/env', os.O_RDONLY)\n"
            "    plain = os.preadv(fd, [bytearray(1)], 0, 0)\n"
            "    try:\n"
            "        nowait = os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)\n"
            "    except OSError as e:\n"
            "        nowait = e.strerror\n"
            "    libc = ctypes.CDLL(None, use_errno=True)\n"
            "    rng, stat = (ctypes.c_uint64 * 2)(0, 0), (ctypes.c_uint64 * 8)()\n"
            f"    cs = libc.syscall({NR['cachestat']}, fd, rng, stat, 0)\n"
            "    return [plain, nowait, cs, os.strerror(ctypes.get_errno()) if cs < 0 else '']\n")
    got = sandbox.evaluate(code, ["probe()"])
    assert got == [(True, [1, "Operation not permitted", -1, "Operation not permitted"])], got


# setuid: `mount --help` blocks writing into a pipe filled beforehand, and its /proc status is
# read while it waits there: the ids a setuid-root binary really runs with
EUID_OF = ("import os, subprocess\n"
           "def euid_of(binary):\n"
           "    r, w = os.pipe()\n"
           "    os.set_blocking(w, False)\n"
           "    try:\n"
           "        while True:\n"
           "            os.write(w, b'x' * 512)\n"
           "    except BlockingIOError:\n"
           "        pass\n"
           "    os.set_blocking(w, True)\n"
           "    p = subprocess.Popen([binary, '--help'], stdout=w, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)\n"
           "    os.close(w)\n"
           "    while True:\n"
           "        status = dict(line.split(':', 1) for line in open('/proc/%d/status' % p.pid))\n"
           "        if status['Name'].strip() == os.path.basename(binary) and status['State'].split()[0] == 'S':\n"
           "            break\n"
           "        os.sched_yield()\n"
           "    euid = int(status['Uid'].split()[1])\n"
           "    while os.read(r, 1 << 16):\n"
           "        pass\n"
           "    p.wait()\n"
           "    return euid\n")
SETUID = "/usr/bin/mount"


def _setuid_root(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return bool(st.st_mode & 0o4000) and st.st_uid == 0


@pytest.mark.skipif(not _setuid_root(SETUID), reason=f"{SETUID} is not setuid root here")
def test_a_setuid_binary_runs_with_the_samples_own_ids():
    # outside the sandbox, as a user other than root, the probe sees the binary's euid 0: it can
    # tell a setuid binary's power. Inside, no_new_privs and nosuid binds leave it the sample's.
    script = EUID_OF + f"print(euid_of({SETUID!r}))\n"
    if os.geteuid() == 0:
        if not shutil.which("setpriv") or not os.path.isfile("/usr/bin/python3"):
            pytest.skip("needs util-linux setpriv and /usr/bin/python3 to run the probe as nobody")
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-I", "-c", script]
    else:
        argv = [sys.executable, "-I", "-c", script]
    host = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/")
    if host.stdout.strip() != "0":
        pytest.skip(f"outside the sandbox {SETUID} does not gain euid 0 either: {host.stdout}{host.stderr[-300:]}")
    code = EUID_OF + ("def status():\n"
                      "    return {k: v.strip() for k, v in (line.split(':', 1) for line in open('/proc/self/status'))\n"
                      "            if k in ('NoNewPrivs', 'Seccomp')}\n"
                      "def usr_nosuid():\n"
                      "    return bool(os.statvfs('/usr/bin').f_flag & os.ST_NOSUID)\n")
    got = sandbox.evaluate(code, [f"[euid_of({SETUID!r}), os.geteuid()]", "status()", "usr_nosuid()"],
                           sandbox.Limits(timeout_s=20.0))
    assert all(ok for ok, _ in got), got
    (euid, own), status, nosuid = (v for _, v in got)
    assert euid == own, got  # not 0: nothing above what the sample already has
    assert own != 0 or LEVEL == "userns", got  # userns: root of its own namespace, the user outside
    assert status["NoNewPrivs"] == "1", got
    assert nosuid is (LEVEL != "plain"), got  # plain has no root of its own: no_new_privs alone
    if MACHINE in ("x86_64", "aarch64"):
        assert status["Seccomp"] == "2", got  # a filter
