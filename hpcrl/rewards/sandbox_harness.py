"""The sandbox's harness: runs as the sample's pid 1 (and its worker), in a `python -I -S` with
nothing of hpcrl. Not imported: sandbox.py reads this file and compiles it (marshal to a spawned
interpreter, or the fork server's globals), so keep it stdlib-only and self-contained. It never
sees an expected value: it sends the program's values back as data (data(), document())."""
# posix, not os: os's module body costs ~1 ms per sample, and these are its functions anyway
import posix as os, sys, marshal
def main(src=None, out=None):
    if src is None:  # spawned: the payload follows the harness on stdin (read unbuffered, see BOOT)
        src, out = os.dup(0), os.dup(1)
    take = frames(src)
    head = marshal.loads(take())  # the program's part: its code and the limits, no test
    nul = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(nul, fd)
    os.close(nul)  # each process below holds 0-2 (/dev/null) and its own pipes, nothing else
    lim = head["limits"]
    head["uid"] = UID_BASE + os.getpid()  # plain as root: a uid of its own too (namespaces: set below)
    if head["unshare"]:
        enter_namespaces(out, head)
    head["tester_uid"] = head["uid"] + TESTER_UIDS
    if head["ns"]:
        private_mounts(head, lim)
    libc("prctl")(4, 0)  # PR_SET_DUMPABLE 0: pid 1 holds the tests; the program may not read it
    # no_new_privs and the seccomp filter, here once, before the first fork: every process of the
    # sample inherits them (a filter costs ~0.5 ms to build and load, in each process it was)
    lockdown()
    warm_compiler()
    if head["mode"] == "time":  # CPU seconds of programs run one after another (the speed reward)
        sent = marshal.loads(take())
        os.close(src)
        time_programs(head, lim, sent, out)
    if head["mode"] != "serve":  # one process: the program runs the steps itself (values, inside)
        steps_sent = marshal.loads(take())
        os.close(src)
        import _json  # before any uid changes: plain as root, the interpreter's prefix may be /root's
        r, w = os.pipe()
        pid = fork_child(lambda: steps(head, lim, steps_sent, w), (r, out))
        os.close(w)
        finish(head, out, r, pid, None)
    # the program first, before the tests are read: its memory never held one
    to_prog_r, to_prog_w = os.pipe()
    from_prog_r, from_prog_w = os.pipe()
    prog = fork_child(lambda: serve_program(head, lim, to_prog_r, from_prog_w), (to_prog_w, from_prog_r, out, src))
    os.close(to_prog_r)
    os.close(from_prog_w)
    tests = marshal.loads(take())
    os.close(src)
    import _json  # before any uid changes: plain as root, the interpreter's prefix may be /root's
    r, w = os.pipe()
    tester = fork_child(lambda: run_tests(head, lim, tests, to_prog_w, from_prog_r, w), (r, out))
    for fd in (w, to_prog_w, from_prog_r):
        os.close(fd)
    finish(head, out, r, tester, prog)

def warm_compiler():
    # a process's first compile() builds the compiler's AST types, ~1.6 ms; done here (and once in
    # the fork server), the program's and the test's processes inherit them built
    compile("pass", "warm", "exec", dont_inherit=True)

def fork_child(body, close):
    pid = os.fork()
    if pid == 0:
        for fd in close:
            os.close(fd)
        try:
            body()
        finally:
            os._exit(0)
    return pid

def finish(head, out, r, pid, prog):
    chunks, size, chunk = [], 0, b"x"
    while chunk and size < head["cap"]:
        chunk = os.read(r, 1 << 16)
        chunks.append(chunk)
        size += len(chunk)
    data = b"".join(chunks)[:head["cap"]]
    _, status = os.waitpid(pid, 0)
    if not data and os.WIFSIGNALED(status):  # the trainer scores it: CPU limit (SIGXCPU, SIGKILL) a timeout
        data = b'{"died": %d}' % os.WTERMSIG(status)
    if prog is not None and b'"gone"' in data:
        # the program ended before the tests were done: its pipes closed as it exited, so it is
        # reaped here (a program that closed them and spins on is killed at the deadline); a
        # CPU limit is a timeout
        _, status = os.waitpid(prog, 0)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (9, 24):
            data = data.replace(b'"gone"', b'"timeout"')
    # one line (the JSON has no raw newline): values or verdicts, nothing more
    data = head["nonce"].encode() + b" " + data.split(b"\n")[0] + b"\n"
    while data:
        data = data[os.write(out, data):]
    os._exit(0)  # everything went out through os.write: skip ~2 ms of interpreter teardown

