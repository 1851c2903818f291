"""Anthropic's Messages API as the registry (``apis/registry.py``) lists it: no engine
returns token ids or logprobs for it (vLLM's ``/v1/messages`` gives neither), so it is
translated to chat unless ``--translate none``."""

from __future__ import annotations

from tracetap.proxy.apis import ClientApi
from tracetap.proxy.apis.messages import translate
from tracetap.proxy.apis.messages.capture import MessagesApi
from tracetap.proxy.apis.messages.conversation import (
    MESSAGES_SHAPE,
    messages_caps,
    read_messages,
)
from tracetap.proxy.apis.messages.errors import ANTHROPIC_ERRORS

MESSAGES = ClientApi(
    name="messages", path=MessagesApi.path,
    exposed=(MessagesApi.path, MessagesApi.path + "/count_tokens"), errors=ANTHROPIC_ERRORS,
    native=MessagesApi, native_flavors=(), translation=translate, reader=read_messages,
    shape=MESSAGES_SHAPE, caps=messages_caps)
