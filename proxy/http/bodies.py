"""Reading an agent's request body: one size limit on every path, compressed or not.

aiohttp's server inflates gzip and deflate request bodies as they arrive, a bounded piece
at a time (since aiohttp 3.14.1; 3.14.0 inflated a whole received chunk at once); the
limit here counts the inflated bytes, so a small gzip bomb is refused with a 413 once it
has inflated past ``--max-body``, having cost at most that much memory. The body is
forwarded as it was read, inflated, and so without its Content-Encoding header
(``headers.upstream_request_headers``). Encodings the server does not inflate are refused
rather than forwarded under a label that no longer fits. A client that stops sending
mid-body is cut off after ``--body-timeout`` seconds without a byte. What is left unread
of a refused body, aiohttp reads and discards for a few seconds (so the client sees the
reply rather than a reset), then closes the connection.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from tracetap.proxy.http.errors import ProxyError, too_large

# What aiohttp's request parser inflates (exactly these, lower-cased), and no encoding.
INFLATED = frozenset({"gzip", "deflate"})
PLAIN = frozenset({"", "identity"})


async def read_body(request: web.Request, limit: int, timeout: float) -> bytes:
    """The whole (inflated) body, or a ProxyError: 413 past ``limit`` bytes, 415 for an
    encoding that is not inflated, 400 for one that does not decode, 408 when the client
    stalls for ``timeout`` seconds."""
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in INFLATED | PLAIN:
        raise ProxyError(415, f"request Content-Encoding {encoding!r} is not accepted: send "
                         "the body plain, gzip or deflate", "invalid_request_error",
                         "unsupported_content_encoding")
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)  # said up front: nothing is read
    if not request.body_exists:
        return b""
    content = request.content
    parts: list[bytes] = []
    size = 0
    try:
        while True:
            # What has arrived is taken as it is: a body in the request's first packets
            # (most) is read without a task, a future and a timer per read (wait_for), nor
            # the two trips through the event loop they cost every call.
            data = content.read_nowait()
            if not data:
                if content.is_eof():
                    return b"".join(parts)
                data = await asyncio.wait_for(content.readany(), timeout)
                if not data:
                    return b"".join(parts)
            size += len(data)
            if size > limit:
                raise too_large(limit)
            parts.append(data)
    except asyncio.TimeoutError:
        raise ProxyError(408, f"request body stalled: nothing received for {timeout:g} "
                         "seconds", "invalid_request_error", "request_timeout") from None
    except RequestPayloadError as exc:  # not gzip after all, or a broken chunked body
        raise ProxyError(400, f"request body could not be read: {exc}".replace("\n", " "),
                         "invalid_request_error", "invalid_body") from None

