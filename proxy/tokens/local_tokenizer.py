"""``--tokenizer PATH``: the model's tokenizer and chat template, loaded by tracetap itself.

For engines that return no token ids and cannot render a chat (llama-cpp-python), and
for engines that must not be asked anything while they stream. PATH is one of:

- a Hugging Face tokenizer directory (``tokenizer.json``, with the chat template in
  ``tokenizer_config.json``'s ``chat_template``, or ``chat_template.jinja`` /
  ``chat_template.json`` beside it);
- a ``tokenizer.json`` file (its ``tokenizer_config.json`` read from the same directory);
- the GGUF file the engine serves (proxy.tokens.gguf_tokenizer; best effort, see there).

It needs the optional ``tokenizers`` package (``pip install 'tracetap[tokenizer]'``),
imported only when ``--tokenizer`` is given. Nothing it gives
is kept unchecked: proxy.tokens.resolve accepts a prompt only when its length equals the
engine's ``usage.prompt_tokens``, a completion only when its pieces reproduce the
engine's own per-token strings one for one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tracetap.proxy.tokens.chat_template import ChatTemplate, TemplateError
from tracetap.proxy.tokens.engine_tokenizer import TokenizeFailed

INSTALL = "pip install 'tracetap[tokenizer]'"
log = logging.getLogger("tracetap.tokenizer")
# GPT-2's printable stand-ins for bytes (byte-level BPE vocabularies spell tokens in them).
_BYTE_CHARS = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]


def check(path: str) -> None:
    """Fail at start, with the flag's name, on a path or a package that is not there."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"--tokenizer {path}: no such file or directory")
    if p.is_dir() and not (p / "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer {path}: the directory has no tokenizer.json")
    _import("tokenizers")


def load(path: str) -> LocalTokenizer:
    local = _load(path)
    if local.template is None:
        log.warning("--tokenizer %s has no chat template (nor a chat_template.jinja beside "
                    "it): chat prompts get no ids (tokenize_failed)", path)
    return local


def _load(path: str) -> LocalTokenizer:
    check(path)
    p = Path(path)
    if p.suffix == ".gguf":
        from tracetap.proxy.tokens.gguf_tokenizer import read_gguf

        return LocalTokenizer(*read_gguf(p))
    from tokenizers import Tokenizer

    file = p / "tokenizer.json" if p.is_dir() else p
    config = _json(file.parent / "tokenizer_config.json")
    template = config.get("chat_template")
    if (file.parent / "chat_template.jinja").is_file():
        template = (file.parent / "chat_template.jinja").read_text()
    elif template is None and (file.parent / "chat_template.json").is_file():
        template = _json(file.parent / "chat_template.json").get("chat_template")
    tokenizer = Tokenizer.from_file(str(file))
    return LocalTokenizer(tokenizer, template, _token_text(config.get("bos_token")),
                          _token_text(config.get("eos_token")))


class LocalTokenizer:
    """Renders and tokenizes as the engine would; every method raises TokenizeFailed when
    it cannot say."""

    def __init__(self, tokenizer: Any, template: Any, bos_token: str = "", eos_token: str = ""):
        self.tokenizer = tokenizer
        self.template = (ChatTemplate(template, bos_token, eos_token)
                         if template else None)
        self._bytes = _piece_bytes(tokenizer)

    def chat_prompt(self, request: dict) -> list[int]:
        """The prompt ids of a chat request: the template's text, its special tokens
        parsed, nothing added (the template writes the BOS itself, as in HF)."""
        if self.template is None:
            raise TokenizeFailed("the tokenizer has no chat template")
        try:
            text = self.template.render(request)
        except TemplateError as exc:
            raise TokenizeFailed(str(exc)) from exc
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def prompt(self, text: str) -> list[int]:
        """A completions prompt, with what the tokenizer adds to one (BOS)."""
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def pieces(self, text: str) -> list[tuple[int, bytes | None]]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [(t, self._bytes(t)) for t in ids]


def _piece_bytes(tokenizer: Any):
    """id -> the bytes the token stands for (None: unknown), from the vocabulary: byte-level
    BPE spells bytes in GPT-2's stand-in characters; SentencePiece-like vocabularies use
    "▁" for a space and "<0xNN>" for a byte."""
    spec = json.loads(tokenizer.to_str())
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder")) or "ByteLevel" in json.dumps(
        spec.get("pre_tokenizer"))
    special = {t["id"]: t["content"].encode() for t in spec.get("added_tokens") or ()}
    stand_in = {chr(c): b for b, c in _byte_map().items()}

    def piece(token_id: int) -> bytes | None:
        if token_id in special:
            return special[token_id]
        text = tokenizer.id_to_token(token_id)
        if text is None:
            return None
        if byte_level:
            try:
                return bytes(stand_in[ch] for ch in text)
            except KeyError:
                return None
        if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            return bytes((int(text[3:5], 16),))
        return text.replace("\u2581", " ").encode()

    return piece


def _byte_map() -> dict[int, int]:
    """GPT-2's bytes_to_unicode: byte -> the code point that spells it."""
    mapping = {b: b for b in _BYTE_CHARS}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = 256 + extra
            extra += 1
    return mapping


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<bos>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--tokenizer: cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _import(name: str) -> None:
    try:
        __import__(name)
    except ImportError:
        raise ValueError(f"--tokenizer needs the {name!r} package: {INSTALL}") from None
