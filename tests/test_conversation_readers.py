"""One conversation reader per wire API (``proxy/apis/<api>/conversation.py``), read by
the viewer, analysis and the lineage hash through ``storage.conversation.Readers``: the
three APIs read one conversation alike, a fourth API's calls read everywhere with only
its reader and its registry line, and no reader of a conversation outside the API
packages reads an API's request keys."""

from __future__ import annotations

import ast
import asyncio
import json
import re
from pathlib import Path

from sqlalchemy import text

from tracetap.analysis import conversation as analysis
from tracetap.analysis.steps import CallBodies, read_steps
from tracetap.migrations import upgrade
from tracetap.proxy.apis.chat.api import CHAT_CLIENT
from tracetap.proxy.apis.registry import APIS, caps, readers
from tracetap.proxy.episodes.lineage import conversation as lineage
from tracetap.storage import queries, retention, search
from tracetap.storage.blocks import unpack_refs
from tracetap.storage.conversation import (
    Conversation,
    Message,
    Shape,
    Text,
    ToolCall,
    ToolResult,
    text_of,
)
from tracetap.storage.engine import create_engine
from tracetap.storage.journal import Journal
from tracetap.storage.records import CallRecord, ChoiceRecord
from tracetap.storage.tables import CallText
from tracetap.storage.writer import Writer
from tracetap.viewer import conversation as viewer

ROOT = Path(__file__).resolve().parent.parent

SYSTEM, TASK, RESULT, DONE = "Be an agent.", "Find the file.", "a.txt b.txt", "It is a.txt."
CHAT = {"messages": [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": TASK},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": RESULT}]}
CHAT_REPLY = {"choices": [{"message": {"role": "assistant", "content": DONE}}]}
RESPONSES = {"instructions": SYSTEM, "input": [
    {"role": "user", "content": [{"type": "input_text", "text": TASK}]},
    {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": RESULT}]}
RESPONSES_REPLY = {"output": [{"type": "message", "role": "assistant",
                               "content": [{"type": "output_text", "text": DONE}]}]}
MESSAGES = {"system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": TASK},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "c1", "name": "ls", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "c1", "content": RESULT}]}]}
MESSAGES_REPLY = {"type": "message", "role": "assistant",
                  "content": [{"type": "text", "text": DONE}]}
# The same conversation in Gemini's generateContent shape: no package of tracetap's.
GEMINI = {"systemInstruction": {"parts": [{"text": SYSTEM}]}, "contents": [
    {"role": "user", "parts": [{"text": TASK}]},
    {"role": "model", "parts": [{"functionCall": {"name": "ls", "args": {}}}]},
    {"role": "user", "parts": [{"functionResponse": {"name": "ls",
                                                     "response": {"output": RESULT}}}]}]}
GEMINI_REPLY = {"candidates": [{"content": {"role": "model", "parts": [{"text": DONE}]}}]}


def _gemini_parts(content: dict) -> list:
    parts = []
    for p in content.get("parts") or ():
        if "text" in p:
            parts.append(Text(p["text"]))
        elif "functionCall" in p:
            parts.append(ToolCall(name=p["functionCall"]["name"],
                                  arguments=p["functionCall"].get("args"), id="ls"))
        elif "functionResponse" in p:
            out = p["functionResponse"]["response"].get("output")
            parts.append(ToolResult(call_id="ls", parts=[Text(out)]))
    return parts


def read_gemini(request, reply, *, first=None) -> Conversation:
    """What ``proxy/apis/gemini/conversation.py`` would hold (docs/architecture.md)."""
    messages = [Message(role="system",
                        parts=_gemini_parts(request.get("systemInstruction") or {}))]
    for content in request.get("contents") or ():
        parts = _gemini_parts(content)
        role = "assistant" if content.get("role") == "model" else "user"
        messages.append(Message(role="tool" if any(type(p) is ToolResult for p in parts)
                                else role, parts=parts))
    return Conversation(messages=messages, reply=[
        Message(role="assistant", parts=_gemini_parts(c["content"]))
        for c in reply.get("candidates") or ()])


