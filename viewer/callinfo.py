"""How a call's outcome reads on the pages: one status label, and the error line of a
failed call (also when the proxy stored no error text: the upstream's own message)."""

from __future__ import annotations

import msgspec

from tracetap.storage.details import COMPLETED, CallSummary

ERROR_CHARS = 2000


def status_label(status: str, http_status: int) -> str:
    """``ok``; ``HTTP 500`` (the upstream answered an error, captured whole); or the
    capture status with its code, ``budget exceeded · HTTP 403``."""
    if status in COMPLETED:
        return status if http_status == 200 else f"HTTP {http_status}"
    return f"{status.replace('_', ' ')} · HTTP {http_status}"


def error_line(summary: CallSummary, response: str | None) -> str | None:
    """What went wrong, for a failed call; None for one that did not fail."""
    if not summary.failed:
        return summary.error
    if summary.error:
        return summary.error[:ERROR_CHARS]
    message = _upstream_message(response)
    if message:
        return f"the upstream answered HTTP {summary.http_status}: {message[:ERROR_CHARS]}"
    if summary.http_status != 200:
        return f"the upstream answered HTTP {summary.http_status} (no error text stored)"
    return f"{summary.status.replace('_', ' ')} (no error text stored)"


def _upstream_message(response: str | None) -> str | None:
    """``error.message`` (OpenAI, Anthropic), ``error`` or ``message`` of a JSON body."""
    if not response:
        return None
    try:
        body = msgspec.json.decode(response)
    except msgspec.DecodeError:
        return response.strip()[:ERROR_CHARS] or None
    if not isinstance(body, dict):
        return None
    error = body.get("error", body.get("message"))
    if isinstance(error, dict):
        error = error.get("message")
    return error if isinstance(error, str) and error else None
