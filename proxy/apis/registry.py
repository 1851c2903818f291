"""Every wire API a client may speak. Adding one is a package under ``apis/`` (the same
files as the others: ``api.py`` with its ``ClientApi``, ``capture.py``, ``errors.py``,
``request.py``, and ``translate.py`` when it is spoken to engines as chat) and its line
here; routing, the allowlist of paths and the error shapes follow from this table
(docs/architecture.md, "Adding a wire API")."""

from __future__ import annotations

from tracetap.proxy.apis import ClientApi
from tracetap.proxy.apis.chat.api import CHAT_CLIENT, COMPLETIONS_CLIENT
from tracetap.proxy.apis.messages.api import MESSAGES
from tracetap.proxy.apis.responses.api import RESPONSES

APIS: tuple[ClientApi, ...] = (CHAT_CLIENT, COMPLETIONS_CLIENT, RESPONSES, MESSAGES)
BY_PATH = {api.path: api for api in APIS}
BY_NAME = {api.name: api for api in APIS}
TRANSLATABLE = tuple(api.name for api in APIS if api.translation is not None)


def exposed_paths() -> tuple[str, ...]:
    """What an agent may POST to reach the model APIs (``http/exposure.py``'s rules)."""
    return tuple(path for api in APIS for path in api.exposed)
