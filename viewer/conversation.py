"""A call's conversation as the harness sent it: messages, tool calls and tool results.

The stored request and response are the client's own (a translated call keeps its
Responses or Messages shape): its API's reader (``storage.conversation.Readers``, handed
to the app) reads them as a conversation, shown here turn by turn. Anything not
understood is shown as its JSON, never dropped; an image by its reference. Long texts
are cut for the page; the call page has the whole bodies.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tracetap.storage.conversation import (
    Image,
    Message,
    Other,
    Part,
    Readers,
    Reasoning,
    Text,
    ToolResult,
    json_object,
)
from tracetap.storage.conversation import (
    ToolCall as CalledTool,
)
from tracetap.viewer.images import MARK

TEXT_LIMIT = 20_000


class ToolCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # pretty JSON when it parses, else as sent
    id: str | None = None


class Turn(msgspec.Struct, kw_only=True):
    role: str  # system, user, assistant, tool, prompt, reply, other
    text: str = ""
    cut: int = 0  # characters left out of text
    tool_calls: list[ToolCall] = []
    tool_call_id: str | None = None  # a tool result: which call it answers
    reply: bool = False  # the model's reply to this request
    images: list[str] = []  # keys of the stored images its text names (viewer.images)


def turns(readers: Readers, endpoint: str, request: str | None,
          response: str | None) -> list[Turn]:
    sent = _json(request)
    read = readers.reader(endpoint)(sent if isinstance(sent, dict) else {},
                                    json_object(response))
    out = [_turn("prompt", _text(read.prompt))] if read.prompt is not None else []
    for message in read.messages or ():
        out += _message(message)
    for message in read.reply:
        for turn in _message(message):
            turn.reply = True
            out.append(turn)
    if request and not isinstance(sent, dict):  # not an object: shown as it was sent
        out.insert(0, _turn("other", request))
    return out


def _json(text: str | None) -> Any:
    if not text:
        return None
    try:
        return msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError):  # nested too deep to decode: no turns
        return None


def _message(m: Message) -> list[Turn]:
    """A message's turn (its text and tool calls), then one turn per tool result."""
    results = [p for p in m.parts if type(p) is ToolResult]
    said = [p for p in m.parts if type(p) is not ToolResult]
    calls = [ToolCall(name=str(p.name), arguments=_arguments(p.arguments), id=p.id)
             for p in said if type(p) is CalledTool]
    out = []
    if said or not results:
        out.append(_turn(m.role, _text([p for p in said if type(p) is not CalledTool]),
                         tool_calls=calls))
    out += [_turn("tool", _text(r.parts), tool_call_id=r.call_id) for r in results]
    return out


def _text(parts: list[Part] | None) -> str:
    return "\n".join(_part_text(p) for p in parts or ())


def _part_text(part: Part) -> str:
    if type(part) is Text:
        return part.text
    if type(part) is Reasoning:
        return f"[reasoning]\n{part.text}\n[/reasoning]"
    if type(part) is Image:  # a stored one by its key: the page shows its thumbnail
        shown = part.url or part.stored()
        return f"[image {shown}]" if shown else "[image]"  # [image]: bytes that do not decode
    if type(part) is ToolResult:
        return _text(part.parts)
    if type(part) is CalledTool:
        return pretty({"name": part.name, "arguments": part.arguments})
    if type(part) is Other and isinstance(part.value, str):
        return part.value
    return pretty(part.value if type(part) is Other else part)


def pretty(value: Any) -> str:
    return msgspec.json.format(msgspec.json.encode(value), indent=2).decode()


def _arguments(value: Any) -> str:
    if isinstance(value, str):
        try:
            return pretty(msgspec.json.decode(value))
        except msgspec.DecodeError:
            return value
    return pretty(value)


def _turn(role: str, text: str, **fields) -> Turn:
    cut = max(0, len(text) - TEXT_LIMIT)
    return Turn(role=str(role), text=text[:TEXT_LIMIT], cut=cut, images=MARK.findall(text),
                **fields)


def open_from(turns: list[Turn]) -> int:
    """Where the last turn starts: after the request's last assistant message (the tool
    results and user text the model answered, then its reply). The pages show the turns
    before it collapsed: a 30-turn call's 60 messages were 19,593 px of a 21,652-px page."""
    for i in range(len(turns) - 1, -1, -1):
        if turns[i].role == "assistant" and not turns[i].reply:
            # a request that ends with the assistant's words (a prefill) and no reply
            # still shows that message open
            return min(i + 1, len(turns) - 1)
    return 0


PREVIEW = 140  # characters of a collapsed turn's line


def preview(turn: Turn) -> str:
    """A collapsed turn's one line: the start of its text, else the tools it called."""
    line = " ".join(turn.text.split()[:60])
    if not line:
        line = ", ".join(f"{c.name}()" for c in turn.tool_calls)
    return line if len(line) <= PREVIEW else line[:PREVIEW - 1] + "\u2026"
