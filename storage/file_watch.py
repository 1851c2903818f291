"""Linux inotify on one directory, for an idle SQLite process that follows other
processes' commits (storage.notify) without a timer: the kernel says when a file in the
directory (the database, its WAL) is written, created, removed or moved in, and the
follower looks at the files only then.

``watch`` returns None where inotify is not to be had (not Linux, no libc symbol, the
user's watch limit reached): the caller keeps its timer. Nothing here reads what
changed; the caller compares the files' stamps, so events of other files in the
directory cost a look and nothing else.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable

log = logging.getLogger("tracetap")

# <sys/inotify.h>
_IN_MODIFY, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x2, 0x80, 0x100, 0x200
_MASK = _IN_MODIFY | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE


class DirectoryWatch:
    """An inotify descriptor watching one directory; ``start`` calls ``changed`` (on the
    loop) after each batch of events, ``close`` stops."""

    def __init__(self, fd: int):
        self.fd = fd
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop, changed: Callable[[], None]) -> None:
        self._loop = loop
        loop.add_reader(self.fd, self._readable, changed)

    def _readable(self, changed: Callable[[], None]) -> None:
        try:
            while os.read(self.fd, 65536):  # the events themselves do not matter
                pass
        except BlockingIOError:
            pass
        changed()

    def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.fd)
            self._loop = None
        os.close(self.fd)


def watch(directory: str) -> DirectoryWatch | None:
    """A watch on ``directory``, or None where inotify is not available."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, AttributeError):  # not Linux
        return None
    if fd < 0:
        return None
    if libc.inotify_add_watch(fd, os.fsencode(directory), _MASK) < 0:
        log.info("cannot watch %s for commits (%s): following it by a timer", directory,
                 os.strerror(ctypes.get_errno()))
        os.close(fd)
        return None
    return DirectoryWatch(fd)
