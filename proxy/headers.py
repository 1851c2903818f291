"""Which headers cross the proxy, and which never reach storage or logs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

# RFC 9110 §7.6.1 connection-specific headers, plus ones the proxy recomputes.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
SECRET = frozenset({"authorization", "api-key", "x-api-key", "proxy-authorization", "cookie"})
EPISODE_HEADER = "X-Tracetap-Episode"
OVERLAY_HEADER = "X-Tracetap-Overlay"
OVERHEAD_HEADER = "x-tracetap-overhead-ms"


def upstream_request_headers(
    incoming: Mapping[str, str],
    *,
    api_key: str | None,
    forward_client_auth: bool,
    identity: bool,
) -> dict[str, str]:
    """Headers to send upstream: no hop-by-hop, no tracetap tags, the proxy's own key."""
    out: dict[str, str] = {}
    for name, value in incoming.items():
        lower = name.lower()
        if lower in HOP_BY_HOP or lower in _TAGS:
            continue
        if lower in SECRET and not (forward_client_auth and not _is_episode_key(value)):
            continue
        if identity and lower == "accept-encoding":
            continue
        out[name] = value
    if identity:
        # The proxy parses capture bodies, so it asks for them uncompressed.
        out["Accept-Encoding"] = "identity"
    if api_key:
        out["Authorization"] = f"Bearer {api_key}"
    return out


_TAGS = frozenset({EPISODE_HEADER.lower(), OVERLAY_HEADER.lower()})


def response_headers(upstream: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in upstream if k.lower() not in HOP_BY_HOP]


def _is_episode_key(value: str) -> bool:
    return value.removeprefix("Bearer ").startswith("tt-")


def bearer(headers: Mapping[str, str]) -> str | None:
    """The client's key: ``Authorization: Bearer``, Azure's ``api-key`` or Anthropic's
    ``x-api-key`` (so a minted episode key works from any SDK)."""
    value = headers.get("Authorization")
    if value and value.startswith("Bearer "):
        return value[7:].strip()
    return headers.get("api-key") or headers.get("x-api-key")