# Where its stored request holds the conversation (the package's ``conversation.py`` too).
GEMINI_SHAPE = Shape(messages="contents", head=("systemInstruction",), assistant_roles=("model",))
# The registry's line for it: the package's ClientApi (no native capture, no translation
# needed to read its stored calls).
GEMINI_API = CHAT_CLIENT._replace(name="gemini", path="/v1beta/models/m:generateContent",
                                  exposed=(), native=None, reader=read_gemini,
                                  shape=GEMINI_SHAPE)
WITH_GEMINI = readers((*APIS, GEMINI_API))


def _summary(read: Conversation) -> list[tuple]:
    """Each message as (role, text, tool calls' names, tool results' texts)."""
    return [(m.role, text_of(m.parts), [p.name for p in m.parts if type(p) is ToolCall],
             [text_of(p.parts) for p in m.parts if type(p) is ToolResult])
            for m in [*(read.messages or ()), *read.reply]]


def test_the_three_apis_read_one_conversation_alike():
    spelled = {"chat.completions": (CHAT, CHAT_REPLY), "responses:chat": (RESPONSES,
               RESPONSES_REPLY), "messages:chat": (MESSAGES, MESSAGES_REPLY),
               "gemini:chat": (GEMINI, GEMINI_REPLY)}
    read = {endpoint: _summary(WITH_GEMINI.read(endpoint, json.dumps(req), json.dumps(res)))
            for endpoint, (req, res) in spelled.items()}
    expected = [("system", SYSTEM, [], []), ("user", TASK, [], []),
                ("assistant", None, ["ls"], []), (None, [], [RESULT]), ("assistant", DONE, [], [])]
    for endpoint, found in read.items():
        assert [*found[:3], found[3][1:], found[4]] == expected, endpoint
    # Messages returns tool results in a user turn, chat and Responses as tool messages.
    assert [found[3][0] for found in read.values()] == ["tool", "tool", "user", "tool"]


def test_a_fourth_api_is_read_everywhere_with_only_its_reader_and_registry_line():
    request, reply = json.dumps(GEMINI), json.dumps(GEMINI_REPLY)
    # The viewer's conversation.
    turns = viewer.turns(WITH_GEMINI, "gemini:chat", request, reply)
    assert [(t.role, t.text, [c.name for c in t.tool_calls], t.reply) for t in turns] == [
        ("system", SYSTEM, [], False), ("user", TASK, [], False),
        ("assistant", "", ["ls"], False), ("tool", RESULT, [], False),
        ("assistant", DONE, [], True)]
    # The packets' steps, read call by call as a failure packet reads them.
    task, steps, _ = read_steps(WITH_GEMINI, [CallBodies(
        call_id="g1", endpoint="gemini:chat", request=request, response=reply)], 200)
    assert (task.system, task.user) == (SYSTEM, TASK)
    assert [(s.text, s.tool_calls, [o["content"] for o in s.observations]) for s in steps] == [
        (None, [{"name": "ls", "arguments": "{}"}], [RESULT]), (DONE, [], [])]
    # The lineage hash: the same start as the same conversation spoken in chat.
    assert lineage(WITH_GEMINI.reader("gemini:chat"), GEMINI) == lineage(
        WITH_GEMINI.reader("chat.completions"), CHAT)
    # Without its line the calls read as plain JSON: nothing of them is lost, nothing read.
    plain = viewer.turns(readers(), "gemini:chat", request, reply)
    assert [t.role for t in plain] == ["other", "reply"] and TASK in plain[0].text
    assert analysis.read(readers(), "gemini:chat", request, None, reply, 200)[1] == []


def test_every_api_of_the_registry_reads_through_its_own_package():
    for api in APIS:
        package = (api.native().__class__.__module__ if api.native
                   else api.translation.__name__).split(".")[3]
        for read in (api.reader, api.caps):
            assert read.__module__ == f"tracetap.proxy.apis.{package}.conversation", api.name
    names = readers()
    for endpoint in ("chat", "chat.completions", "completions", "responses", "messages",
                     "responses:chat", "messages:chat"):
        assert names.reader(endpoint).__module__.endswith(".conversation"), endpoint


