"""The agentic replay's sessions, shared by its engine and its load generator.

A session is a system prompt (shared by every session, as a GRPO group's is) and
``turns`` turns; each turn adds a tool result of ``tool`` tokens and the engine streams
``out`` tokens. Everything is a pure function of the sizes and the session number, so the
engine (one process) and the load generator (another) agree on every token without
talking: the load generator sends the text, the engine answers with the ids.

A token's text is `` w<id>`` (every 16th completion token `` wé<id>``, so the engine's
JSON carries ``\\u00e9`` escapes a re-encoding proxy would change).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import cached_property

MODEL = "agentic-model"
CREATED = 1_700_000_000
VOCAB = 151_000


@dataclass(frozen=True)
class Sizes:
    sessions: int = 8
    turns: int = 30
    tool: int = 2000  # tokens of each turn's tool result
    out: int = 400  # tokens streamed each turn
    system: int = 1000  # tokens of the shared system prompt

    def context(self, turn: int) -> int:
        """Prompt tokens of ``turn`` (0-based)."""
        return self.system + turn * (self.tool + self.out) + self.tool

    def unique_tokens(self, sessions: int, turns: int | None = None) -> int:
        """Distinct tokens of ``sessions`` sessions of ``turns`` turns (the system prompt
        once, as the sessions share it)."""
        turns = self.turns if turns is None else turns
        return self.system + sessions * turns * (self.tool + self.out)


def _ids(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(1000, VOCAB) for _ in range(n)]


def token_text(token: int, completion: bool, position: int) -> str:
    return f" wé{token}" if completion and position % 16 == 0 else f" w{token}"


def marker(session: int, turn: int) -> str:
    """Starts each tool result: the engine finds the turn by it without decoding."""
    return f"[agentic s={session} t={turn}]"


class Session:
    """One session's tokens: the system prompt, then per turn the tool result and the
    completion."""

    def __init__(self, sizes: Sizes, number: int):
        self.sizes = sizes
        self.number = number
        self.system = _ids(0, sizes.system)
        self.tools = [_ids((number + 1) * 100_003 + 2 * t, sizes.tool) for t in range(sizes.turns)]
        self.outs = [_ids((number + 1) * 100_003 + 2 * t + 1, sizes.out)
                     for t in range(sizes.turns)]

    def prompt_ids(self, turn: int) -> list[int]:
        ids = list(self.system)
        for t in range(turn):
            ids += self.tools[t] + self.outs[t]
        return ids + self.tools[turn]

    @cached_property
    def ids_json(self) -> tuple[bytes, list[int]]:
        """All the session's ids as JSON array items, and where each turn's prompt ends:
        ``blob[:ends[t]]`` is turn t's ``prompt_token_ids`` without brackets, so the
        engine's cost for them is one copy, whatever the context."""
        parts, ends, length = [], [], 0
        segments = [self.system] + [ids for t in range(self.sizes.turns)
                                    for ids in (self.tools[t], self.outs[t])]
        for i, ids in enumerate(segments):
            if ids:
                piece = ("," if length else "").encode() + ",".join(map(str, ids)).encode()
                parts.append(piece)
                length += len(piece)
            if i % 2 == 1:  # a tool result: a turn's prompt ends here
                ends.append(length)
        return b"".join(parts), ends

    def system_message(self) -> dict:
        return {"role": "system",
                "content": "".join(token_text(t, False, i) for i, t in enumerate(self.system))}

    def tool_message(self, turn: int) -> dict:
        text = "".join(token_text(t, False, i) for i, t in enumerate(self.tools[turn]))
        return {"role": "user", "content": marker(self.number, turn) + text}

    def completion_text(self, turn: int) -> list[str]:
        return [token_text(t, True, i) for i, t in enumerate(self.outs[turn])]

    def assistant_message(self, turn: int) -> dict:
        return {"role": "assistant", "content": "".join(self.completion_text(turn))}

    def logprobs(self, turn: int) -> list[float]:
        rnd = random.Random(self.number * 7919 + turn)
        return [-round(rnd.random() * 4, 6) for _ in range(self.sizes.out)]


def encode(value) -> bytes:
    """JSON as the engine writes it (the standard library, non-ASCII escaped)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True).encode()
