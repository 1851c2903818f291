"""A ``tokenizers`` tokenizer and chat template read from a GGUF file's metadata.

Best effort, checked on every use (proxy.tokens.resolve verifies each result against the
engine). Two vocabulary kinds are built:

- ``llama`` (SentencePiece, as Gemma and Llama 2 ship): llama.cpp merges the adjacent
  pair whose joined piece has the highest score, with bytes as ``<0xNN>`` tokens when no
  piece fits; that is BPE with one merge per (left, right) split of each piece, ranked by
  the piece's score, and byte fallback. Spaces are "▁"; a leading one is added when
  ``tokenizer.ggml.add_space_prefix`` says so.
- ``gpt2`` (byte-level BPE with its merges): GPT-2's pre-tokenizer; models whose
  ``tokenizer.ggml.pre`` splits text otherwise (Llama 3, Qwen) may not match, and the
  checks then keep their ids out.

Control and user-defined tokens are special (matched whole in text, as llama.cpp parses
special tokens in a prompt). The chat template is ``tokenizer.chat_template``; a GGUF
without one (some conversions drop it) takes ``chat_template.jinja`` from beside the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tracetap.proxy.tokens.gguf_metadata import read_metadata

_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


def read_gguf(path: Path) -> tuple[Any, str | None, str, str]:
    """(tokenizer, chat template, BOS text, EOS text) of the GGUF at ``path``."""
    metadata = read_metadata(path)

    def field(key: str, default: Any = None) -> Any:
        return metadata.get(key, default)

    tokens: list[str] = field("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError(f"--tokenizer {path}: the GGUF has no tokenizer.ggml.tokens")
    kinds: list[int] = field("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    model = field("tokenizer.ggml.model", "llama")
    bos, eos = field("tokenizer.ggml.bos_token_id"), field("tokenizer.ggml.eos_token_id")
    add_bos = bool(field("tokenizer.ggml.add_bos_token", model == "llama"))
    if model == "llama":
        tokenizer = _sentencepiece(tokens, field("tokenizer.ggml.scores") or [], kinds,
                                   bool(field("tokenizer.ggml.add_space_prefix", True)))
    elif model == "gpt2":
        tokenizer = _byte_level(tokens, field("tokenizer.ggml.merges") or [], kinds)
    else:
        raise ValueError(f"--tokenizer {path}: GGUF tokenizer model {model!r} is not "
                         "supported (llama and gpt2 are); pass the model's tokenizer.json")
    if add_bos and bos is not None:
        from tokenizers.processors import TemplateProcessing

        tokenizer.post_processor = TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
            special_tokens=[(tokens[bos], bos)])
    def text(i: int | None) -> str:
        return tokens[i] if i is not None and 0 <= i < len(tokens) else ""

    template = field("tokenizer.chat_template")
    beside = path.parent / "chat_template.jinja"
    if template is None and beside.is_file():
        template = beside.read_text()
    return tokenizer, template, text(bos), text(eos)


def _special(tokenizer: Any, tokens: list[str], kinds: list[int]) -> Any:
    from tokenizers import AddedToken

    tokenizer.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, kinds) if kind in (_CONTROL, _USER_DEFINED) and t])
    return tokenizer


def _sentencepiece(tokens: list[str], scores: list[float], kinds: list[int],
                   space_prefix: bool) -> Any:
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    vocab = {t: i for i, t in enumerate(tokens)}
    scores = [*scores, *[0.0] * (len(tokens) - len(scores))]
    ranked = []
    for piece, i in vocab.items():
        if kinds[i] != _NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, vocab[left], vocab[right], left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]
    unk = next((t for t, k in zip(tokens, kinds) if k == 2), None)  # UNKNOWN
    tokenizer = Tokenizer(BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Replace(" ", "\u2581")]
    if space_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "),
                                           decoders.ByteFallback(), decoders.Fuse()])
    return _special(tokenizer, tokens, kinds)


def _byte_level(tokens: list[str], merges: list[str], kinds: list[int]) -> Any:
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges if " " in m]
    tokenizer = Tokenizer(BPE(vocab, pairs))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return _special(tokenizer, tokens, kinds)
