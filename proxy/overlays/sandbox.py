"""What a patch's worker process does to itself before it imports the patch: another
user, no network, no processes, no writes, bounded memory, CPU and file descriptors
(docs/overlays.md says exactly what each of these guarantees, and what it does not).

Runs in the worker only (``patch_worker``), inside the sandbox ``overlays.bwrap`` made,
in this order: drop to user 65534 where it started as root (bubblewrap without a user
namespace), a new user and network namespace where it runs unsandboxed and the kernel
allows one, the rlimits, the seccomp filter (``overlays.seccomp``), then an audit hook
that refuses the operations a patch has no business doing. The hook cannot be removed from
Python once added (PEP 578), and its refusals are written into its own code (constants),
not read from anything a patch could rebind; it is a second wall, not the first.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
from typing import NamedTuple

from tracetap.proxy.overlays import seccomp

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


def network_namespace() -> bool:
    """Move this process into a new user + network namespace: it then has only a
    loopback interface, down, of its own. False where the kernel or container refuses."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0
    except (OSError, AttributeError):
        return False


def limit(memory_mb: int, cpu_seconds: int, files: int) -> dict[str, int]:
    """Address space, CPU time (a backstop: the proxy kills a hook past its wall time
    first) and open files; lowered for good (hard limits too, except CPU's soft one,
    which the worker moves per hook). Returns what was set."""
    limits = {
        "RLIMIT_AS": memory_mb * 1024 * 1024,
        "RLIMIT_NOFILE": files,
        "RLIMIT_NPROC": 0,  # no new processes (not enforced for root: the audit hook is)
        "RLIMIT_FSIZE": 0,  # no file grows
        "RLIMIT_CORE": 0,
    }
    done = {}
    for name, value in limits.items():
        which = getattr(resource, name)
        try:
            resource.setrlimit(which, (value, value))
            done[name] = value
        except (ValueError, OSError):
            pass  # a limit the platform does not take is not claimed
    hard = cpu_seconds * 1000  # the worker's whole life; the soft limit is per hook
    try:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, hard))
        done["RLIMIT_CPU"] = cpu_seconds
    except (ValueError, OSError):
        pass
    return done


def cpu_budget(seconds: int) -> None:
    """Before each hook: at most ``seconds`` more CPU time (then SIGXCPU ends the worker)."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = int(used.ru_utime + used.ru_stime) + 1
    _soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    try:
        resource.setrlimit(resource.RLIMIT_CPU, (min(spent + seconds, hard), hard))
    except (ValueError, OSError):
        pass


def refuse(event: str, args: tuple) -> None:
    """The audit hook. It reads nothing a patch could rebind: no module globals, no
    builtins (a rebound ``isinstance`` would pass anything), only literals and the
    methods of ``str`` and ``tuple``; raising works whatever ``PermissionError`` became
    (a non-exception raises TypeError, a missing name NameError: either refuses)."""
    if event.startswith(
        (
            "socket.",
            "subprocess.",
            "ctypes.",
            "os.exec",
            "os.spawn",
            "os.posix_spawn",
            "os.fork",
            "os.forkpty",
            "os.system",
            "os.kill",
            "os.killpg",
            "pty.spawn",
            "_posixsubprocess",
            "os.remove",
            "os.rename",
            "os.rmdir",
            "os.truncate",
            "os.chmod",
            "os.chown",
            "os.link",
            "os.symlink",
            "os.mkdir",
            "os.setxattr",
            "os.removexattr",
            "shutil.rmtree",
            "mmap.__new__",
            "gc.get_",
        )
    ):
        raise PermissionError(f"overlay patches may not use {event}")
    if event == "object.__setattr__" and args[1:2] == ("__code__",):
        raise PermissionError("overlay patches may not replace a function's code")
    if (
        event == "import"
        and args[:1]
        and args[0]
        in (
            "_posixsubprocess",
            "_ctypes",
            "ctypes",
            "_socket",
            "socket",
            "subprocess",
            "multiprocessing",
            "pty",
            "mmap",
            "_multiprocessing",
        )
    ):
        raise PermissionError(f"overlay patches may not import {args[0]}")
    if event == "open" and args[2:]:
        mode, flags = args[1], args[2]
        # Linux's O_WRONLY | O_RDWR | O_CREAT | O_TRUNC | O_APPEND, as a literal.
        if flags.__class__ is (0).__class__ and flags & 0o3103:
            raise PermissionError("overlay patches may not write files")
        if mode.__class__ is "".__class__ and (
            "w" in mode or "a" in mode or "x" in mode or "+" in mode
        ):
            raise PermissionError("overlay patches may not write files")


NOBODY = 65534


def drop_user() -> int:
    """Become user and group 65534, with no supplementary groups and so no capabilities;
    RuntimeError if any id is left over (a worker that stays root runs no patch)."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    ids = (*os.getresuid(), *os.getresgid())
    if 0 in ids or os.getgroups() not in ([], [NOBODY]):
        raise RuntimeError(f"the worker is still uid/gid 0 ({ids}): refusing to run a patch")
    return os.getuid()


class Confined(NamedTuple):
    network_namespace: bool
    limits: dict[str, int]
    uid: int
    seccomp: bool


def confine(*, memory_mb: int, cpu_seconds: int, files: int, sandboxed: bool) -> Confined:
    """All of it, once. ``sandboxed``: inside bubblewrap (its namespaces made already)."""
    uid = drop_user() if sandboxed else os.getuid()
    netns = True if sandboxed else network_namespace()
    limits = limit(memory_mb, cpu_seconds, files)
    filtered = seccomp.install()
    sys.addaudithook(refuse)
    return Confined(netns, limits, uid, filtered)
