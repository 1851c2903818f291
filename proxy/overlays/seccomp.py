"""A seccomp filter a patch's worker puts on itself before it imports the patch: the
system calls that reach other processes, the kernel's own state or new files fail with
EPERM, whatever Python code asks for them.

The filter is a classic BPF program assembled here (a few dozen instructions): no
compiled binding (pyseccomp and Debian's python3-seccomp both need libseccomp for the
interpreter at hand, and Debian's binds only Debian's own Python), one list read in one
place. It denies by name, and allows the rest: Python itself needs a long and changing
list of calls, and the walls that keep a patch from the proxy's files, processes and
network are bubblewrap's namespaces (``overlays.bwrap``); this filter removes the calls
that could cross or widen them (ptrace, signals, pidfds, mounts, namespaces, exec, new
device nodes and fifos, timestamps, io_uring, which runs calls seccomp never sees).
A call from another ABI (i386 or x32 on x86-64) ends the process.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct

# The system calls, by number on the two architectures the proxy's images are built for
# (x86-64: asm/unistd_64.h; aarch64: asm-generic/unistd.h; "-": the call does not exist
# there). Every one is denied, except clone and clone3, which the program treats apart.
TABLE = """
ptrace               101  117
kill                  62  129
tkill                200  130
tgkill               234  131
rt_sigqueueinfo      129  138
rt_tgsigqueueinfo    297  240
pidfd_open           434  434
pidfd_send_signal    424  424
pidfd_getfd          438  438
process_vm_readv     310  270
process_vm_writev    311  271
mknod                133    -
mknodat              259   33
mount                165   40
umount2              166   39
pivot_root           155   41
chroot               161   51
unshare              272   97
setns                308  268
open_tree            428  428
move_mount           429  429
fsopen               430  430
fsconfig             431  431
fsmount              432  432
fspick               433  433
mount_setattr        442  442
keyctl               250  219
add_key              248  217
request_key          249  218
bpf                  321  280
perf_event_open      298  241
userfaultfd          323  282
socket                41  198
kexec_load           246  104
init_module          175  105
finit_module         313  273
open_by_handle_at    304  265
name_to_handle_at    303  264
fanotify_init        300  262
io_uring_setup       425  425
io_uring_enter       426  426
io_uring_register    427  427
execve                59  221
execveat             322  281
fork                  57    -
vfork                 58    -
utime                132    -
utimes               235    -
futimesat            261    -
utimensat            280   88
clone                 56  220
clone3               435  435
"""
_ROWS = [line.split() for line in TABLE.strip().splitlines()]
_X86_64 = {name: int(x86) for name, x86, _ in _ROWS}
_AARCH64 = {name: int(arm) for name, _, arm in _ROWS if arm != "-"}
DENIED = [name for name, _, _ in _ROWS if name not in ("clone", "clone3")]
ARCHES = {"x86_64": (0xC000003E, _X86_64), "aarch64": (0xC00000B7, _AARCH64)}
# clone()'s flags that make a namespace: refused (a thread's clone passes none of them).
CLONE_NAMESPACES = 0x7E020000
X32_BIT = 0x40000000

_LD_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
ALLOW = 0x7FFF0000
KILL_PROCESS = 0x80000000
ERRNO = 0x00050000
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2


def program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter for this machine, as (code, jt, jf, k) instructions; KeyError when the
    architecture is not one the filter knows."""
    arch, numbers = ARCHES[machine]
    denied = [numbers[name] for name in DENIED if name in numbers]
    # Layout: arch check, nr load, x32 check, one JEQ per denied call, clone's flags
    # check, then ALLOW, EPERM, ENOSYS (clone3: glibc falls back to clone on ENOSYS, whose
    # flags this filter can read), KILL.
    body = 4 + len(denied) + 4
    allow, eperm, enosys, kill = body, body + 1, body + 2, body + 3
    out = [(_LD_ABS, 0, 0, 4), (_JEQ, 0, kill - 2, arch), (_LD_ABS, 0, 0, 0)]
    # x32 calls are x86-64's numbers with a high bit: ended. (aarch64: a jump to the next.)
    out.append((_JGE, kill - 4, 0, X32_BIT) if machine == "x86_64" else (_JEQ, 0, 0, 0))
    for nr in denied:
        out.append((_JEQ, eperm - len(out) - 1, 0, nr))
    out.append((_JEQ, enosys - len(out) - 1, 0, numbers["clone3"]))
    out.append((_JEQ, 0, allow - len(out) - 1, numbers["clone"]))
    out.append((_LD_ABS, 0, 0, 16))  # clone's flags: args[0], low 32 bits (little-endian)
    out.append((_JSET, eperm - len(out) - 1, 0, CLONE_NAMESPACES))
    assert len(out) == body
    out += [(_RET, 0, 0, ALLOW), (_RET, 0, 0, ERRNO | errno.EPERM),
            (_RET, 0, 0, ERRNO | errno.ENOSYS), (_RET, 0, 0, KILL_PROCESS)]
    _check(out)
    return out


def _check(out: list[tuple[int, int, int, int]]) -> None:
    """Every jump lands inside the program (an assembly slip is an error here, not a
    filter that allows what it should not)."""
    for i, (code, jt, jf, _k) in enumerate(out):
        if code & 0x07 == 0x05:
            assert i + 1 + max(jt, jf) < len(out) and out[-4][0] == _RET, i


def install() -> bool:
    """Put the filter on this process (and its threads to come); False where the
    architecture is unknown or the kernel refuses. Needs no privilege: no_new_privs first."""
    try:
        code = program(platform.machine())
    except KeyError:
        return False
    raw = b"".join(struct.pack("HBBI", *instruction) for instruction in code)
    buffer = ctypes.create_string_buffer(raw, len(raw))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Fprog(len(code), ctypes.addressof(buffer))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                           ctypes.c_ulong]
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
        return False
    return libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) == 0