def test_each_api_reads_its_own_completion_cap():
    assert caps("chat.completions", {"max_completion_tokens": 9, "max_tokens": 5, "n": 2}) == (
        9, 2)
    assert caps("responses:chat", {"max_output_tokens": 7, "max_tokens": 5, "n": 2}) == (7, 1)
    assert caps("messages", {"max_tokens": 5, "max_output_tokens": 7, "n": 2}) == (5, 1)


def test_an_image_is_read_by_reference_never_by_its_data():
    data = "iVBORw0KGgo" * 1000
    request = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": data}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]}
    turns = viewer.turns(readers(), "messages", json.dumps(request), None)
    [turn] = turns
    assert data not in turn.text and re.search(r"\[image [0-9a-f]{32}\]", turn.text)
    assert "[image https://example.com/a.png]" in turn.text
    chat = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": f"data:image/png;base64,{data}"}}]}]}
    [turn] = viewer.turns(readers(), "chat.completions", json.dumps(chat), None)
    assert data not in turn.text and re.fullmatch(r"\[image [0-9a-f]{32}\]", turn.text)


# Request keys and API names that only an API's package may read.
WIRE_NAMES = {"messages", "input", "instructions", "tool_calls", "tool_call_id", "tool_use",
              "tool_result", "tool_use_id", "function_call", "function_call_output",
              "input_schema", "max_tokens", "max_completion_tokens", "max_output_tokens",
              "choices", "output", "chat.completions", "completions", "responses",
              "reasoning_content", "image_url"}
READERS_OF_A_CONVERSATION = ("viewer/conversation.py", "analysis/conversation.py",
                             "analysis/steps.py", "proxy/episodes/lineage.py",
                             "proxy/episodes/budgets.py", "proxy/call/driver.py")


