"""A look at each upstream before serving: the most common mistake gets a one-line answer.

vLLM prints its address without ``/v1`` (``http://host:8000``), and a proxy pointed there
would store every call as a plain-text 404. An upstream that does not answer yet is
fine: the proxy starts and uses it once it does.
"""

from __future__ import annotations

import base64
import logging
import urllib.error
import urllib.parse
import urllib.request
from urllib.parse import unquote

from tracetap.proxy.upstream.specs import UpstreamSpec

log = logging.getLogger("tracetap")


def check_upstreams(specs: list[UpstreamSpec], api_key: str | None,
                    timeout: float = 3.0) -> None:
    """Raise ValueError when an upstream URL is certainly wrong; log what else was found."""
    for spec in specs:
        base = spec.shown.rstrip("/")  # in every message: credentials masked
        url = spec.url.rstrip("/")
        status = _status(url + "/models", api_key, timeout)
        if status == 200:
            continue
        if status is None:
            log.warning("upstream %s does not answer yet; calls to it fail until it does",
                        base)
            continue
        if not base.endswith("/v1") and _status(url + "/v1/models", api_key, timeout) == 200:
            raise ValueError(f"--upstream {base} serves the OpenAI API under /v1: "
                             f"pass --upstream {base}/v1")
        log.warning("upstream %s answers %d on %s/models: is this the base URL of an "
                    "OpenAI-compatible API (usually ending in /v1)?", base, status, base)


def _status(url: str, api_key: str | None, timeout: float) -> int | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    parts = urllib.parse.urlsplit(url)
    if parts.username is not None:  # urllib does not send a URL's credentials itself
        userinfo = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        headers = {"Authorization": "Basic " + base64.b64encode(userinfo.encode()).decode()}
        url = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=timeout) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        err.close()
        return err.code
    except (OSError, ValueError):
        return None
