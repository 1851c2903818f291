"""A bare aiohttp relay: forwards bytes both ways and captures nothing.

The floor for any aiohttp proxy: one pooled client session, hop-by-hop headers
dropped, whole bodies relayed as one response and event streams relayed chunk by
chunk as they arrive (the same shapes tracetap uses), no parsing, no storage.

    python bench/relay.py --port 8001 --upstream http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import gc

import aiohttp
from aiohttp import web

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "transfer-encoding", "upgrade", "host",
                        "content-length"})
UPSTREAM = web.AppKey("upstream", str)
SESSION = web.AppKey("session", aiohttp.ClientSession)


def _headers(items) -> dict[str, str]:
    return {k: v for k, v in items if k.lower() not in HOP_BY_HOP}


async def relay(request: web.Request) -> web.StreamResponse:
    session = request.app[SESSION]
    body = await request.read()
    async with session.request(request.method, request.app[UPSTREAM] + request.path_qs,
                               headers=_headers(request.headers.items()), data=body,
                               allow_redirects=False) as reply:
        headers = _headers(reply.headers.items())
        if reply.content_type != "text/event-stream":
            return web.Response(status=reply.status, body=await reply.read(), headers=headers)
        response = web.StreamResponse(status=reply.status, headers=headers)
        await response.prepare(request)
        async for data in reply.content.iter_any():
            await response.write(data)
        await response.write_eof()
        return response


async def _session(app: web.Application):
    connector = aiohttp.TCPConnector(limit=1024, limit_per_host=0, keepalive_timeout=60)
    app[SESSION] = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                         skip_auto_headers=("User-Agent", "Accept-Encoding",
                                                            "Content-Type"),
                                         timeout=aiohttp.ClientTimeout(total=None))
    yield
    await app[SESSION].close()


def make_app(upstream: str) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    app[UPSTREAM] = upstream.rstrip("/")
    app.cleanup_ctx.append(_session)
    app.router.add_route("*", "/{tail:.*}", relay)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--upstream", required=True, help="origin, e.g. http://127.0.0.1:8000")
    args = parser.parse_args()
    import uvloop

    # The same collector settings as `tracetap serve`, so the floor is a fair one.
    gc.freeze()
    gc.set_threshold(50_000)
    web.run_app(make_app(args.upstream), host=args.host, port=args.port, print=None,
                access_log=None, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
