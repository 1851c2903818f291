"""How the proxy starts a patch's worker: inside bubblewrap, or, only where the operator
said so by name (``--overlay-patch-sandbox unsandboxed``), as a plain child process.

The sandbox (docs/overlays.md, "What a patch can reach"): new PID, mount, network, IPC,
UTS and cgroup namespaces; a root file system that is an empty read-only tmpfs with, read
only, the system's libraries (/usr and its /lib links), the Python install and the
worker's own code (the overlay package and msgspec), nothing else: no data dir, no
database file, no configuration, no home. /proc is the sandbox's own (its processes
only), /dev the minimal one. The worker runs as user 65534: a proxy running as root
starts bubblewrap without a user namespace and the worker drops to that uid itself
(another user outside too, with no capabilities); a proxy running as another user gets a
user namespace in which the worker is 65534 (outside it stays the proxy's uid, behind the
namespaces). It dies with the proxy (``--die-with-parent``) and has a session of its own.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import shutil
import sys
from pathlib import Path

log = logging.getLogger("tracetap.overlays")

SANDBOXES = ("bwrap", "unsandboxed")
NOBODY = 65534
ROOT = "/tracetap-worker"  # where the worker's code is, inside the sandbox
WORKER = "tracetap.proxy.overlays.patch_worker"
PROBE_SECONDS = 10.0


class SandboxUnavailable(Exception):
    """bubblewrap is missing or cannot make its namespaces here; the message says which."""


def _python() -> tuple[str, list[str]]:
    """The interpreter's real path and the install folders it reads (its prefixes)."""
    executable = os.path.realpath(sys.executable)
    prefixes = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}
    return executable, sorted(prefixes)


def _code() -> list[tuple[str, str]]:
    """(host path, sandbox path) of the worker's code: its package, the ``__init__`` of
    each package above it, and msgspec (its one dependency)."""
    package = WORKER.rpartition(".")[0]
    binds = []
    parts = package.split(".")
    for depth in range(1, len(parts)):
        parent = importlib.import_module(".".join(parts[:depth]))
        assert parent.__file__ is not None
        binds.append((parent.__file__, f"{ROOT}/{'/'.join(parts[:depth])}/__init__.py"))
    here = importlib.import_module(package)
    assert here.__file__ is not None
    binds.append((str(Path(here.__file__).parent), f"{ROOT}/{'/'.join(parts)}"))
    import msgspec

    binds.append((str(Path(msgspec.__file__).parent), f"{ROOT}/msgspec"))
    return binds


def _dirs(path: str, made: set[str]) -> list[str]:
    """``--dir`` for each folder above ``path`` not made yet, world-readable (bubblewrap
    makes them 0700 otherwise, which a worker that is not root cannot walk)."""
    args = []
    parts = Path(path).parts
    for depth in range(2, len(parts)):
        folder = str(Path(*parts[:depth]))
        if folder not in made:
            made.add(folder)
            args += ["--perms", "0755", "--dir", folder]
    return args


def _system() -> list[str]:
    """/usr, and the top-level links into it (or the folders, where /usr is not merged)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args


def _as_root() -> bool:
    return os.geteuid() == 0


def bwrap_argv(bwrap: str, worker_args: list[str]) -> list[str]:
    """The command that runs the worker in the sandbox."""
    executable, prefixes = _python()
    args = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            "--hostname", "sandbox", "--clearenv", "--setenv", "LANG", "C.UTF-8"]
    if _as_root():
        # No user namespace: the worker drops to NOBODY itself, a real other user.
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    args += _system()
    made = {"/usr"}
    for prefix in prefixes:
        if not prefix.startswith("/usr/"):
            args += [*_dirs(prefix, made), "--ro-bind", prefix, prefix]
    for source, target in _code():
        args += [*_dirs(target, made), "--ro-bind", source, target]
    args += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/",
             "--remount-ro", "/dev", "--chdir", "/"]
    boot = (f"import sys, runpy; sys.path.insert(0, {ROOT!r}); "
            f"runpy.run_module({WORKER!r}, run_name='__main__', alter_sys=True)")
    return [*args, "--", executable, "-I", "-S", "-B", "-c", boot, *worker_args]


def plain_argv(worker_args: list[str]) -> list[str]:
    """The worker as a child process of the proxy's own (the operator trusts patches)."""
    return [sys.executable, "-m", WORKER, *worker_args]


class Launcher:
    """Builds a worker's command for the configured sandbox, once it is known to work."""

    def __init__(self, sandbox: str = "bwrap") -> None:
        if sandbox not in SANDBOXES:
            raise ValueError(f"--overlay-patch-sandbox is one of {', '.join(SANDBOXES)}")
        self.sandbox = sandbox
        self._ready: str | None = None  # the bwrap binary, once a probe ran in it
        self._lock = asyncio.Lock()

    async def argv(self, worker_args: list[str]) -> list[str]:
        """SandboxUnavailable when bubblewrap cannot run the worker here."""
        if self.sandbox == "unsandboxed":
            if self._ready is None:
                self._ready = "unsandboxed"  # said once
                log.warning("runtime overlay patches run unsandboxed "
                            "(--overlay-patch-sandbox unsandboxed): a patch reads what "
                            "this proxy's user can read, the admin token included")
            return plain_argv(worker_args)
        async with self._lock:
            if self._ready is None:
                self._ready = await _probe()
        return bwrap_argv(self._ready, worker_args)


async def _probe() -> str:
    """Run the sandbox once with a worker that only says it started; the bwrap binary, or
    SandboxUnavailable saying why not (what bubblewrap printed)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is not installed (Debian: apt-get install bubblewrap)"
        )
    argv = bwrap_argv(bwrap, ["probe"])
    process = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={"PATH": os.environ.get("PATH", "")}, cwd="/")
    try:
        out, err = await asyncio.wait_for(process.communicate(), PROBE_SECONDS)
    except asyncio.TimeoutError as exc:
        process.kill()
        await process.wait()
        raise SandboxUnavailable("bubblewrap did not start the worker in time") from exc
    if process.returncode != 0 or out.strip() != b"sandboxed":
        said = err.decode("utf-8", "replace").strip()[-300:] or f"status {process.returncode}"
        raise SandboxUnavailable(f"bubblewrap cannot set up the sandbox here: {said}")
    return bwrap
