"""Typed application keys for what the viewer app holds (one instance per app).

Types are named, not imported: the modules that define them import these keys.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

CONFIG = web.AppKey("viewer_config", "ViewerConfig")
ACCESS = web.AppKey("viewer_access", "Access")
TEMPLATES = web.AppKey("viewer_templates", "Templates")
SOURCE = web.AppKey("viewer_source", "Source")
DETOKENIZER = web.AppKey("viewer_detokenizer", "Detokenizer")
ROWS = web.AppKey("viewer_rows", "RowCache")
CLOSING = web.AppKey("viewer_closing", asyncio.Event)
READERS = web.AppKey("viewer_readers", "Readers")  # storage.conversation: each API's reader
