"""An engine's tokenize endpoints in-process, for proxy/tokens/engine_tokenizer.py and
proxy/tokens/resolve.py.

``TokenizeEngine`` stands where ``UpstreamClient`` does (its ``post_json``, and
``post_raw`` through it: a test that replaces ``post_json`` sees every question) and answers
the endpoints of one family as that engine does, with a tokenizer of one id per
character (``ord + 10``; BOS is 1): small enough that a test knows every id it expects.
It records every question (``asked``), and can be made to fail a path (``fail``), to be
down (status 0) or to have no tokenize endpoint at all.
"""

from __future__ import annotations

from typing import Any

import msgspec

BOS = 1
FAMILIES = ("llama-server", "vllm", "llama-cpp-python", "none", "down")


def ids_of(text: str, bos: bool = False) -> list[int]:
    return ([BOS] if bos else []) + [ord(c) + 10 for c in text]


def render(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The family's chat template: each message as ``<role>content``."""
    text = "".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages)
    return text + ("<assistant>" if add_generation_prompt else "")


class TokenizeEngine:
    def __init__(self, family: str = "vllm", fail: tuple[str, ...] = (),
                 pieces: dict[int, Any] | None = None):
        assert family in FAMILIES, family
        self.family = family
        self.fail = set(fail)
        self.pieces = pieces or {}  # id -> the piece answered instead of its character
        self.asked: list[tuple[str, str, dict]] = []  # (origin, path, body)

    async def post_json(self, url: str, body: dict, timeout: float = 10.0) -> tuple[int, Any]:
        rest = url.partition("://")[2].partition("/")[2]
        path = "/" + rest
        self.asked.append((url[:len(url) - len(path)], path, body))
        if self.family == "down":
            return 0, None
        if path in self.fail:
            return 500, {"error": "failed"}
        answer = getattr(self, "_" + self.family.replace("-", "_"))(path, body)
        return (404, None) if answer is None else (200, answer)

    async def post_raw(self, url: str, body: bytes, timeout: float = 10.0,
                       ) -> tuple[int, bytes | None]:
        status, answer = await self.post_json(url, msgspec.json.decode(body), timeout)
        return status, None if status == 0 else msgspec.json.encode(answer)

    def _piece(self, token_id: int) -> Any:
        return self.pieces.get(token_id, chr(token_id - 10))

    def _llama_server(self, path: str, body: dict) -> Any:
        if path == "/apply-template":
            return {"prompt": render(body["messages"], body.get("add_generation_prompt", True))}
        if path == "/tokenize":
            ids = ids_of(body["content"], bos=body.get("add_special", False))
            if body.get("with_pieces"):
                return {"tokens": [{"id": t, "piece": self._piece(t)} for t in ids]}
            return {"tokens": ids}
        return None

    def _vllm(self, path: str, body: dict) -> Any:
        if path == "/tokenize" and "messages" in body:
            text = render(body["messages"], body.get("add_generation_prompt", True))
            return {"tokens": ids_of(text, bos=True), "count": len(text) + 1}
        if path == "/tokenize":
            return {"tokens": ids_of(body["prompt"], bos=body.get("add_special_tokens", True))}
        if path == "/detokenize":
            return {"prompt": self._piece(body["tokens"][0])}
        return None

    def _llama_cpp_python(self, path: str, body: dict) -> Any:
        if path == "/extras/tokenize":
            return {"tokens": ids_of(body["input"], bos=True)}
        if path == "/extras/detokenize":
            return {"text": self._piece(body["tokens"][0])}
        return None

    def _none(self, path: str, body: dict) -> Any:
        return None
