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
"""

from __future__ import annotations

from collections.abc import Iterable
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


class _Body(msgspec.Struct):
    choices: list[_Choice] = []


_decode = msgspec.json.Decoder(_Body).decode


class CallExperts:
    """One call's routing, per choice, as its reply or stream events arrive."""

    def __init__(self) -> None:
        self._rows: dict[int, list[list[list[int]]]] = {}
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

    def stamp(self, choices: Iterable[ChoiceRecord]) -> None:
        for choice in choices:
            rows = self._rows.get(choice.index)
            if not rows:
                continue
            try:
                choice.routed_experts = pack(rows)
            except BadRouting as exc:
                self.errors.append(f"routed_experts not stored: {exc}")


def ask(request: CallRequest, api: WireApi, enabled: bool) -> CallExperts | None:
    """Ask for the routing when the proxy is configured to (--routed-experts; call after
    the API's prepare, before the body is encoded)."""
    if not enabled or not api.routed_experts:
        return None
    request.payload.setdefault(FIELD, True)
    request.injected.experts = True
    return CallExperts()
