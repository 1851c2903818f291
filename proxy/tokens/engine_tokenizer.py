"""The upstream engine's own tokenizer, over HTTP: which endpoints it has, and calls to them.

Three families, probed in this order (each probe is one small POST, once per upstream):

- ``llama-server`` (llama.cpp's C++ server): ``/apply-template`` renders a chat request
  with the model's template, ``/tokenize`` ``{content, add_special, parse_special,
  with_pieces}`` tokenizes text exactly as the server tokenizes a prompt.
- ``vllm`` (vLLM, SGLang): ``/tokenize`` ``{messages, tools, add_generation_prompt, ...}``
  renders and tokenizes a chat as the chat endpoint does; ``{prompt}`` tokenizes text;
  ``/detokenize`` ``{tokens}`` gives a token's text.
- ``llama-cpp-python``: ``/extras/tokenize`` ``{input}`` tokenizes text as a completions
  prompt (BOS included); ``/extras/detokenize``. It has no template endpoint, so a chat
  prompt cannot be tokenized by the engine itself. It also ends a streaming generation
  early (``[DONE]`` after the tokens so far) whenever another request waits for the model
  (its ``--interrupt_requests``, on by default): ``interrupts_streams`` tells the caller
  (proxy.tokens.resolve) to ask only while no call to it is in flight (proxy.upstream.traffic).
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import msgspec

from tracetap.proxy.apis.chat.prompt_cut import cut_member
from tracetap.proxy.upstream.client import UpstreamClient

# What a chat request may carry that changes how vLLM's /tokenize renders it.
_VLLM_CHAT_KEYS = ("model", "messages", "tools", "add_generation_prompt",
                   "continue_final_message", "add_special_tokens", "chat_template",
                   "chat_template_kwargs", "documents", "mm_processor_kwargs")
# Keys a chat request carries that only matter to generation, not to rendering.
_GENERATION_KEYS = frozenset({"stream", "stream_options", "logprobs", "top_logprobs", "n",
                              "return_token_ids", "max_tokens", "max_completion_tokens"})
PIECE_CACHE = 262_144  # ids; a vocabulary's worth


class TokenizeFailed(Exception):
    """The endpoint answered with an error, or not at all."""


class UnreadableRequest(Exception):
    """The recorded request is not a JSON object: there is nothing to render."""


class _VllmChatRender(msgspec.Struct, omit_defaults=True):
    """The members of a chat request that change how vLLM's /tokenize renders it, each
    kept as its bytes (``_VLLM_CHAT_KEYS``, in that order): a 70k-token conversation is
    passed on without being decoded into objects and encoded again."""

    model: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    messages: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    tools: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    add_generation_prompt: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    continue_final_message: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    add_special_tokens: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    chat_template: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    chat_template_kwargs: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    documents: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    mm_processor_kwargs: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


class _TokensAnswer(msgspec.Struct):
    """A /tokenize answer, its ids left as the engine's bytes (read in their new ids only
    by proxy.tokens.prompt_prefix)."""

    tokens: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


_read_render = msgspec.json.Decoder(_VllmChatRender).decode
_read_tokens = msgspec.json.Decoder(_TokensAnswer).decode
_read_object = msgspec.json.Decoder().decode


class NoChatTemplate(Exception):
    """The engine can tokenize text but cannot render a chat request."""


class EngineTokenizer:
    """One upstream's tokenizer endpoints. Subclasses implement one family."""

    kind = ""
    interrupts_streams = False  # asking it while a call streams would cut that stream

    def __init__(self, client: UpstreamClient, origin: str):
        self.client = client
        self.origin = origin
        self._pieces: dict[int, bytes | None] = {}
        self._limit = asyncio.Semaphore(16)

    async def post(self, path: str, body: dict) -> Any:
        status, data = await self.client.post_json(self.origin + path, body)
        if status != 200 or data is None:
            raise TokenizeFailed(f"POST {path} answered {status or 'nothing'}")
        return data

    async def chat_prompt(self, request: dict) -> list[int]:
        """The prompt ids of a chat-completions request, rendered by the engine."""
        raise NoChatTemplate

    async def chat_prompt_array(self, request: str) -> bytes | None:
        """The prompt ids of a chat request (its JSON text) as the engine's JSON array,
        unchecked (the caller decodes it); None where the family has no such answer
        (``chat_prompt`` then). Raises UnreadableRequest for a request that is not an
        object."""
        return None

    async def prompt(self, text: str) -> list[int]:
        """The ids of a completions prompt, as the engine tokenizes it (BOS and all)."""
        raise NotImplementedError

    async def pieces(self, text: str) -> list[tuple[int, bytes | None]]:
        """``text`` tokenized with nothing added, each id with its bytes (None: unknown)."""
        ids = await self.text_ids(text)
        # This text's pieces, taken before any await: the cache may start over meanwhile
        # (here or in another record's call), and must not lose the ones already known.
        pieces = {t: self._pieces[t] for t in dict.fromkeys(ids) if t in self._pieces}
        missing = [t for t in dict.fromkeys(ids) if t not in pieces]
        pieces.update(zip(missing, await asyncio.gather(*(self._piece(t) for t in missing))))
        if len(self._pieces) + len(missing) > PIECE_CACHE:
            self._pieces.clear()
        self._pieces.update(pieces)
        return [(t, pieces[t]) for t in ids]

    async def text_ids(self, text: str) -> list[int]:
        raise NotImplementedError

    async def _piece(self, token_id: int) -> bytes | None:
        async with self._limit:
            try:
                return await self.piece(token_id)
            except TokenizeFailed:
                return None

    async def piece(self, token_id: int) -> bytes | None:
        raise NotImplementedError


