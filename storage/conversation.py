"""A call's conversation in one shape, whatever wire API it spoke: the types its readers
share, and ``Readers``, the table from a stored endpoint to its API's reader.

Each wire API reads its own request and reply shapes (``proxy/apis/<api>/conversation.py``)
into these types; the viewer, analysis and the proxy's lineage read the types and never an
API's shape. storage/, viewer/ and analysis/ may not import the proxy, so the table is a
value handed to them by whoever composes them (``proxy.apis.registry.readers()``): a
fourth API's calls read as conversations everywhere once its package has a reader and its
line in the registry. A call whose API has no reader reads as ``plain``: its request and
reply as JSON values, never dropped.

Each API also declares its stored request's ``Shape`` (data, beside its reader): where its
messages are, what an assistant turn looks like. The writer cuts a body into blocks at
its messages (storage.blocks) and the search indexes the turn a call adds
(storage.search_text) by it, without parsing the body: both are handed the table
(``Readers.shape``) by whoever composes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import msgspec

from tracetap.storage.image_blocks import key
from tracetap.storage.image_parts import image_of


class Text(msgspec.Struct, tag="text", gc=False):
    text: str


class Reasoning(msgspec.Struct, tag="reasoning", gc=False):
    """The model's reasoning (chat's ``reasoning_content``, Messages' thinking blocks,
    Responses' reasoning items)."""

    text: str
    block: str = ""  # the API's name for the block (thinking), when it is one


class ToolCall(msgspec.Struct, tag="tool_call", kw_only=True, gc=False):
    name: str | None = None
    # As the API sent them: a JSON text (chat, Responses) or a JSON value (Messages' input).
    arguments: Any = None
    id: str | None = None
    block: str = ""  # the API's name for the block (tool_use), when it is one


class ToolResult(msgspec.Struct, tag="tool_result", kw_only=True, gc=False):
    call_id: str | None = None  # the ToolCall.id it answers
    parts: list[Part] | None = None  # None: the result has no content
    block: str = ""  # the API's name for the block (tool_result), when it is one


class Image(msgspec.Struct, tag="image", kw_only=True, gc=False):
    """An image: its URL when it is one, else the part as sent (the request's own dict,
    not a copy). Its bytes are decoded only by whoever asks (``stored``: the viewer's
    thumbnail), never by a reader on the request path (the lineage hash reads the start
    of every call, and a computer-use agent's first message holds a screenshot)."""

    url: str | None = None
    block: str = "image"  # the API's name for the block (image_url, input_image, image)
    part: Any = None

    def stored(self) -> str | None:
        """The hex key of the block that stores its bytes once (storage.image_blocks);
        None when it holds no inline bytes that decode."""
        found = image_of(self.part) if isinstance(self.part, dict) else None
        return key(found.data) if found is not None and found.data is not None else None


class Other(msgspec.Struct, tag="other", kw_only=True, gc=False):
    """A value the reader does not understand, kept as it was sent."""

    value: Any = None
    block: str = ""  # the API's name for the block, when it is a block


Part = Text | Reasoning | ToolCall | ToolResult | Image | Other


class Message(msgspec.Struct, kw_only=True, gc=False):
    # system (a request's system prompt comes first as one), developer, user, assistant,
    # tool (a tool result), other (a message that is not an object)
    role: str
    parts: list[Part] = []


class Tool(msgspec.Struct, kw_only=True, gc=False):
    name: Any = None
    description: Any = None
    parameters: Any = None  # its JSON schema


# gc=False: a conversation holds no cycles (an Other's value is a decoded JSON value), and
# the collector need not walk the thousands of parts a long conversation makes.
class Conversation(msgspec.Struct, kw_only=True, gc=False):
    # None: the request holds no list of messages (a completions prompt, or no body).
    messages: list[Message] | None = None
    prompt: list[Part] | None = None  # a legacy completions prompt
    reply: list[Message] = []  # the model's answer, one message per choice or turn
    tools: list[Tool] = []


