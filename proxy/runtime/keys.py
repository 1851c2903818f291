"""Typed application keys (aiohttp's ``web.AppKey``) for the state the app owns."""

from aiohttp import web

from tracetap.proxy.runtime.state import ProxyState

STATE = web.AppKey("state", ProxyState)
