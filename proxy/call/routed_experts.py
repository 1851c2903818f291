"""Routed experts for MoE router replay (``--routed-experts``): asked for, kept from the
agent, stored with each choice.

With the option the proxy adds ``return_routed_experts: true`` to chat and completions
requests (SGLang's per-request switch; vLLM returns them for every request when served
with ``--enable-return-routed-experts`` and has no per-request switch). Each choice's
``routed_experts`` (``[tokens][layers][top_k]`` expert ids, aligned with its completion
tokens) is collected from the reply or from every stream event, packed
(storage.experts) onto the choice's record, and removed, with the response's
``prompt_routed_experts``, from what the agent receives (proxy.inject strips them).
Prompt routing is not stored: it is the routing of tokens the previous turns already
recorded as completions, or of observations the trainer recomputes.

SGLang (0.5.23) answers once per request, in ``sglext.routed_experts``: base64 of int32
ids, one row per position that went through the model (the prompt, then the output less
its last token, which was sampled but never fed back), and no shape. The rows after the
prompt are the completion's, kept for a request with one choice (SGLang sends the first
choice's only); with no shape given, each is stored as one layer of ``layers * top_k``
ids, layer by layer, which the trainer reshapes with its model's ``num_experts_per_tok``.
The completion's last token has no routing. The last ``sglext`` seen wins: a stream
continued after a weight sync (proxy.call.continuation) ends with the whole sequence's.
"""

from __future__ import annotations

import base64
import binascii
import sys
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from tracetap.storage.experts import BadRouting, pack
from tracetap.storage.records import ChoiceRecord

if TYPE_CHECKING:
    from tracetap.proxy.apis import WireApi
    from tracetap.proxy.call.request import CallRequest

FIELD = "return_routed_experts"


class _Choice(msgspec.Struct):
    index: int = 0
    routed_experts: list[list[list[int]]] | None = None


class _Ext(msgspec.Struct):
    routed_experts: str | None = None
    input_ids: list[int] | None = None
    output_ids: list[list[int]] | None = None


class _Body(msgspec.Struct):
    choices: list[_Choice] = []
    sglext: _Ext | None = None


_decode = msgspec.json.Decoder(_Body).decode


class CallExperts:
    """One call's routing, per choice, as its reply or stream events arrive."""

    def __init__(self) -> None:
        self._rows: dict[int, list[list[list[int]]]] = {}
        self._flat: str | None = None  # SGLang's, for the whole sequence
        self._width: int | None = None  # its ids per position, once an sglext told it
        self.errors: list[str] = []

    def add(self, data: bytes) -> None:
        """A reply body or one stream event's data."""
        if b'"routed_experts"' not in data:
            return
        try:
            body = _decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.errors.append(f"unreadable routed_experts: {exc}")
            return
        for choice in body.choices:
            if choice.routed_experts:
                self._rows.setdefault(choice.index, []).extend(choice.routed_experts)
        ext = body.sglext
        if ext is not None and ext.routed_experts:
            self._flat = ext.routed_experts
            if ext.input_ids is not None and ext.output_ids and len(ext.output_ids) == 1:
                self._width = _width(ext.routed_experts,
                                     len(ext.input_ids) + len(ext.output_ids[0]) - 1)

    def stamp(self, choices: Sequence[ChoiceRecord], prompt_ids: Sequence[int] | None) -> None:
        if self._flat is not None:
            self._stamp_flat(choices, prompt_ids)
        for choice in choices:
            rows = self._rows.get(choice.index)
            if not rows:
                continue
            try:
                choice.routed_experts = pack(rows)
            except BadRouting as exc:
                self.errors.append(f"routed_experts not stored: {exc}")

    def _stamp_flat(self, choices: Sequence[ChoiceRecord],
                    prompt_ids: Sequence[int] | None) -> None:
        """SGLang's flat routing: the completion's rows (module doc)."""
        if len(choices) != 1 or prompt_ids is None:
            self.errors.append("routed_experts not stored: SGLang's routing needs one choice "
                               "and the prompt's ids")
            return
        [choice] = choices
        try:
            ids = _int32(self._flat or "")
        except (binascii.Error, ValueError) as exc:
            self.errors.append(f"unreadable routed_experts: {exc}")
            return
        positions = len(prompt_ids) + len(choice.completion_ids or ()) - 1
        width, rest = divmod(len(ids), positions) if positions > 0 else (0, 1)
        if rest or not width or self._width not in (None, width):
            self.errors.append(f"routed_experts not stored: {len(ids)} ids for {positions} "
                               "positions")
            return
        start = len(prompt_ids) * width
        rows = [[list(ids[i:i + width])] for i in range(start, len(ids), width)]
        try:
            choice.routed_experts = pack(rows) if rows else None
        except BadRouting as exc:  # an id beyond int16
            self.errors.append(f"routed_experts not stored: {exc}")


def _width(text: str, positions: int) -> int | None:
    """Ids per position of SGLang's routing whose positions its own ids give (the shape
    no field says), from the base64's length; None when they do not divide."""
    size = len(text) // 4 * 3 - text[-2:].count("=")
    width, rest = divmod(size // 4, positions) if positions > 0 and size % 4 == 0 else (0, 1)
    return width if width and not rest else None


def _int32(text: str) -> array:
    raw = base64.b64decode(text, validate=True)
    ids = array("i")
    if ids.itemsize != 4 or len(raw) % 4:
        raise ValueError("not int32 ids")
    ids.frombytes(raw)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids


def ask(request: CallRequest, api: WireApi, enabled: bool) -> CallExperts | None:
    """Ask for the routing when the proxy is configured to (--routed-experts; call after
    the API's prepare, before the body is encoded)."""
    if not enabled or not api.routed_experts:
        return None
    request.payload.setdefault(FIELD, True)
    request.injected.experts = True
    return CallExperts()
