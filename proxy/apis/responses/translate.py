"""OpenAI Responses API ⇄ chat completions, for upstreams that lack ``/v1/responses``.

``to_chat`` (in ``request.py``) turns a Responses request into a chat-completions request,
``from_chat`` here a whole chat reply into a ``response`` object, and ``StreamTranslator``
(``stream.py``) a chat stream into the Responses event stream; the objects both build are
in ``objects.py``. What is translated, dropped and rejected is listed in
docs/translation.md; anything without a faithful chat equivalent raises ``Untranslatable``.
"""

from __future__ import annotations

import time
from typing import Any

from tracetap.proxy.apis.chat.errors import OPENAI_ERRORS
from tracetap.proxy.apis.chat.reply import read_reply
from tracetap.proxy.apis.responses.objects import (
    Items,
    call_id,
    call_item,
    message_item,
    output_logprobs,
    reasoning_item,
    response_object,
    status_of,
)
from tracetap.proxy.apis.responses.request import to_chat, wants_logprobs
from tracetap.proxy.apis.responses.stream import StreamTranslator
from tracetap.proxy.apis.translate_errors import Untranslatable
from tracetap.proxy.apis.wire_out import new_id
from tracetap.proxy.http.errors import ProxyError

__all__ = ["ERRORS", "StreamTranslator", "Untranslatable", "error_from_chat", "from_chat",
           "to_chat", "untranslatable", "wants_logprobs"]

ERRORS = OPENAI_ERRORS  # the client's error shape: Responses is an OpenAI API

def from_chat(chat: dict, request: dict, *, response_id: str | None = None) -> dict:
    """A whole chat-completions reply → a Responses ``response`` object."""
    req = request if isinstance(request, dict) else {}
    reply = read_reply(chat)
    rid = response_id or new_id("resp")
    items = Items(rid)
    output: list[dict[str, Any]] = []
    if reply.reasoning:
        output.append(reasoning_item(items.next_id("rs"), reply.reasoning, "completed"))
    if reply.text or not reply.tool_calls:
        logprobs = output_logprobs(reply.logprobs) if wants_logprobs(req) else []
        output.append(message_item(items.next_id("msg"), reply.text or "", logprobs,
                                   "completed"))
    for call in reply.tool_calls:
        item_id = items.next_id("fc")
        output.append(call_item(item_id, call.id or call_id(item_id), call.name or "",
                                call.arguments, "completed"))
    status, incomplete = status_of(reply.finish_reason)
    if incomplete is not None:
        output[-1]["status"] = "incomplete"
    created = reply.created if reply.created is not None else int(time.time())
    return response_object(req, rid, created, output, status, incomplete, reply.usage)


# ---- errors ------------------------------------------------------------------------------


def error_from_chat(status: int, body: bytes) -> bytes:
    """An upstream chat error body (any shape) → an OpenAI error body; never raises."""
    return ERRORS.from_upstream(status, body)


def untranslatable(exc: Untranslatable) -> ProxyError:
    """The 400 for a request that cannot be translated (its body: ``ERRORS.body``)."""
    return exc.refusal("Responses")
