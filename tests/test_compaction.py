"""Compacted conversations export as linked segments (exporters.compaction): scripted
through the proxy with the real SDKs, and the text matching on the harnesses' shapes."""

from __future__ import annotations

import json

import anthropic
import openai
import pyarrow.parquet as pq
from helpers.http import finish, register

from tracetap.exporters import export
from tracetap.exporters.compaction import _sampled, find
from tracetap.proxy.apis.registry import readers
from tracetap.proxy.episodes.lineage import conversation

SYSTEM = "You are a careful agent. Use the tool, then answer."
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
ASK_SUMMARY = "Summarise the conversation so far inside <summary></summary> tags."
# The engine writes a summary this long (it is sampled text like any other reply).
SUMMARY_TOKENS = {"mock_completion_tokens": 90}


def _exported(proxy, episode, tmp_path):
    finish(proxy, episode)
    summary = export(proxy.settings.db, tmp_path / "out", episodes=[episode])
    rows = pq.read_table(tmp_path / "out" / "trajectories").to_pylist()
    calls = pq.read_table(tmp_path / "out" / "calls").to_pylist()
    return summary, rows, calls


def assert_trained_once(rows, calls):
    """Every sampled token is trainable in exactly one row (a row's response is, per
    call of its path, the observation since the previous call, then its completion)."""
    by_id = {c["call_id"]: c for c in calls}
    trained: dict[str, int] = {}
    for row in rows:
        at, end = 0, len(row["prompt_ids"])
        for call_id in row["call_ids"]:
            call = by_id[call_id]
            at += len(call["prompt_ids"]) - end
            n = len(call["completion_ids"])
            assert row["response_ids"][at:at + n] == call["completion_ids"]
            if n and all(row["response_mask"][at:at + n]):
                trained[call_id] = trained.get(call_id, 0) + 1
            at, end = at + n, len(call["prompt_ids"]) + n
    assert sum(sum(r["response_mask"]) for r in rows) == sum(
        len(c["completion_ids"]) for c in calls)
    assert trained == {c["call_id"]: 1 for c in calls}, trained


def _linked(rows, calls, summary_seq):
    by_seq = {c["seq"]: c["call_id"] for c in calls}
    summary_call = by_seq[summary_seq]
    compacted = [r for r in rows if r["split_reason"] == "compaction"]
    assert len(compacted) == 1, [(r["call_ids"], r["split_reason"]) for r in rows]
    segment = compacted[0]
    main = next(r for r in rows if r["trajectory_id"] == segment["continues_trajectory_id"])
    written = next(r for r in rows if r["call_ids"] == [summary_call])
    assert segment["summary_call_id"] == summary_call
    assert main["split_reason"] is None and main["lineage_id"] == segment["lineage_id"]
    assert main["call_ids"] == [by_seq[s] for s in range(summary_seq)]
    # The summary call: a lineage of its own under the conversation it summarised.
    assert written["split_reason"] is None
    assert written["lineage_id"] == summary_call != main["lineage_id"]
    assert written["parent_lineage_id"] == main["lineage_id"]
    # The calls dataset agrees.
    lineage = {c["call_id"]: c["lineage_id"] for c in calls}
    assert lineage[summary_call] == summary_call
    assert {lineage[c] for c in segment["call_ids"]} == {main["lineage_id"]}
    return segment


def test_a_scripted_compaction_exports_as_linked_segments(proxy, tmp_path):
    """Chat: two turns, a call that writes a summary, then the history starts over from
    that summary for two more turns."""
    register(proxy, "ep", harness={"name": "scripted"})
    client = openai.OpenAI(base_url=proxy.episode_url("ep"), api_key="k", max_retries=0)

    def turn(messages, **extra):
        reply = client.chat.completions.create(model="mock-model", messages=messages,
                                               tools=TOOLS, extra_body=extra or None)
        message = reply.choices[0].message.model_dump(exclude_none=True)
        out = [*messages, message]
        out += [{"role": "tool", "tool_call_id": c["id"], "content": "It is north."}
                for c in message.get("tool_calls") or ()]
        return out, message.get("content") or ""

    history, _ = turn([{"role": "system", "content": SYSTEM},
                       {"role": "user", "content": "Where is the harbor?"}])
    history, _ = turn(history)
    _, written = turn([*history, {"role": "user", "content": ASK_SUMMARY}], **SUMMARY_TOKENS)
    assert len(written) >= 40
    after, _ = turn([{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": f"Summary of the work so far:\n{written}\n"
                                                 "Go on with the task."}])
    turn([*after, {"role": "user", "content": "And then?"}])

    summary, rows, calls = _exported(proxy, "ep", tmp_path)
    segment = _linked(rows, calls, summary_seq=2)
    assert segment["call_ids"] == [c["call_id"] for c in calls if c["seq"] >= 3]
    assert summary.splits == {"compaction": 1}
    assert_trained_once(rows, calls)
    assert {r["reward"] for r in rows} == {1.0}


