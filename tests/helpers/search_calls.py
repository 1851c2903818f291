"""The search tests' calls (test_search*.py): chat records of a two-turn coding
conversation, and the episodes a query finds, found both ways the viewer can."""

from __future__ import annotations

import json

from tracetap.storage import browse, search
from tracetap.storage.records import CallRecord, ChoiceRecord
from tracetap.viewer.search import Where, conditions

T0 = 1_700_000_000.0


def chat(call_id: str, episode: str | None, messages: list[dict], answer: str, *,
         model: str = "m1", policy: str | None = None, error: str | None = None,
         t: float = T0) -> CallRecord:
    choices = [] if error else [ChoiceRecord(index=0, finish_reason="stop", text=answer,
                                             token_source="engine")]
    return CallRecord(call_id=call_id, episode_id=episode, endpoint="chat.completions",
                      t_start=t, t_end=t + 1, status="ok" if not error else "upstream_error",
                      http_status=200 if not error else 500, instance="i", model=model,
                      policy_version=policy, error=error, choices=choices,
                      request=json.dumps({"model": model, "messages": messages}))


SYSTEM = {"role": "system", "content": "You are a careful agent. Zebracorn rules apply."}


def conversation(episode: str, observation: str, **kw) -> list[CallRecord]:
    first = [SYSTEM, {"role": "user", "content": "fix the failing test"}]
    second = [*first, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "shell",
                                                      "arguments": '{"cmd": "pytest -x"}'}}]},
              {"role": "tool", "tool_call_id": "t1", "content": observation}]
    return [chat(f"{episode}-0", episode, first, "let me run the tests", **kw),
            chat(f"{episode}-1", episode, second, "done", t=T0 + 2, **kw)]


NOWHERE = Where()


async def matching(engine, text: str | None, where: Where = NOWHERE) -> list[str]:
    """The matching episodes, found both ways: through the subquery, and with each term's
    episodes looked up first (search.resolved_conditions); the two must agree."""
    terms = search.parse_terms(text) if text else None
    query = browse.EpisodeQuery(sort="id", descending=False)
    found = await browse.episode_page(
        engine, query, extra=conditions(engine.dialect.name, terms, where), count_cap=1000)
    if terms is not None:
        resolved = await browse.episode_page(
            engine, query, count_cap=1000, extra=conditions(
                engine.dialect.name, terms, where, await search.resolved_conditions(
                    engine, terms)))
        assert [r.id for r in resolved.rows] == [r.id for r in found.rows]
        assert resolved.total == found.total
    return [r.id for r in found.rows]


async def index_nothing(*_args) -> None:
    return None
