"""When one model call's moments happened, and the spans read from them.

Every duration the record and the metrics report is derived here and nowhere else (the
upstream's latency, the proxy's own overhead, time to first content), so the three can
never disagree about what "upstream" covers: from the request's send to the upstream's
end of reply (``upstream_done``, the first of: the whole body read, the stream's end
marker, the stream closed, the upstream broken).
"""

from __future__ import annotations

import time


class Timings:
    __slots__ = (
        "perf_first_content",
        "perf_start",
        "perf_upstream_end",
        "perf_upstream_start",
        "t_first_byte",
        "t_start",
    )

    def __init__(self) -> None:
        self.t_start = time.time()  # wall clock: stored
        self.perf_start = time.perf_counter()  # monotonic: every span
        self.t_first_byte: float | None = None
        self.perf_upstream_start: float | None = None
        self.perf_upstream_end: float | None = None
        self.perf_first_content: float | None = None

    def sending(self) -> None:
        """The request goes to the upstream now."""
        self.perf_upstream_start = time.perf_counter()

    def first_byte(self) -> None:
        if self.t_first_byte is None:
            self.t_first_byte = time.time()

    def first_content(self) -> None:
        if self.perf_first_content is None:
            self.perf_first_content = time.perf_counter()

    def upstream_done(self) -> None:
        if self.perf_upstream_end is None:
            self.perf_upstream_end = time.perf_counter()

    @property
    def upstream_latency(self) -> float | None:
        """Seconds from the send to the upstream's end of reply; None if either is unknown."""
        if self.perf_upstream_start is None or self.perf_upstream_end is None:
            return None
        return self.perf_upstream_end - self.perf_upstream_start

    def elapsed(self) -> float:
        return time.perf_counter() - self.perf_start

    def overhead(self, elapsed: float | None = None) -> float:
        """Seconds of the call (so far, or of ``elapsed``) that were not the upstream's."""
        if elapsed is None:
            elapsed = self.elapsed()
        return elapsed - (self.upstream_latency or 0.0)

    @property
    def ttft(self) -> float | None:
        """Seconds from the client's request to the first content the upstream streamed."""
        first = self.perf_first_content
        return None if first is None else first - self.perf_start
