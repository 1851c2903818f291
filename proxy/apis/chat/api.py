"""Chat completions and legacy completions as the registry (``apis/registry.py``) lists
them: spoken to every engine as they are, never translated."""

from __future__ import annotations

from tracetap.proxy.apis import ClientApi
from tracetap.proxy.apis.chat.capture import CHAT_API, COMPLETIONS_API
from tracetap.proxy.apis.chat.conversation import (
    CHAT_SHAPE,
    COMPLETIONS_SHAPE,
    chat_caps,
    completions_caps,
    read_chat,
    read_completions,
)
from tracetap.proxy.apis.chat.errors import OPENAI_ERRORS

CHAT_CLIENT = ClientApi(
    name="chat", path=CHAT_API.path, exposed=(CHAT_API.path,), errors=OPENAI_ERRORS,
    native=lambda: CHAT_API, native_flavors=(), translation=None, reader=read_chat,
    shape=CHAT_SHAPE, caps=chat_caps)
COMPLETIONS_CLIENT = ClientApi(
    name="completions", path=COMPLETIONS_API.path, exposed=(COMPLETIONS_API.path,),
    errors=OPENAI_ERRORS, native=lambda: COMPLETIONS_API, native_flavors=(),
    translation=None, reader=read_completions, shape=COMPLETIONS_SHAPE,
    caps=completions_caps)