def frames(src):
    """The payload's parts, one at a time: 8 bytes of length, then that much marshal."""
    def take():
        return readn(src, int.from_bytes(readn(src, 8), "little"))
    return take

def send(fd, blob):
    blob = len(blob).to_bytes(8, "little") + blob
    while blob:
        blob = blob[os.write(fd, blob):]

def recv(fd, cap):
    """One message, or None at EOF; ValueError for one longer than cap (not read)."""
    head = readn(fd, 8)
    if len(head) < 8:
        return None
    n = int.from_bytes(head, "little")
    if n > cap:
        raise ValueError("a reply of %d bytes is over the limit of %d" % (n, cap))
    body = readn(fd, n)
    return body if len(body) == n else None

def readn(fd, n):
    got = []
    while n > 0:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            break
        got.append(chunk)
        n -= len(chunk)
    return b"".join(got)

def isdir(d):
    try:
        return os.stat(d).st_mode & 0o170000 == 0o040000
    except OSError:
        return False

_libc = {}

def libc(name):
    if name not in _libc:
        _libc[name] = _make_libc(name)
    return _libc[name]

def _make_libc(name):
    # libc through _ctypes itself: the ctypes package costs ~3 ms of imports per sample, a
    # third of a bare interpreter start; these few lines are all of it that is needed here
    import _ctypes
    class Int(_ctypes._SimpleCData):
        _type_ = "i"
    class Fn(_ctypes.CFuncPtr):
        _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
        _restype_ = Int
    class Libc:
        _handle = _ctypes.dlopen(None, os.RTLD_NOW)
    fn = Fn((name, Libc))
    def call(*args, what=name):
        if fn(*args) == -1:
            raise OSError(_ctypes.get_errno(), what)
    return call

def mount(src, dst, kind, flags, data):
    libc("mount")(src and src.encode(), dst.encode(), kind and kind.encode(), flags, data and data.encode(), what="mount " + dst)

def enter_namespaces(out, p):
    # what `unshare --mount --net --pid --fork --kill-child --mount-proc --ipc --uts` did, without
    # exec'ing it first (~1.5 ms a sample): new mount, network, pid, ipc and uts namespaces, then a
    # fork, as only a child enters the new pid namespace. This process stays outside and waits;
    # the child (pid 1 inside) returns and runs the sample. Both are in the trainer's process
    # group for the sample, which kills them together; pid 1 also dies with this process
    # (PDEATHSIG), and the kernel kills everything in the namespace when pid 1 dies.
    for procs in p.get("cgroups", ()):  # the sample's memory and process limits, for its whole tree
        fd = os.open(procs, os.O_WRONLY)
        os.write(fd, b"0")  # this process, one thread (cgroups.make: why not by pid)
        os.close(fd)
    # a uid of its own (issue 28, neighbours): RLIMIT_NPROC counts per uid, and this host pid is
    # unique while the sample lives (this process waits for it), so no two samples share one
    p["uid"] = UID_BASE + os.getpid()
    uid, gid = os.geteuid(), os.getegid()
    # as a user: a user namespace too (CLONE_NEWUSER, made first by the kernel and owning the
    # others), this user mapped to its root, as util-linux's `unshare --user --map-root-user`
    libc("unshare")(0x00020000 | 0x40000000 | 0x20000000 | 0x08000000 | 0x04000000
                    | (0x10000000 if p.get("userns") else 0))
    if p.get("userns"):
        for name, text in (("setgroups", b"deny"), ("uid_map", b"0 %d 1" % uid), ("gid_map", b"0 %d 1" % gid)):
            fd = os.open("/proc/self/" + name, os.O_WRONLY)
            os.write(fd, text)
            os.close(fd)
    pid = os.fork()
    if pid:
        os.close(out)
        os.waitpid(pid, 0)
        os._exit(0)
    libc("prctl")(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    mount("none", "/", None, 16384 | 262144, None)  # MS_REC | MS_PRIVATE: nothing leaks back out
    # (its /proc is mounted in the sample's own root: private_mounts)

UID_BASE = 1 << 30  # + the sample's host pid (<= 4194304): far above any real user's uid
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217, "riscv64": 41}

