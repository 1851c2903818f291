"""Every wire API a client may speak. Adding one is a package under ``apis/`` (the same
files as the others: ``api.py`` with its ``ClientApi``, ``capture.py``, ``errors.py``,
``request.py``, ``conversation.py`` (its stored calls read as a conversation), and
``translate.py`` when it is spoken to engines as chat) and its line here; routing, the
allowlist of paths, the error shapes and the conversation readers follow from this table
(docs/architecture.md, "Adding a wire API")"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tracetap.proxy.apis import Caps, ClientApi
from tracetap.proxy.apis.chat.api import CHAT_CLIENT, COMPLETIONS_CLIENT
from tracetap.proxy.apis.messages.api import MESSAGES
from tracetap.proxy.apis.responses.api import RESPONSES
from tracetap.storage.conversation import Readers

APIS: tuple[ClientApi, ...] = (CHAT_CLIENT, COMPLETIONS_CLIENT, RESPONSES, MESSAGES)
BY_PATH = {api.path: api for api in APIS}
BY_NAME = {api.name: api for api in APIS}
TRANSLATABLE = tuple(api.name for api in APIS if api.translation is not None)


def exposed_paths() -> tuple[str, ...]:
    """What an agent may POST to reach the model APIs (``http/exposure.py``'s rules)."""
    return tuple(path for api in APIS for path in api.exposed)


def caps(endpoint: str, request: Mapping[str, Any]) -> Caps:
    """The completion cap of a request to ``endpoint`` (a route's), read by its client's
    API (the budgets' reservation)."""
    api = _BY_ENDPOINT.get(endpoint.split(":", 1)[0])
    return Caps() if api is None else api.caps(request)


def readers(apis: tuple[ClientApi, ...] = APIS) -> Readers:
    """Each API's conversation reader, by the names ``calls.endpoint`` stores: its name,
    its native capture's endpoint (chat's ``chat.completions``), and ``<client>:chat``'s
    upstream side (``chat``), with each API's stored request's shape. Handed to the
    viewer, analysis, lineage, the writer and prune at composition."""
    by_endpoint = _by_endpoint(apis)
    return Readers({name: api.reader for name, api in by_endpoint.items()},
                   {name: api.shape for name, api in by_endpoint.items()})


def _by_endpoint(apis: tuple[ClientApi, ...]) -> dict[str, ClientApi]:
    """By the names calls.endpoint stores: an API's name, its native capture's endpoint."""
    return {**{api.name: api for api in apis},
            **{api.native().endpoint: api for api in apis if api.native}}


_BY_ENDPOINT = _by_endpoint(APIS)
