"""The sample's kernel lockdown (issue 40, classes 4 and 6): no_new_privs, and a seccomp filter
that fails with EPERM the system calls through which one sample could leave answers for another
(the key store, inotify and fanotify, exact page-cache probes) or reach the kernel's rarer
surfaces, none of which a program judged on its values needs.

Not imported by the trainer: sandbox.py joins this source to the harness's (sandbox.HARNESS, one
code object; main() runs after every part is defined), and the harness's pid 1 calls lockdown()
once its mounts are made, before its first fork: every process of the sample inherits the filter. Stdlib only (it runs in `python -I -S`); lockdown() calls
the harness's libc(), the filter's tables need nothing (scripts/bench_field_sandboxes.py imports
them for bwrap's --seccomp); its names start with _ but lockdown, as they share the harness's globals. A failure raises: a sample that cannot
be locked down does not run."""
import posix as _posix, sys as _sys

# name: (x86_64, the generic table of aarch64); None where an architecture has no such call
_DENIED = {
    # what one sample could leave for the next: keys outlive the sample's uid and cgroup and are
    # listed in /proc/keys; a watch sees a concurrent sample's files appear (issue 40, class 4)
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219),
    "inotify_init": (253, None), "inotify_init1": (294, 26), "inotify_add_watch": (254, 27),
    "fanotify_init": (300, 262), "fanotify_mark": (301, 263),
    # the page cache's exact state of a shared file (its timing stays: docs/adapt.md)
    "cachestat": (451, 451),
    # io_uring runs reads and opens outside this filter's view (its nowait reads probe the cache)
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    # the kernel's rarer surfaces: debugging, profiling and BPF, other processes' memory
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "perf_event_open": (298, 241), "bpf": (321, 280), "userfaultfd": (323, 282),
    "lookup_dcookie": (212, 18), "syslog": (103, 116), "name_to_handle_at": (303, 264),
    "open_by_handle_at": (304, 265), "iopl": (172, None), "ioperm": (173, None),
    # leaving the sample's namespaces and root, or changing the system (root's calls, so a
    # capability gained some other way still cannot reach them)
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "unshare": (272, 97), "setns": (308, 268), "open_tree": (428, 428), "move_mount": (429, 429),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442), "kexec_load": (246, 104), "kexec_file_load": (320, 294),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "swapon": (167, 224), "swapoff": (168, 225), "reboot": (169, 142), "acct": (163, 89),
    "quotactl": (179, 60), "quotactl_fd": (443, 443),
}
# preadv2(fd, iov, n, pos_l, pos_h, flags) with RWF_NOWAIT reads only what the page cache holds:
# EAGAIN says a shared file's page is cold. Plain reads and preadv2 without it go through.
_PREADV2 = (327, 286)
_RWF_NOWAIT = 8
# AUDIT_ARCH_*: a call made through another ABI (i386's int 0x80 or x32 on x86_64, arm32 on
# aarch64) has other numbers, so every call there fails
_ARCHES = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}
_X32_BIT = 0x40000000
_RET_ALLOW, _RET_EPERM = 0x7FFF0000, 0x00050000 | 1
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|*|K, BPF_RET|K


def _seccomp_program(machine):
    """The filter's instructions [(code, jt, jf, k)] for `machine`, or None where it has no table."""
    if machine not in _ARCHES:
        return None
    col, arch = _ARCHES[machine]
    denied = sorted({nrs[col] for nrs in _DENIED.values() if nrs[col] is not None})
    head = [(_LD_ABS, 0, 0, 4), (_JEQ, 1, 0, arch), (_RET, 0, 0, _RET_EPERM), (_LD_ABS, 0, 0, 0)]
    if machine == "x86_64":
        head.append((_JGE, 0, 1, _X32_BIT))
        head.append((_RET, 0, 0, _RET_EPERM))
    # each denied number jumps to the EPERM at the end; preadv2 to its flags check
    n = len(denied)
    body = [(_JEQ, n - i + 3, 0, nr) for i, nr in enumerate(denied)]
    body.append((_JEQ, 0, 2, _PREADV2[col]))
    body += [(_LD_ABS, 0, 0, 16 + 8 * 5), (_JSET, 1, 0, _RWF_NOWAIT)]  # args[5], low 32 bits (LE)
    return head + body + [(_RET, 0, 0, _RET_ALLOW), (_RET, 0, 0, _RET_EPERM)]


def _prctl(*args):
    # the harness's libc() (this source is joined to sandbox_harness.py's): prctl through _ctypes
    libc("prctl")(*args, what="prctl%r" % (args[:1],))


def _buffer(blob):
    import _ctypes

    class Char(_ctypes._SimpleCData):
        _type_ = "c"

    class Buf(_ctypes.Array):
        _type_, _length_ = Char, len(blob)

    buf = Buf.from_buffer_copy(blob)
    return buf, _ctypes.addressof(buf)


def lockdown(machine=None):
    """no_new_privs (a setuid or file-capability binary runs with the caller's privileges), then
    the filter, inherited by every child and kept across exec. True if the filter is in place;
    False on an architecture without a table here (no_new_privs only)."""
    _prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: also what lets a non-root process add a filter
    program = _seccomp_program(machine or _posix.uname().machine)
    if program is None:
        return False
    order = _sys.byteorder
    blob = b"".join(c.to_bytes(2, order) + bytes((jt, jf)) + k.to_bytes(4, order) for c, jt, jf, k in program)
    filt, addr = _buffer(blob)  # held until the prctl returns: the kernel copies the program
    # struct sock_fprog {unsigned short len; struct sock_filter *filter;}: the pointer is 8-aligned
    fprog = len(program).to_bytes(2, order) + bytes(6) + addr.to_bytes(8, order)
    _prctl(22, 2, fprog, 0, 0)  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER (a bytes argument goes as char *)
    return filt is not None
