"""Progress on stderr: one line rewritten in place on a terminal, a line every few
seconds otherwise (logs, CI)."""

from __future__ import annotations

import time
from typing import TextIO

from tracetap.analysis.runner.episode import SKIPPED, Result
from tracetap.analysis.runner.outcomes import TIMEOUT

EVERY = 5.0  # seconds between lines when stderr is not a terminal
WIDTH = 30


class Progress:
    def __init__(self, total: int, stream: TextIO, *, clock=time.monotonic):
        self.total = total
        self.stream = stream
        self.tty = stream.isatty()
        self.clock = clock
        self.done = self.skipped = self.timeouts = self.running = 0
        self.started = clock()
        self.last = float("-inf")

    def start(self) -> None:
        self.running += 1
        self._show()

    def finished(self, result: Result) -> None:
        self.done += 1
        self.running -= 1
        self.skipped += result.status == SKIPPED
        self.timeouts += result.outcome == TIMEOUT
        self._show(force=self.done == self.total)

    def line(self) -> str:
        filled = WIDTH * self.done // max(self.total, 1)
        return (
            f"[{'#' * filled}{'.' * (WIDTH - filled)}] {self.done}/{self.total} "
            f"running {self.running}, skipped {self.skipped}, timeout {self.timeouts}, "
            f"{self.clock() - self.started:.0f} s"
        )

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _show(self, force: bool = False) -> None:
        now = self.clock()
        if self.tty:
            self.stream.write("\r\033[K" + self.line())
        elif force or now - self.last >= EVERY:
            self.stream.write(self.line() + "\n")
        else:
            return
        self.last = now
        self.stream.flush()
