"""Deterministic completions for the mock engine: text answers, tool calls and logprobs.

Everything is a pure function of (prompt ids, choice index, seed): the same request always
yields the same tokens, the same stream events and the same logprob values.
"""

from __future__ import annotations

import codecs
import hashlib
import random
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tracetap.demo import tokenizer as tok

TOP_LOGPROBS_MAX = 20
ARGS_TOKENS_PER_EVENT = 4
_ALT_IDS = tuple(range(32, 127))  # printable ASCII: alternatives never collide as strings
# fmt: off
_WORDS = (
    "amber", "answer", "bright", "careful", "circuit", "cloud", "echo", "engine", "forest",
    "garden", "gentle", "harbor", "lantern", "little", "model", "morning", "north", "orange",
    "paper", "patient", "quiet", "reason", "river", "signal", "silver", "simple", "steady",
    "stone", "the", "token", "travel", "window",
)
# fmt: on

EventKind = Literal["content", "tool_head", "tool_args", "hidden"]


@dataclass(frozen=True)
class Sampling:
    """The request parameters that shape a completion."""

    max_tokens: int
    seed: int = 0
    stop: tuple[str, ...] = ()
    forced_tokens: int | None = None  # mock_completion_tokens
    content: str | None = None  # mock_content: this exact text, one byte token per byte
    bad_tool_args: float = 0.0  # the fraction of tool calls whose arguments break the schema


@dataclass(frozen=True)
class Event:
    """One streamed step: the tokens it carries and what they add to the message."""

    start: int  # position of the first token within the completion
    ids: list[int]
    kind: EventKind
    text: str = ""  # content text, or a fragment of tool-call arguments
    tool_index: int = 0


@dataclass
class Completion:
    key: bytes
    token_ids: list[int]
    events: list[Event]
    finish_reason: str
    stop_reason: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class LogprobRow:
    logprob: float
    top: list[tuple[int, float]]  # (id, logprob) best first; the sampled token where it ranks


def choice_key(prompt_ids: Sequence[int], index: int, seed: int) -> bytes:
    digest = hashlib.blake2b(array("I", prompt_ids).tobytes(), digest_size=16)
    digest.update(f"|{index}|{seed}".encode())
    return digest.digest()


def logprob_rows(key: bytes, token_ids: Sequence[int], start: int, k: int) -> list[LogprobRow]:
    """Logprobs of completion tokens with the top ``k`` alternatives.

    Seeded by position, and slot by slot, so a stream slice equals the same span of the
    whole response and a smaller ``k`` gives a prefix of a larger one.
    """
    rows, base = [], int.from_bytes(key, "little")
    for pos, token_id in enumerate(token_ids, start):
        rng = random.Random(base + (pos << 128))
        rank = 0 if rng.random() < 0.75 else rng.randint(1, 4)  # the sampled token's rank
        top, seen, value = [], {token_id}, -rng.random() * 0.4
        for slot in range(max(k, rank + 1)):
            alt = token_id
            while slot != rank and alt in seen:
                alt = rng.choice(_ALT_IDS)
            seen.add(alt)
            top.append((alt, value))
            value -= rng.random() * 1.5 + 1e-3
        rows.append(LogprobRow(top[rank][1], top[:k]))
    return rows


def _sentence(rng: random.Random) -> str:
    text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 9)))
    return text[0].upper() + text[1:] + "."