def private_mounts(p, lim):
    # The sample's whole file system (issue 28, files): a small tmpfs root holding the interpreter's
    # prefix and /usr read-only (stdlib, libraries, /usr/bin), a few device nodes, its own /proc,
    # a scratch /tmp (tmpfs); then pivot_root into it and detach the old root. Nothing of the
    # checkout, data, run dir, $HOME or /run is in the view, and nothing it writes is on disk.
    root = "/tmp"
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for d in ("usr", "dev", "proc", "tmp", "etc"):
        os.mkdir(root + "/" + d, 0o755)
    bind_ro("/usr", root + "/usr")
    for d in ("/bin", "/lib", "/lib64", "/sbin", "/lib32", "/libx32"):
        try:
            os.symlink(os.readlink(d), root + d)  # usr-merged: bin -> usr/bin
        except OSError:
            if isdir(d):
                os.mkdir(root + d, 0o755)
                bind_ro(d, root + d)
    prefix = p["prefix"]
    if not (prefix + "/").startswith("/usr/"):  # e.g. /root/.pyenv/versions/3.11.7 (dirs made here: 0755)
        makedirs(root + prefix)
        bind_ro(prefix, root + prefix)
    site = "%s/lib/python%d.%d/site-packages" % (prefix, sys.version_info[0], sys.version_info[1])
    if isdir(root + site):  # the interpreter's packages are not the standard library
        mount("tmpfs", root + site, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
    for n in ("null", "zero", "urandom"):
        os.close(os.open(root + "/dev/" + n, os.O_CREAT | os.O_WRONLY, 0o666))
        bind_mount("/dev/" + n, root + "/dev/" + n, MS_NOEXEC)
    for n, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                      ("stderr", "/proc/self/fd/2")):
        os.symlink(target, root + "/dev/" + n)
    os.mkdir(root + "/dev/shm", 0o755)
    scratch = "size=%dm,mode=1777" % lim["tmp_mb"]
    mount("tmpfs", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, scratch)
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, scratch)
    try:  # this pid namespace's processes only
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    except OSError:
        bind_mount("/proc", root + "/proc", MS_NODEV | MS_NOEXEC)
    os.chdir(root)
    try:
        libc("syscall")(PIVOT_ROOT[os.uname().machine], b".", b".", what="pivot_root")
        libc("umount2")(b".", 2, what="umount old root")  # MNT_DETACH: the old root, stacked under
    except (OSError, KeyError):
        libc("chroot")(b".", what="chroot")  # the worker drops every capability: it cannot leave
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    work = "/tmp/work"
    os.mkdir(work, 0o700)
    if p["drop"]:
        os.chown(work, p["uid"], p["uid"])
    p["work"] = work

def makedirs(path):
    part = ""
    for name in path.strip("/").split("/"):
        part += "/" + name
        if not isdir(part):
            os.mkdir(part, 0o755)

def bind_ro(src, dst):
    bind_mount(src, dst, MS_RDONLY)

def bind_mount(src, dst, flags):
    mount(src, dst, None, MS_BIND | MS_REC, None)
    # a bind takes flags only from a remount. nosuid on every one (issue 40, class 6): a setuid
    # or file-capability binary in /usr runs with the sample's own ids (no_new_privs too, in
    # lockdown()). In a user namespace the mount's own nosuid, nodev, noexec are locked and must
    # be kept (statvfs's ST_ flags have the MS_ values for these). Mounts below dst keep their own.
    keep = os.statvfs(dst).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_NOSUID | flags | keep, None)

TESTER_UIDS = 1 << 23  # the test interpreter's uid: above every program's (UID_BASE + a pid < 2^22)

class Full(BaseException):
    pass

def Capped(cap):
    import io
    class Capped(io.StringIO):
        def write(self, s):
            if self.tell() + len(s) > cap:
                raise Full("output limit")
            return super().write(s)
    return Capped()