def test_no_reader_of_a_conversation_outside_the_api_packages_reads_a_wire_shape():
    for name in READERS_OF_A_CONVERSATION:
        tree = ast.parse((ROOT / name).read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        found = {node.value for node in ast.walk(tree)
                 if isinstance(node, ast.Constant) and isinstance(node.value, str)
                 and id(node) not in docstrings and node.value in WIRE_NAMES}
        assert not found, f"{name} reads {sorted(found)}"


def _gemini_calls(turns: int) -> list[CallRecord]:
    """A Gemini agent's calls: each resends the whole conversation, adding a tool's output
    (a word of its own, ``Output<turn>``, and 2 KB) and the model's last answer."""
    contents = [{"role": "user", "parts": [{"text": "Find the Zebracorn file."}]}]
    records = []
    for turn in range(turns):
        if turn:
            contents += [{"role": "model", "parts": [{"text": f"Answer{turn - 1} ls"}]},
                         {"role": "user", "parts": [{"functionResponse": {"name": "ls",
                          "response": {"output": f"Output{turn} " + "ü" * 2000}}}]}]
        records.append(CallRecord(
            call_id=f"g-{turn:02d}", episode_id="gemini-ep", seq=turn, endpoint="gemini",
            model="m", t_start=1000.0 + turn, t_end=1000.5 + turn, http_status=200,
            instance="i", request=json.dumps({
                "systemInstruction": {"parts": [{"text": "Be a Quokka agent."}]},
                "contents": contents, "generationConfig": {"temperature": 1}},
                ensure_ascii=False),
            response=json.dumps({"candidates": [{"content": {"role": "model", "parts": [
                {"text": f"Answer{turn} ls"}]}}]}),
            choices=[ChoiceRecord(index=0, finish_reason="stop", text=f"Answer{turn} ls")]))
    return records


async def _store_and_look(engine, journal: Path, records: list[CallRecord], table) -> tuple:
    """Store through a writer composed with ``table``; then what search finds of a word
    (call ids), the request bytes the blocks hold (each block once), the bodies read back."""
    writer = Writer(engine, Journal(journal, max_bytes=1 << 26), readers=table)
    writer.start()
    for record in records:
        writer.submit(record)
    while writer.pending:
        await asyncio.sleep(0.01)
    await writer.close()
    async with engine.connect() as conn:
        found = {word: sorted((await conn.execute(
            search.matching_calls(engine.dialect.name, word)
            .with_only_columns(CallText.call_id))).scalars())
            for word in ("zebracorn", "quokka", "output3", "answer2")}
        refs = (await conn.execute(text("SELECT request_refs FROM calls"))).scalars().all()
    stored = sum(dict(ref for r in refs for ref in unpack_refs(r)).values())
    return found, stored, await queries.calls_of(engine, "gemini-ep")


def test_a_fourth_api_is_stored_by_message_and_found_by_its_new_turn(db_url, tmp_path):
    """Only its package's shape and its registry line: its bodies are cut at each message
    (a resent message stored once), its calls found by the turn they add, read back as
    sent; prune takes their postings (SQLite recomputes the text by the same shape)."""
    records = _gemini_calls(8)

    async def step(engine):
        looked = await _store_and_look(engine, tmp_path / "journal", records, WITH_GEMINI)
        sqlite = engine.dialect.name == "sqlite"
        async with engine.begin() as conn:
            await retention._delete(conn, ["gemini-ep"], [r.call_id for r in records],
                                    WITH_GEMINI)
            left = (await conn.execute(text(
                "SELECT count(*) FROM call_text_fts WHERE call_text_fts MATCH 'output3'"
            ))).scalar() if sqlite else 0
        return looked, left

    (found, stored, back), left = _run(db_url, step)
    assert [c["request"] for c in back] == [r.request for r in records]  # byte for byte
    assert [c["response"] for c in back] == [r.response for r in records]
    # Each call is found by what it added; the history it resends is not indexed again.
    assert found == {"zebracorn": ["g-00"], "quokka": ["g-00"], "output3": ["g-03"],
                     "answer2": ["g-02", "g-03"]}  # its answer, and resent as the last turn
    sent = sum(len(r.request.encode()) for r in records)
    last = len(records[-1].request.encode())
    assert last <= stored <= 1.05 * last < sent / 3  # linear in the conversation
    assert left == 0  # no posting left behind


def test_a_fourth_api_without_its_shape_is_stored_and_found_whole(tmp_path):
    """Its line without a shape (or no line): nothing lost, at the cost of storing and
    indexing each resent request whole."""
    url = f"sqlite:///{tmp_path / 'plain.db'}"
    upgrade(url)
    records = _gemini_calls(8)
    found, stored, back = _run(url, lambda engine: _store_and_look(
        engine, tmp_path / "journal", records, readers()))
    assert [c["request"] for c in back] == [r.request for r in records]
    assert found["zebracorn"] == [r.call_id for r in records]  # every resent copy matches
    assert stored == sum(len(r.request.encode()) for r in records)


def _run(url: str, step):
    async def run():
        engine = create_engine(url)
        try:
            return await step(engine)
        finally:
            await engine.dispose()
    return asyncio.run(run())


def test_the_proxy_composes_its_writer_with_each_apis_shape(proxy):
    """Through the proxy (the real SDK): a resent chat message names the block it named
    when first sent, and a call is found by the turn it adds, not by the history."""
    import openai

    client = openai.OpenAI(base_url=proxy.episode_url("composed"), api_key="k", max_retries=0)
    messages = [{"role": "user", "content": "Find the Zebracorn file. " + "é" * 3000}]
    for turn in range(3):
        client.chat.completions.create(model="mock", max_tokens=4, messages=messages)
        messages += [{"role": "assistant", "content": f"Answer{turn}"},
                     {"role": "user", "content": f"Output{turn} " + "ü" * 3000}]
    calls = proxy.calls("composed")

    async def look():
        async with proxy.state.engine.connect() as conn:
            refs = [unpack_refs(bytes((await conn.execute(text(
                "SELECT request_refs FROM calls WHERE call_id = :c"), {"c": c["call_id"]}
            )).scalar())) for c in calls]
            found = {word: (await conn.execute(search.matching_calls(
                proxy.state.engine.dialect.name, word).with_only_columns(CallText.call_id)
            )).scalars().all() for word in ("zebracorn", "output1")}
        return refs, found

    refs, found = proxy.loop.run(look())
    assert len(refs[0]) >= 3 and refs[2][:2] == refs[1][:2] == refs[0][:2]  # head, message
    assert refs[2][:4] == refs[1][:4]  # and the turn the second call added
    assert found == {"zebracorn": [calls[0]["call_id"]], "output1": [calls[2]["call_id"]]}