class LlamaServer(EngineTokenizer):
    kind = "llama-server"

    async def chat_prompt(self, request: dict) -> list[int]:
        body = {k: v for k, v in request.items() if k not in _GENERATION_KEYS}
        rendered = (await self.post("/apply-template", body)).get("prompt")
        if not isinstance(rendered, str):
            raise TokenizeFailed("POST /apply-template gave no prompt")
        return await self.prompt(rendered)

    async def prompt(self, text: str) -> list[int]:
        # The server tokenizes a prompt with special tokens added and parsed.
        data = await self.post("/tokenize", {"content": text, "add_special": True,
                                             "parse_special": True})
        return _ids(data.get("tokens"))

    async def pieces(self, text: str) -> list[tuple[int, bytes | None]]:
        data = await self.post("/tokenize", {"content": text, "add_special": False,
                                             "parse_special": True, "with_pieces": True})
        tokens = data.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, dict) for t in tokens):
            raise TokenizeFailed("POST /tokenize gave no pieces")
        return [(_id(t.get("id")), _piece_bytes(t.get("piece"))) for t in tokens]


class Vllm(EngineTokenizer):
    kind = "vllm"

    async def chat_prompt(self, request: dict) -> list[int]:
        body = {k: request[k] for k in _VLLM_CHAT_KEYS if k in request}
        return _ids((await self.post("/tokenize", body)).get("tokens"))

    async def chat_prompt_array(self, request: str) -> bytes | None:
        try:
            body = msgspec.json.encode(_read_render(request))
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise UnreadableRequest from None
        status, raw = await self.client.post_raw(self.origin + "/tokenize", body)
        if status != 200 or not raw or not raw.strip():
            raise TokenizeFailed(f"POST /tokenize answered {status or 'nothing'}")
        return _tokens_array(raw)

    async def prompt(self, text: str) -> list[int]:
        data = await self.post("/tokenize", {"prompt": text, "add_special_tokens": True})
        return _ids(data.get("tokens"))

    async def text_ids(self, text: str) -> list[int]:
        data = await self.post("/tokenize", {"prompt": text, "add_special_tokens": False})
        return _ids(data.get("tokens"))

    async def piece(self, token_id: int) -> bytes | None:
        data = await self.post("/detokenize", {"tokens": [token_id]})
        text = data.get("prompt")
        if text is None and data.get("text") == "":
            # SGLang (0.5.23 protocol.py ``DetokenizeResponse``): ``{text}``, special tokens
            # skipped unless told; told only SGLang (vLLM would warn of an unknown field).
            body = {"tokens": [token_id], "skip_special_tokens": False}
            data = await self.post("/detokenize", body)
        text = data.get("prompt", data.get("text"))
        return text.encode() if isinstance(text, str) else None