def confine(p, lim, uid, home=None):
    """This process as the sample's: its own session, its own uid (as root), the rlimits, the
    work dir, an empty environment. The kernel's doors a sample has no use for were closed by
    pid 1 before it forked this process (lockdown(), sandbox_seccomp.py: inherited)."""
    import resource
    os.setsid()
    if p["drop"]:
        if not p["ns"]:  # plain as root: the trainer's temp dir becomes the sample's
            os.chown(p["work"], p["uid"], p["uid"])
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    mb = 1024 * 1024
    for name, value in (("RLIMIT_CPU", lim["cpu_s"]), ("RLIMIT_AS", lim["memory_mb"] * mb),
                        ("RLIMIT_FSIZE", lim["file_mb"] * mb), ("RLIMIT_NOFILE", lim["open_files"]),
                        ("RLIMIT_NPROC", lim["processes"]), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    home = home or p["work"]  # the test interpreter's: "/", where it writes nothing
    os.chdir(home)
    # both the C environment (what a child process inherits) and posix.environ (what the
    # program's `import os` builds os.environ from)
    for k in list(os.environ):
        os.unsetenv(k)
    os.environ.clear()
    for k, v in (("HOME", home), ("TMPDIR", home), ("PATH", "/usr/bin:/bin"), ("LANG", "C.UTF-8")):
        os.putenv(k, v)
        os.environ[k.encode()] = v.encode()
    # forked from the server, os is already imported: its environ wraps posix.environ, the dict
    # just rewritten; should it ever hold a copy instead, make it agree
    full_os = sys.modules.get("os")
    if full_os is not None and getattr(full_os.environ, "_data", os.environ) is not os.environ:
        full_os.environ._data.clear()
        full_os.environ._data.update(os.environ)

def time_programs(head, lim, sent, out):
    """Each program in turn, `repeats` rounds interleaved (a, b, c, a, b, c, ...) so that a burst
    of the machine's load falls on all alike, each in a fresh process that runs the program as a
    module and then the statement, and exits. Its CPU seconds are read here, from outside, by
    wait4 (user + system, the kernel's own accounting): nothing the program says is a time. It
    may start no process or thread (RLIMIT_NPROC 1: one uncounted would do the work off the
    books); its load time is in its figure, so work moved to import time is counted too."""
    import resource  # noqa: F401  (wait4's rusage)
    lim = dict(lim, processes=1)
    times = {name: [] for name, _, _ in sent["programs"]}
    errors = {}
    for _ in range(sent["repeats"]):
        for name, code, stmt in sent["programs"]:
            if name in errors:
                continue
            pid = fork_child(lambda: run_timed(head, lim, code, stmt), (out,))
            _, status, usage = os.wait4(pid, 0)
            if os.WIFSIGNALED(status):
                errors[name] = "timeout" if os.WTERMSIG(status) in (9, 24) else "crash"
            elif os.WEXITSTATUS(status) != 0:
                errors[name] = "error"
            else:
                times[name].append(usage.ru_utime + usage.ru_stime)
    text = '{"cpu":{%s},"errors":{%s}}' % (
        ",".join("%s:[%s]" % (quote(n), ",".join(repr(float(t)) for t in ts)) for n, ts in times.items()),
        ",".join("%s:%s" % (quote(n), quote(e)) for n, e in errors.items()))
    data = head["nonce"].encode() + b" " + text.encode() + b"\n"
    while data:
        data = data[os.write(out, data):]
    os._exit(0)

def run_timed(p, lim, code, stmt):
    confine(dict(p), lim, p["uid"])
    import sys
    sys.stdout = sys.stderr = Capped(lim["output_kb"] * 1024)
    try:
        ns = {"__name__": "solution"}
        exec(compile(code, "solution.py", "exec", dont_inherit=True), ns)
        exec(compile(stmt, "bench", "exec", dont_inherit=True), ns)
    except BaseException:
        os._exit(1)
    os._exit(0)

def steps(p, lim, tests, w):
    """The program and the given steps in one process: `values` (sandbox.evaluate: expressions
    whose values go back as data) and `inside` (a test that cannot be run from outside the
    program: its own verdict, counted as judged inside)."""
    confine(p, lim, p["uid"])
    code = p["code"]
    p.clear()
    cap = lim["output_kb"] * 1024
    def err(kind, e):
        try:
            return [kind, (type(e).__name__ + ": " + str(e))[:200]]
        except BaseException:
            return [kind, "?"]
    failed, ns = None, {"__name__": "solution"}
    sys.stdout = sys.stderr = Capped(cap)
    try:
        exec(compile(code, "solution.py", "exec", dont_inherit=True), ns)
    except Full as e:
        failed = err("output_limit", e)
    except BaseException as e:
        failed = err("error", e)
    entries = []
    for t in tests:
        entry = {"values": []}
        if failed is not None:
            entry["error"] = failed
        else:
            sys.stdout = sys.stderr = Capped(cap)
            try:
                for kind, src in t:
                    if kind == "exec":
                        exec(src, ns)
                    else:
                        entry["values"].append(data(eval(src, ns)))
            except Full as e:
                entry["error"] = err("output_limit", e)
            except NotData as e:
                entry["error"] = err("not_data", e)
            except AssertionError as e:
                entry["error"] = err("wrong_answer", e)
            except BaseException as e:
                entry["error"] = err("error", e)
        entries.append(entry)
    try:
        blob = document(entries).encode()
    except BaseException:  # e.g. the program replaced what document() uses: the trainer scores a crash
        blob = b""
    while blob:
        blob = blob[os.write(w, blob):]

class NotData(Exception):
    pass

def data(v, depth=0):
    """A test's value as JSON text (see decode() on the trainer's side), written here rather than
    by the json package, whose import (it loads re) costs a spawned sample more than the rest of
    the harness. Built-in types only; a subclass goes as its built-in content, read through the
    base type so overridden methods do not run: an int subclass whose __eq__ lies is sent as the
    int it holds."""
    if depth > 100:
        raise NotData("nested deeper than 100")
    d = depth + 1
    if v is None:
        return "null"
    if v is True or v is False:
        return "true" if v else "false"
    if isinstance(v, int):
        v = int.__index__(v)
        # decimal ints are limited to 4300 digits (int_max_str_digits); hex is exempt
        return str(v) if -(1 << 10000) < v < (1 << 10000) else '{"x":"%s"}' % hex(v)
    if isinstance(v, float):
        return _float(float.__float__(v))
    if isinstance(v, str):
        return quote(str.__str__(v))
    if isinstance(v, list):
        return "[" + ",".join([data(x, d) for x in list.__iter__(v)]) + "]"
    if isinstance(v, tuple):
        return '{"t":[' + ",".join([data(x, d) for x in tuple.__iter__(v)]) + "]}"
    if isinstance(v, dict):
        return '{"d":[' + ",".join(["[%s,%s]" % (data(k, d), data(x, d)) for k, x in dict.items(v)]) + "]}"
    if isinstance(v, (set, frozenset)):
        items = set.__iter__(v) if isinstance(v, set) else frozenset.__iter__(v)
        return '{"s":[' + ",".join([data(x, d) for x in items]) + "]}"
    if isinstance(v, (bytes, bytearray)):
        return '{"b":%s}' % quote(bytes(memoryview(v)).decode("latin-1"))
    if isinstance(v, complex):
        return '{"c":[%s,%s]}' % (_float(complex.real.__get__(v)), _float(complex.imag.__get__(v)))
    raise NotData("a test's value must be data (None, bool, int, float, str, bytes, list, tuple, dict, set), not " + type(v).__name__[:60])

def _float(f):
    r = float.__repr__(f)
    return {"inf": "Infinity", "-inf": "-Infinity", "nan": "NaN"}.get(r, r)

def quote(s):
    import _json  # C, no imports of its own
    return _json.encode_basestring_ascii(s)

def document(entries):
    """The worker's one line: {"tests": [{"values": [...], "error": [kind, text], "stdout": text}]}."""
    out = []
    for e in entries:
        parts = []
        if "values" in e:
            parts.append('"values":[' + ",".join(e["values"]) + "]")
        if "error" in e:
            parts.append('"error":[%s,%s]' % (quote(e["error"][0]), quote(e["error"][1])))
        if "stdout" in e:
            parts.append('"stdout":' + quote(e["stdout"]))
        out.append("{" + ",".join(parts) + "}")
    return '{"tests":[' + ",".join(out) + "]}"