def _content_events(ids: Sequence[int], start: int = 0) -> list[Event]:
    """One event per token; the incremental decoder holds back split UTF-8 characters."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return [
        Event(pos, [token_id], "content", decoder.decode(tok.token_bytes(token_id)))
        for pos, token_id in enumerate(ids, start)
    ]


def _visible(events: Sequence[Event]) -> str:
    return "".join(e.text for e in events if e.kind == "content")


def _text_completion(key: bytes, rng: random.Random, sampling: Sampling) -> Completion:
    text = " ".join(_sentence(rng) for _ in range(rng.randint(1, 2)))
    forced, finish = sampling.forced_tokens, "stop"
    while forced is not None and len(text) < forced:  # ASCII text: one token per character
        text += " " + _sentence(rng)
    if forced is None:
        ids = [*tok.encode(text), tok.EOS]
    elif forced >= sampling.max_tokens:
        ids, finish = tok.encode(text)[: sampling.max_tokens], "length"
    else:
        ids = [*tok.encode(text)[: max(forced - 1, 0)], tok.EOS]
    if len(ids) > sampling.max_tokens:
        ids, finish = ids[: sampling.max_tokens], "length"
    body = ids[:-1] if ids and ids[-1] == tok.EOS else ids
    visible = tok.decode(body)
    hits = [(visible.find(s), s) for s in sampling.stop if s and s in visible]
    if hits:  # like vLLM: the stop string's tokens stay in token_ids, not in the text
        pos, stop = min(hits)
        shown, ids = tok.encode(visible[:pos]), tok.encode(visible[: pos + len(stop)])
        events = _content_events(shown)
        if len(ids) > len(shown):
            events.append(Event(len(shown), ids[len(shown) :], "hidden"))
        return Completion(key, ids, events, "stop", stop, _visible(events))
    events = _content_events(body)
    if len(ids) > len(body):
        events.append(Event(len(body), ids[len(body) :], "hidden"))
    return Completion(key, ids, events, finish, None, _visible(events))


def schema_value(schema: Any, rng: random.Random, depth: int = 0) -> Any:
    """A value valid for a JSON schema's common subset: every required property, each
    optional one half the time, the declared type, enum and bounds; deterministic in
    ``rng``. Unknown or empty schemas give a short string."""
    if not isinstance(schema, Mapping):
        return rng.choice(_WORDS)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return rng.choice(schema["enum"])
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return schema_value(options[0], rng, depth)
    kind = _schema_type(schema)
    if kind == "object":
        return _object_value(schema, rng, depth)
    if kind == "array":
        low = max(int(schema.get("minItems", 1)), 0)
        high = max(low, min(int(schema.get("maxItems", low + 1)), low + 2))
        items = schema.get("items")
        return [schema_value(items, rng, depth + 1) for _ in range(rng.randint(low, high))]
    return _scalar_value(schema, kind, rng)


def _schema_type(schema: Mapping) -> Any:
    """The type a value is made for: the first non-null one of a list; an object when
    the schema only lists properties."""
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None and isinstance(schema.get("properties"), Mapping):
        kind = "object"
    return kind


def _object_value(schema: Mapping, rng: random.Random, depth: int) -> dict[str, Any]:
    """Every required property; each optional one half the time (from depth 3 on, none)."""
    properties = schema.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    required = set(schema.get("required") or ())
    return {
        name: schema_value(sub, rng, depth + 1)
        for name, sub in properties.items()
        if name in required or (depth < 3 and rng.random() < 0.5)
    }


def _scalar_value(schema: Mapping, kind: Any, rng: random.Random) -> Any:
    """A number within the schema's bounds, a boolean, null, or (any other type) a word."""
    if kind == "integer":
        low = int(schema.get("minimum", 1))
        return rng.randint(low, max(low, int(schema.get("maximum", low + 8))))
    if kind == "number":
        low = float(schema.get("minimum", 0.0))
        return round(rng.uniform(low, max(low, float(schema.get("maximum", low + 10.0)))), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return rng.choice(_WORDS)


def _fixed_completion(key: bytes, sampling: Sampling, content: str) -> Completion:
    """Exactly ``content``, sampled byte by byte: a special token's string stays bytes."""
    ids, finish = [*content.encode("utf-8"), tok.EOS], "stop"
    if len(ids) > sampling.max_tokens:
        ids, finish = ids[: sampling.max_tokens], "length"
    body = ids[:-1] if ids[-1] == tok.EOS else ids
    events = _content_events(body)
    if len(ids) > len(body):
        events.append(Event(len(body), ids[len(body) :], "hidden"))
    return Completion(key, ids, events, finish, None, _visible(events))


def _tool_completion(
    key: bytes, rng: random.Random, sampling: Sampling, name: str, parameters: Any,
    preface_rate: float = 0.5,
) -> Completion:
    preface = _sentence(rng) + "\n" if rng.random() < preface_rate else ""
    # Tool arguments are always a JSON object, whatever the schema leaves unsaid.
    schema = {"type": "object", **parameters} if isinstance(parameters, Mapping) else {}
    value = schema_value(schema or {"type": "object"}, rng)
    if bad_arguments(key, sampling.bad_tool_args):
        value = broken(value, schema)
    arguments = tok.canonical_json(value)
    call_id = f"chatcmpl-tool-{rng.getrandbits(128):032x}"
    head, args, tail = (tok.encode(part) for part in tok.tool_call_parts(name, arguments))
    pre = tok.encode(preface)
    ids = [*pre, *head, *args, *tail, tok.EOS]
    if len(ids) > sampling.max_tokens:  # a cut-off call is plain text, as a parser would see it
        ids = ids[: sampling.max_tokens]
        events = _content_events(ids)
        return Completion(key, ids, events, "length", None, _visible(events))
    events = _content_events(pre)
    pos = len(pre)
    events.append(Event(pos, head, "tool_head"))
    pos += len(head)
    for i in range(0, len(args), ARGS_TOKENS_PER_EVENT):
        chunk = args[i : i + ARGS_TOKENS_PER_EVENT]
        events.append(Event(pos, chunk, "tool_args", tok.decode(chunk)))
        pos += len(chunk)
    events.append(Event(pos, [*tail, tok.EOS], "hidden"))
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return Completion(key, ids, events, "tool_calls", None, preface or None, [call])


def bad_arguments(key: bytes, fraction: float) -> bool:
    """Whether this choice's tool call gets invalid arguments: seeded by the choice, drawn
    apart from everything else, so the valid calls are the ones the engine made anyway."""
    return fraction > 0 and random.Random(key + b"|bad-args").random() < fraction


def broken(value: Any, schema: Mapping[str, Any]) -> Any:
    """Arguments that break the schema: the first required property of another type (a
    word for a number, a number for a string), or a bare string when nothing is required."""
    required = [n for n in schema.get("required") or () if isinstance(value, dict) and n in value]
    if not required:
        return "invalid"
    name = required[0]
    kind = ((schema.get("properties") or {}).get(name) or {}).get("type")
    return {**value, name: 7 if kind == "string" else "seven"}


def _tool(tools: Sequence[Any] | None, tool_choice: Any) -> tuple[str, Any] | None:
    """The tool to call (its name and parameters schema): the chosen one, else the first."""
    if not tools or tool_choice == "none":
        return None
    functions = [t.get("function") or {} for t in tools if isinstance(t, Mapping)]
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name")
        if name:
            chosen = next((f for f in functions if f.get("name") == name), {})
            return str(name), chosen.get("parameters")
    first = functions[0] if functions else {}
    return str(first.get("name", "tool")), first.get("parameters")


def generate_chat(
    prompt_ids: Sequence[int],
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None,
    tool_choice: Any,
    index: int,
    sampling: Sampling,
    tool_rounds: int,
    preface: float = 0.5,
) -> Completion:
    """A tool call while fewer than ``tool_rounds`` tool results are in the conversation;
    ``preface`` of them with a sentence before the call (0: bare calls, the case where a
    native Responses reply has nowhere to put logprobs)."""
    key = choice_key(prompt_ids, index, sampling.seed)
    rng = random.Random(key)
    if sampling.content is not None:
        return _fixed_completion(key, sampling, sampling.content)
    tool = _tool(tools, tool_choice)
    done = sum(1 for m in messages if m.get("role") == "tool")
    if tool is not None and done < tool_rounds and sampling.forced_tokens is None:
        return _tool_completion(key, rng, sampling, *tool, preface)
    return _text_completion(key, rng, sampling)


def generate_text(prompt_ids: Sequence[int], index: int, sampling: Sampling) -> Completion:
    key = choice_key(prompt_ids, index, sampling.seed)
    if sampling.content is not None:
        return _fixed_completion(key, sampling, sampling.content)
    return _text_completion(key, random.Random(key), sampling)