class LlamaCppPython(EngineTokenizer):
    kind = "llama-cpp-python"
    interrupts_streams = True

    def __init__(self, client: UpstreamClient, origin: str):
        super().__init__(client, origin)
        self._added: list[int] | None = None  # what /extras/tokenize puts before any text

    async def prompt(self, text: str) -> list[int]:
        return _ids((await self.post("/extras/tokenize", {"input": text})).get("tokens"))

    async def text_ids(self, text: str) -> list[int]:
        if self._added is None:
            self._added = await self.prompt("")
        ids = await self.prompt(text)
        if ids[:len(self._added)] != self._added:
            raise TokenizeFailed("POST /extras/tokenize did not start with its BOS")
        return ids[len(self._added):]

    async def piece(self, token_id: int) -> bytes | None:
        # The server decodes strictly: a token that is not UTF-8 alone is an error (None).
        text = (await self.post("/extras/detokenize", {"tokens": [token_id]})).get("text")
        return text.encode() if isinstance(text, str) else None


_PROBES = (
    (LlamaServer, "/apply-template", {"messages": [{"role": "user", "content": "hi"}]}, "prompt"),
    (Vllm, "/tokenize", {"prompt": "hi"}, "tokens"),
    (LlamaCppPython, "/extras/tokenize", {"input": "hi"}, "tokens"),
)


async def detect(client: UpstreamClient, base_url: str,
                 ) -> tuple[EngineTokenizer | None, bool]:
    """The tokenizer the upstream at ``base_url`` exposes, and whether it answered at all
    (an unreachable upstream is asked again later; one without endpoints is not).
    The caller asks only while no call to it is in flight: its kind is not known yet."""
    parts = urlsplit(base_url)
    origin = f"{parts.scheme}://{parts.netloc}"
    reached = False
    for kind, path, body, key in _PROBES:
        status, data = await client.post_json(origin + path, body, timeout=5.0)
        reached = reached or status != 0
        if status == 200 and isinstance(data, dict) and key in data:
            return kind(client, origin), True
    return None, reached


def _tokens_array(answer: bytes) -> bytes:
    """A /tokenize answer's ``tokens`` array, its bytes: cut out by a few byte searches
    (proxy.apis.chat.prompt_cut; skipping 70k ids with a decoder costs ~0.65 ms), the rest
    of the answer still read as JSON; any other shape is read whole."""
    cut = cut_member(answer, b'"tokens"')
    try:
        # the rest must be an object, and name no other "tokens" (a decoder keeps the last)
        if cut is not None and b'"tokens"' not in cut[0] and type(_read_object(cut[0])) is dict:
            return cut[1]
        tokens = _read_tokens(answer).tokens
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise TokenizeFailed("POST /tokenize answered 200") from None
    array = b"" if tokens is msgspec.UNSET else bytes(tokens)
    if not array.startswith(b"["):
        raise TokenizeFailed("no token list in the answer")
    return array


def _id(value: Any) -> int:
    if type(value) is not int:
        raise TokenizeFailed(f"not a token id: {value!r}")
    return value


def _ids(values: Any) -> list[int]:
    if not isinstance(values, list):
        raise TokenizeFailed("no token list in the answer")
    try:  # each an int (not a bool, float or string), checked in C: a prompt's 70k ids
        return msgspec.convert(values, list[int])
    except msgspec.ValidationError:
        return [_id(v) for v in values]  # raises, naming the first value that is not one


def _piece_bytes(piece: Any) -> bytes | None:
    """llama-server's piece: its text, or its bytes as a list when they are not UTF-8."""
    if isinstance(piece, str):
        return piece.encode()
    if isinstance(piece, list) and all(type(b) is int and 0 <= b < 256 for b in piece):
        return bytes(piece)
    return None
