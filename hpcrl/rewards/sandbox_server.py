"""The sandbox's fork server loop. Not imported: sandbox.py reads this file and execs it in the
harness's globals (sandbox_harness.py), whose main(), libc() and `os` (posix) it uses."""
# ruff: noqa: F821  (os, libc, main come from the harness's globals)
import socket, select, signal, struct, time, io, resource, _json  # the samples' imports, done once

def serve(fd):
    # No PDEATHSIG here: it fires when the *thread* that started the server exits (a run_batch
    # pool thread), not the trainer. The server leaves on EOF of its socket instead, which
    # comes when the trainer is gone (its end is close-on-exec, never inherited by its spawns).
    for name in ("prctl", "unshare", "mount", "syscall", "umount2", "chroot"):
        libc(name)
    warm_compiler()  # every sample's processes inherit the compiler's types built
    me = os.getpid()
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    kids = {}  # pid -> deadline
    while True:
        wait = max(0.0, min(kids.values()) - time.monotonic()) if kids else None
        ready, _, _ = select.select([sock, wake_r], [], [], wait)
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        for pid, deadline in list(kids.items()):
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                del kids[pid]
                continue
            if info is None and time.monotonic() < deadline:
                continue
            try:  # before the reap: the pid (and so the group) cannot have been reused yet
                os.killpg(pid, 9)
            except OSError:
                pass
            if info is None:
                kids[pid] = time.monotonic() + 1.0  # reaped when it has gone
            else:
                os.waitpid(pid, 0)
                del kids[pid]
        if sock not in ready:
            continue
        try:
            msg, anc, _, _ = sock.recvmsg(64, socket.CMSG_SPACE(2 * 4))
        except InterruptedError:
            continue
        if not msg:
            os._exit(0)  # the trainer closed its end
        fds = []
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += struct.unpack("%di" % (len(data) // 4), data[:len(data) - len(data) % 4])
        if len(fds) != 2 or len(msg) != 8:
            for f in fds:
                os.close(f)
            continue
        timeout = struct.unpack("d", msg)[0]
        pid = os.fork()
        if pid == 0:
            try:
                child(me, fds[0], fds[1])
            finally:
                os._exit(0)
        for f in fds:
            os.close(f)
        kids[pid] = time.monotonic() + timeout

def child(server, src, out):
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    libc("prctl")(1, 9)  # dies with the server, and its pid 1 with it
    if os.getppid() != server:
        os._exit(0)
    os.setsid()  # its own session: the server's killpg reaches it and nothing else
    lo, hi = sorted((src, out))
    os.closerange(3, lo)
    os.closerange(lo + 1, hi)
    os.closerange(hi + 1, 1 << 16)
    main(src, out)
