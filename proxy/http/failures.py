"""Requests the proxy itself failed on: a 500 in the client's shape, counted, and logged
without letting a flood of them flood the log.

An agent can send the same broken request thousands of times a second; one traceback per
request would bury everything else in the log (and cost the disk). The first
``BURST`` failures of each ``WINDOW`` seconds are logged with their traceback, the rest
only counted (``tracetap_internal_errors_total``) and summed up in one line per window.
"""

from __future__ import annotations

import logging
import time

from tracetap.proxy.http.errors import ProxyError

log = logging.getLogger("tracetap")

BURST = 5
WINDOW = 60.0


class Failures:
    def __init__(self, counter=None, clock=time.monotonic):
        self._counter = counter
        self._clock = clock
        self._window_start = float("-inf")
        self._logged = 0
        self._quiet = 0  # failures not logged in the current window

    def internal(self, exc: BaseException, call_id: str) -> ProxyError:
        """Count and (rate-limited) log ``exc``; the error the client gets."""
        if self._counter is not None:
            self._counter.inc()
        now = self._clock()
        if now - self._window_start >= WINDOW:
            if self._quiet:
                log.error("%d more requests failed inside the proxy in the last %.0fs "
                          "(tracebacks not logged; see tracetap_internal_errors_total)",
                          self._quiet, now - self._window_start)
            self._window_start, self._logged, self._quiet = now, 0, 0
        if self._logged < BURST:
            self._logged += 1
            log.error("call %s failed inside the proxy", call_id, exc_info=exc)
        else:
            self._quiet += 1
        return ProxyError(500, f"the proxy failed on this request ({type(exc).__name__}); "
                          f"call id {call_id}", "server_error", "internal_error")