def test_a_header_line_that_changes_at_compaction_keeps_the_lineage(proxy, tmp_path):
    """Messages, as Claude Code 2.1 sends them: a billing header at the start of the
    system prompt whose values change at /compact; the summary kept without its
    analysis."""
    register(proxy, "cc", harness={"name": "scripted-claude"})
    client = anthropic.Anthropic(base_url=proxy.episode_url("cc").removesuffix("/v1"),
                                 api_key="k", max_retries=0)

    def system(build):
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.{build}; "
                                         "cc_entrypoint=sdk-cli;"},
                {"type": "text", "text": SYSTEM}]

    def turn(build, messages, **extra):
        reply = client.messages.create(model="mock-model", max_tokens=300, messages=messages,
                                       system=system(build), extra_body=extra or None)
        text = "".join(b.text for b in reply.content if b.type == "text")
        return [*messages, {"role": "assistant", "content": text}], text

    history, _ = turn("a1", [{"role": "user", "content": "Where is the harbor?"}])
    history, _ = turn("a1", [*history, {"role": "user", "content": "And the river?"}])
    _, written = turn("a1", [*history, {"role": "user", "content": ASK_SUMMARY}],
                      **SUMMARY_TOKENS)
    assert len(written) >= 80
    kept = written[12:]  # the start ("<analysis>...") dropped, the summary kept
    after, _ = turn("f9", [{"role": "user", "content": "This session is being continued from "
                                                        f"a previous conversation.\n\n{kept}"}])
    turn("f9", [*after, {"role": "user", "content": "Go on."}])

    summary, rows, calls = _exported(proxy, "cc", tmp_path)
    _linked(rows, calls, summary_seq=2)
    assert summary.splits == {"compaction": 1}
    assert_trained_once(rows, calls)


def test_the_conversation_hash_skips_a_leading_header_line_only():
    def start(system):
        return conversation(readers().reader("messages:chat"),
                            {"system": system, "messages": [{"role": "user", "content": "t"}]})

    plain = start([{"type": "text", "text": "Be brief."}])
    header = "x-anthropic-billing-header: cc_version=2.1.332.{}; cc_entrypoint=sdk-cli;"
    assert start([{"type": "text", "text": header.format("344")},
                  {"type": "text", "text": "Be brief."}]) == plain
    assert start(header.format("cf6") + "\nBe brief.") == plain
    # Anywhere else, or not key=value pairs: part of the prompt.
    assert start("Be brief.\n" + header.format("344")) != plain
    assert start("x-note: be brief\nBe brief.") != start("x-note: be terse\nBe brief.")


class _Body:
    def __init__(self, request=None):
        self.request = request


def test_the_summary_is_found_in_each_harness_shape_and_short_replies_are_not():
    summary = "The user asked where the harbor is. " * 4
    codex = _Body(json.dumps({"instructions": "x", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "task"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Another language model "
                                      f"started... {summary[10:]}"}]}]}))
    other = "Something else entirely, at length."
    assert find(codex, [("o", other), ("r", summary.strip())]) == "r"
    # The reply text of each API, as export reads it.
    for response in ({"object": "response", "output": [{"type": "message", "content": [
                        {"type": "output_text", "text": summary}]}]},
                     {"type": "message", "content": [{"type": "text", "text": summary}]},
                     {"choices": [{"index": 0, "message": {"role": "assistant",
                                                           "content": summary}}]}):
        assert _sampled(response) == summary.strip()
    # Said by the assistant itself, not told to it: no compaction.
    echoed = _Body(json.dumps({"messages": [{"role": "user", "content": "t"},
                                            {"role": "assistant", "content": summary}]}))
    assert find(echoed, [("r", summary.strip())]) is None
    told = _Body(json.dumps({"messages": [{"role": "user", "content": "Done. Go on."}]}))
    assert find(told, [("s", "Done.")]) is None


def test_a_lineage_that_began_at_the_compaction_is_merged_back():
    """Stored before the header rule (or a harness whose system prompt changes at the
    compaction): the turns after it began a lineage of their own under the conversation;
    linking merges them back, and the summary call becomes its own lineage."""
    import asyncio
    import functools

    from tests.test_trajectories import make_call
    from tracetap.exporters.compaction import segments
    from tracetap.exporters.lineages import CallView, assign
    from tracetap.exporters.trajectories import build_trajectories

    summary = "Looked up the harbor: it is north of the river."
    calls = [make_call("a", 0, [1, 2], [[3]], finish_reason="tool_calls"),
             make_call("b", 2, [1, 2, 3, 4], [[5]]),
             make_call("s", 4, [1, 2, 3, 4, 5, 6], [[7, 7]]),  # asked for the summary
             make_call("c", 6, [9, 8, 7, 7], [[10]]),  # a new system prompt, the summary
             make_call("d", 8, [9, 8, 7, 7, 10, 11], [[12]])]
    starts = {"a": "s1:f1", "b": "s1:f1", "s": "s1:f1", "c": "s2:f2", "d": "s2:f2"}
    lineages = assign([CallView(call_id=c.call_id, t_start=c.t_start, t_end=c.t_end,
                                conversation=starts[c.call_id]) for c in calls])
    assert lineages["c"].parent == "a" and lineages["c"].id == "c"  # as detected

    bodies = {"c": _Body(json.dumps({"messages": [
        {"role": "system", "content": "new"}, {"role": "user", "content": summary}]}))}
    bodies["s"] = _Body()
    bodies["s"].response = json.dumps({"choices": [{"index": 0, "message": {
        "role": "assistant", "content": summary}}]})

    async def read(ids):
        return {i: bodies[i] for i in ids if i in bodies}

    build = functools.partial(build_trajectories, calls)
    rows = asyncio.run(segments(calls, build(lineages=lineages), lineages, build, read))
    got = {tuple(r.call_ids): (r.split_reason, r.summary_call_id, r.continues_trajectory_id,
                               lineages[r.call_ids[-1]].id) for r in rows}
    assert got == {("a", "b"): (None, None, None, "a"), ("s",): (None, None, None, "s"),
                   ("c", "d"): ("compaction", "s", "b:0", "a")}
    assert lineages["s"].parent == "a"
    assert sum(sum(r.response_mask) for r in rows) == 1 + 1 + 2 + 1 + 1
