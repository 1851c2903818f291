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
# Who the client is, where it connected, and which method it "really" meant: chosen by
# the agent, and trusted by engines or intermediaries that log, rate-limit or route on
# them. Never forwarded; the proxy adds none of its own.
IDENTITY = frozenset(
    {
        "forwarded",
        "via",
        "x-forwarded-for",
        "x-forwarded-host",
        "x-forwarded-proto",
        "x-forwarded-port",
        "x-forwarded-prefix",
        "x-forwarded-server",
        "x-forwarded-ssl",
        "x-forwarded-scheme",
        "x-original-forwarded-for",
        "x-real-ip",
        "x-client-ip",
        "client-ip",
        "true-client-ip",
        "cf-connecting-ip",
        "fastly-client-ip",
        "x-cluster-client-ip",
        "x-proxyuser-ip",
        "x-original-url",
        "x-rewrite-url",
        "x-original-uri",
        "x-http-method-override",
        "x-http-method",
        "x-method-override",
        "x-original-method",
        "proxy-connection",
        "max-forwards",
    }
)
SECRET = frozenset({"authorization", "api-key", "x-api-key", "proxy-authorization", "cookie"})
EPISODE_HEADER = "X-Tracetap-Episode"
OVERLAY_HEADER = "X-Tracetap-Overlay"
OVERHEAD_HEADER = "x-tracetap-overhead-ms"
# The conversation a call belongs to inside its episode, and its parent (proxy.episodes.lineage).
LINEAGE_HEADER = "X-Tracetap-Lineage"
PARENT_HEADER = "X-Tracetap-Parent"


def upstream_request_headers(
    incoming: Mapping[str, str],
    *,
    api_key: str | None,
    forward_client_auth: bool,
    identity: bool,
) -> dict[str, str]:
    """Headers to send upstream: no hop-by-hop (nor any header ``Connection`` names), no
    identity headers the agent chose, no tracetap tags, and the proxy's own key. The body
    is sent as the proxy read it (inflated: ``proxy.http.bodies``), so no Content-Encoding."""
    out: dict[str, str] = {}
    dropped = _NEVER_SENT
    named = named_in_connection(incoming)
    if named:  # rare: the union is built only for a request whose Connection names some
        dropped = dropped | named
    for name, value in incoming.items():
        lower = name.lower()
        if lower in dropped:
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


_TAGS = frozenset({EPISODE_HEADER.lower(), OVERLAY_HEADER.lower(), LINEAGE_HEADER.lower(),
                   PARENT_HEADER.lower()})
_REQUEST_ONLY = frozenset({"content-encoding"})
# Built once, not per request (the union of these sets was half of this function's cost).
_NEVER_SENT = HOP_BY_HOP | IDENTITY | _TAGS | _REQUEST_ONLY


def named_in_connection(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> frozenset:
    """Headers a ``Connection`` header declares hop-by-hop (RFC 9110 §7.6.1)."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    return frozenset(
        token.strip().lower()
        for name, value in items
        if name.lower() == "connection"
        for token in value.split(",")
        if token.strip()
    )


def response_headers(upstream: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    pairs = list(upstream)
    named = named_in_connection(pairs)
    dropped = HOP_BY_HOP | named if named else HOP_BY_HOP
    return [(k, v) for k, v in pairs if k.lower() not in dropped]


def _is_episode_key(value: str) -> bool:
    return value.removeprefix("Bearer ").startswith("tt-")


def bearer(headers: Mapping[str, str]) -> str | None:
    """The client's key: ``Authorization: Bearer``, Azure's ``api-key`` or Anthropic's
    ``x-api-key`` (so a minted episode key works from any SDK)."""
    value = headers.get("Authorization")
    if value and value.startswith("Bearer "):
        return value[7:].strip()
    return headers.get("api-key") or headers.get("x-api-key")