class Reader(Protocol):
    def __call__(self, request: Mapping[str, Any], reply: Mapping[str, Any], *,
                 first: int | None = None) -> Conversation:
        """``request``: a decoded JSON object (``{}`` when there was none), ``reply``
        likewise. ``first``: only the request's first messages are wanted (at least that
        many when it has them, the system prompt counted as one): a reader may stop
        there (the lineage hash reads the start of a long conversation)."""
        ...


def plain(request: Mapping[str, Any], reply: Mapping[str, Any], *,
          first: int | None = None) -> Conversation:
    """The reader of an API without one: its bodies as values."""
    return Conversation(
        messages=[Message(role="other", parts=[Other(value=dict(request))])] if request else [],
        reply=[Message(role="reply", parts=[Other(value=dict(reply))])] if reply else [])


class Shape(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Where an API's stored request holds its conversation, as top-level keys: what the
    writer's blocks and search text read without parsing the whole body. An API without
    one (``PLAIN``) has its bodies stored whole and its request's text indexed whole."""

    # The key of its list of messages (a text in its place, as Responses allows, is
    # indexed as text); the list is cut into one block per message.
    messages: str | None = None
    prompt: str | None = None  # the key of a completions prompt (when there are no messages)
    head: tuple[str, ...] = ()  # keys of the set-up before the messages (system prompt)
    # What marks a message as the model's: its "role", or its "type" (an item of its own).
    assistant_roles: tuple[str, ...] = ("assistant",)
    assistant_types: tuple[str, ...] = ()

    def __post_init__(self):
        keys = [k for k in (self.messages, self.prompt, *self.head) if k is not None]
        if len(set(keys)) != len(keys):  # read as one request's distinct fields
            raise ValueError(f"a request shape names a key twice: {keys}")


PLAIN = Shape()


class Readers:
    """Which reader reads a stored call, and its request's ``Shape``: by its endpoint
    (``calls.endpoint``: an API's name, ``<client>:<upstream>`` when translated)."""

    def __init__(self, by_name: Mapping[str, Reader] | None = None,
                 shapes: Mapping[str, Shape] | None = None):
        self._by_name = dict(by_name or {})
        self._shapes = dict(shapes or {})

    def shape(self, endpoint: str) -> Shape:
        """The shape of the stored request (the client's)."""
        return self._shapes.get(endpoint.split(":", 1)[0], PLAIN)

    def upstream_shape(self, endpoint: str) -> Shape:
        """The shape of the request as the upstream was given it (``upstream_request``)."""
        return self._shapes.get(endpoint.rsplit(":", 1)[-1], PLAIN)

    def reader(self, endpoint: str) -> Reader:
        """The client's API's reader (the stored request and reply are the client's)."""
        return self._by_name.get(endpoint.split(":", 1)[0], plain)

    def upstream_reader(self, endpoint: str) -> Reader:
        """The reader of the request as the upstream was given it (``upstream_request``)."""
        return self._by_name.get(endpoint.rsplit(":", 1)[-1], plain)

    def read(self, endpoint: str, request: str | None, reply: str | None) -> Conversation:
        return self.reader(endpoint)(json_object(request), json_object(reply))


def json_object(text: str | bytes | None) -> dict[str, Any]:
    """A stored JSON text as an object; ``{}`` when it is empty, broken or not an object."""
    if not text:
        return {}
    try:
        value = msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError):  # nested too deep to decode: no turns
        return {}
    return value if isinstance(value, dict) else {}


def image(part: dict, block: str, url: Any) -> Image:
    """An image part of any API; ``url``: where its API names one (a ``data:`` URL is
    inline bytes, kept in ``part``)."""
    return Image(url=url if isinstance(url, str) and not url.startswith("data:") else None,
                 block=block, part=part)


def text_of(parts: list[Part] | None, sep: str = "") -> str | None:
    """The text parts joined; None when there is no text."""
    return sep.join(p.text for p in parts or () if type(p) is Text) or None


def tool_results(message: Message) -> list[ToolResult]:
    return [p for p in message.parts if type(p) is ToolResult]


def tool_calls(message: Message) -> list[ToolCall]:
    return [p for p in message.parts if type(p) is ToolCall]


SYSTEM_ROLES = ("system", "developer")
