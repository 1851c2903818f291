"""A call's conversation as the harness sent it: messages, tool calls and tool results.

The stored request and response are the client's own (a translated call keeps its
Responses or Messages shape), so each API family is read in its own shape. Anything not
understood is shown as its JSON, never dropped. Long texts are cut for the page; the call
page has the whole bodies.
"""

from __future__ import annotations

from typing import Any

import msgspec

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


def turns(endpoint: str, request: str | None, response: str | None) -> list[Turn]:
    family = endpoint.split(":", 1)[0]
    req, res = _json(request), _json(response)
    read = _READERS.get(family, _other)
    out = read(req if isinstance(req, dict) else {}, res if isinstance(res, dict) else {})
    if not isinstance(req, dict) and request:
        out.insert(0, _turn("other", request))
    return out


def _json(text: str | None) -> Any:
    if not text:
        return None
    try:
        return msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError):  # nested too deep to decode: no turns
        return None


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
            else:
                parts.append(pretty(part))
        return "\n".join(parts)
    return pretty(value)


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
    return Turn(role=str(role), text=text[:TEXT_LIMIT], cut=cut, **fields)


def _chat(req: dict, res: dict) -> list[Turn]:
    out = []
    for m in req.get("messages") or ():
        if not isinstance(m, dict):
            out.append(_turn("other", pretty(m)))
            continue
        out.append(_chat_message(m))
    for choice in res.get("choices") or ():
        message = choice.get("message") if isinstance(choice, dict) else None
        if isinstance(message, dict):
            turn = _chat_message(message)
            turn.reply = True
            out.append(turn)
    return out


def _chat_message(m: dict) -> Turn:
    calls = [ToolCall(name=str((c.get("function") or {}).get("name")),
                      arguments=_arguments((c.get("function") or {}).get("arguments")),
                      id=c.get("id"))
             for c in m.get("tool_calls") or () if isinstance(c, dict)]
    text = _text(m.get("content"))
    reasoning = m.get("reasoning_content") or m.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        text = f"[reasoning]\n{reasoning}\n[/reasoning]\n{text}"
    return _turn(m.get("role", "other"), text, tool_calls=calls,
                 tool_call_id=m.get("tool_call_id"))


def _completions(req: dict, res: dict) -> list[Turn]:
    out = [_turn("prompt", _text(req.get("prompt")))]
    for choice in res.get("choices") or ():
        if isinstance(choice, dict):
            out.append(_turn("reply", _text(choice.get("text")), reply=True))
    return out


def _responses(req: dict, res: dict) -> list[Turn]:
    out = []
    if req.get("instructions"):
        out.append(_turn("system", _text(req["instructions"])))
    items = req.get("input")
    if isinstance(items, str):
        out.append(_turn("user", items))
    else:
        out += [_response_item(i) for i in items or ()]
    for item in res.get("output") or ():
        turn = _response_item(item)
        turn.reply = True
        out.append(turn)
    return out


def _response_item(item: Any) -> Turn:
    if not isinstance(item, dict):
        return _turn("other", pretty(item))
    kind = item.get("type", "message")
    if kind == "function_call":
        return _turn("assistant", "", tool_calls=[ToolCall(
            name=str(item.get("name")), arguments=_arguments(item.get("arguments")),
            id=item.get("call_id"))])
    if kind == "function_call_output":
        return _turn("tool", _text(item.get("output")), tool_call_id=item.get("call_id"))
    if kind == "reasoning":
        summary = _text(item.get("summary") or item.get("content"))
        return _turn("assistant", f"[reasoning]\n{summary}")
    if kind == "message":
        return _turn(item.get("role", "other"), _text(item.get("content")))
    return _turn("other", pretty(item))


def _messages(req: dict, res: dict) -> list[Turn]:
    out = []
    if req.get("system"):
        out.append(_turn("system", _text(req["system"])))
    for m in req.get("messages") or ():
        out += _anthropic_message(m) if isinstance(m, dict) else [_turn("other", pretty(m))]
    if res.get("content") is not None:
        for turn in _anthropic_message({"role": res.get("role", "assistant"),
                                        "content": res["content"]}):
            turn.reply = True
            out.append(turn)
    return out


def _anthropic_message(m: dict) -> list[Turn]:
    role, content = m.get("role", "other"), m.get("content")
    if not isinstance(content, list):
        return [_turn(role, _text(content))]
    out, texts, calls = [], [], []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "thinking":
            texts.append(f"[thinking]\n{block.get('thinking', '')}\n[/thinking]")
        elif kind == "tool_use":
            calls.append(ToolCall(name=str(block.get("name")),
                                  arguments=_arguments(block.get("input")), id=block.get("id")))
        elif kind == "tool_result":
            out.append(_turn("tool", _text(block.get("content")),
                             tool_call_id=block.get("tool_use_id")))
        else:
            texts.append(pretty(block))
    if texts or calls:
        out.insert(0, _turn(role, "\n".join(texts), tool_calls=calls))
    return out


def _other(req: dict, res: dict) -> list[Turn]:
    out = [_turn("other", pretty(req))] if req else []
    if res:
        out.append(_turn("reply", pretty(res), reply=True))
    return out


_READERS = {"chat.completions": _chat, "completions": _completions, "responses": _responses,
            "messages": _messages}


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
