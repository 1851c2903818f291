"""Lineages: the conversations inside one episode (exporters.lineages), on their own and
in the trajectory merge; the conversation hash the proxy stores (proxy.lineage)."""

from __future__ import annotations

from tests.test_trajectories import make_call
from tracetap.exporters.lineages import CallView, assign
from tracetap.exporters.trajectories import build_trajectories
from tracetap.proxy.apis.registry import readers
from tracetap.proxy.episodes.lineage import conversation, names

MAIN = "s1:f1"
SUB = "s2:f2"


def view(call_id, t_start, conv, *, t_end=None, tool=False, lineage=None, parent=None):
    return CallView(call_id=call_id, t_start=t_start,
                    t_end=t_start + 1 if t_end is None else t_end, conversation=conv,
                    asked_tool=tool, lineage=lineage, parent_lineage=parent)


def ids(found, *call_ids):
    return [(found[c].id, found[c].parent) for c in call_ids]


def test_a_sub_agent_started_by_a_tool_call_is_a_lineage_under_its_spawner():
    found = assign([view("a", 0, MAIN, tool=True), view("b", 2, SUB), view("c", 4, SUB),
                    view("d", 6, MAIN)])
    assert ids(found, "a", "b", "c", "d") == [("a", None), ("b", "a"), ("b", "a"),
                                              ("a", None)]


def test_one_shot_side_calls_parent_nothing_conversations_do():
    # opencode: the title call comes first; the main conversation is no child of it.
    found = assign([view("t", 0, "s3:f3"), view("a", 2, MAIN), view("b", 4, MAIN)])
    assert ids(found, "t", "a", "b") == [("t", None), ("a", None), ("a", None)]
    # A summariser started without a tool call, once the main conversation has turns.
    found = assign([view("a", 0, MAIN), view("b", 2, MAIN), view("s", 4, "s9:f9")])
    assert ids(found, "s") == [("s", "a")]


def test_a_rewritten_history_stays_in_its_lineage_but_parallel_twins_do_not():
    # Same system prompt, new first message: a summary in place of the old turns...
    found = assign([view("a", 0, "s1:f1"), view("b", 2, "s1:f9")])
    assert found["b"] is found["a"]
    # ...unless that lineage is in flight: two sub-agents of one type run side by side.
    found = assign([view("m", 0, MAIN, tool=True), view("x", 2, "s2:fx", t_end=9),
                    view("y", 3, "s2:fy", t_end=9)])
    assert ids(found, "x", "y") == [("x", "m"), ("y", "m")]


def test_names_from_headers_win_over_detection():
    found = assign([view("a", 0, MAIN), view("a2", 1, MAIN),
                    view("b", 2, MAIN, lineage="helper", parent="main"),
                    view("c", 3, MAIN, lineage="main"), view("d", 4, SUB, lineage="helper"),
                    view("e", 5, SUB, lineage="x", parent="main")])
    # "helper" named a parent that did not exist yet: found as detection would (the
    # active conversation); "main" followed a one-call lineage: a root.
    assert ids(found, "b", "c", "d", "e") == [("b", "a"), ("c", None), ("b", "a"),
                                              ("e", "c")]


def test_calls_without_a_conversation_hash_join_the_call_before_them():
    # Rows stored before revision 0010: one lineage, as they exported before.
    found = assign([view("a", 0, None), view("b", 2, None), view("c", 4, None)])
    assert {f.id for f in found.values()} == {"a"}
    # A relayed count_tokens (no messages) inside a sub-agent's turns is the sub-agent's.
    found = assign([view("a", 0, MAIN, tool=True), view("s", 2, SUB), view("p", 3, None)])
    assert found["p"] is found["s"]


def test_each_lineage_merges_on_its_own_with_its_own_main_line():
    calls = [
        make_call("a", 0, [1, 2], [[3]], finish_reason="tool_calls"),
        make_call("s1", 2, [7, 7], [[8]]),  # a sub-agent: a new root
        make_call("b", 4, [1, 2, 3, 4], [[5]]),
        make_call("s2", 6, [7, 7, 8, 9], [[6]]),
    ]
    lineages = assign([view(c.call_id, c.t_start, MAIN if c.call_id in "ab" else SUB,
                            tool=c.call_id == "a") for c in calls])
    merged = build_trajectories(calls, lineages=lineages)
    assert [(t.call_ids, t.split_reason) for t in merged] == [
        (["a", "b"], None), (["s1", "s2"], None)]
    # Without lineages the sub-agent is a split of the episode's one main line.
    assert [t.split_reason for t in build_trajectories(calls)] == [None, "non_prefix"]


def test_the_conversation_hash_ignores_markup_and_follows_the_start():
    first = {"messages": [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "task"}]}
    later = {"messages": [*first["messages"], {"role": "assistant", "content": "ok"},
                          {"role": "user", "content": "more"}]}
    anthropic = {"system": [{"type": "text", "text": "be brief",
                             "cache_control": {"type": "ephemeral"}}],
                 "messages": [{"role": "user",
                               "content": [{"type": "text", "text": "task",
                                            "cache_control": {"type": "ephemeral"}}]}]}
    responses = {"instructions": "be brief", "input": "task"}
    chat = readers().reader("chat.completions")
    key = conversation(chat, first)
    assert key == conversation(chat, later) == conversation(
        readers().reader("messages:chat"), anthropic) == conversation(
        readers().reader("responses"), responses)
    summary = {"messages": [first["messages"][0], {"role": "user", "content": "summary"}]}
    other = conversation(chat, summary)
    assert other.split(":")[0] == key.split(":")[0] and other != key
    assert conversation(readers().reader("completions"), {"prompt": [1, 2, 3]}) is None
    # A start read a few messages at a time: a long system preamble is read whole.
    preamble = [{"role": "system", "content": f"rule {n}"} for n in range(20)]
    long = {"messages": [*preamble, {"role": "user", "content": "task"}]}
    longer = {"messages": [*preamble, {"role": "user", "content": "other task"}]}
    assert conversation(chat, long) != conversation(chat, longer)


def test_lineage_headers_are_read_and_trimmed():
    assert names({"X-Tracetap-Lineage": " sub-1 ", "X-Tracetap-Parent": "main"}) == (
        "sub-1", "main")
    assert names({}) == (None, None)
    assert len(names({"X-Tracetap-Lineage": "x" * 500})[0]) == 128


def test_a_sub_agent_and_a_named_helper_export_as_lineages(proxy, tmp_path):
    """Through the proxy with the openai SDK: the main conversation, a sub-agent with its
    own system prompt (detected), a helper named by header, then the main one again."""
    import openai
    import pyarrow.parquet as pq

    from tracetap.exporters import export

    client = openai.OpenAI(base_url=proxy.episode_url("ep"), api_key="k", max_retries=0)

    def turn(messages, tools=None, **headers):
        reply = client.chat.completions.create(
            model="mock-model", max_tokens=200, messages=messages, extra_headers=headers,
            **({"tools": tools} if tools else {}))
        return [*messages, reply.choices[0].message.model_dump(exclude_none=True)]

    # The main agent's first reply asks for a tool (the mock engine calls the first one):
    # the sub-agent that follows is its child.
    task = [{"type": "function", "function": {"name": "task", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
    main = turn([{"role": "system", "content": "You are the main agent."},
                 {"role": "user", "content": "Fix the bug."}], task)
    call_id = main[-1]["tool_calls"][0]["id"]
    sub = turn([{"role": "system", "content": "You are a search sub-agent."},
                {"role": "user", "content": "Find the bug."}])
    turn([*sub, {"role": "user", "content": "And the test?"}])
    turn([{"role": "system", "content": "You are the main agent."},
          {"role": "user", "content": "Name this session."}],
         **{"X-Tracetap-Lineage": "title", "X-Tracetap-Parent": "nope"})
    turn([*main, {"role": "tool", "tool_call_id": call_id, "content": "found it"}], task)
    assert proxy.admin("POST", "/tracetap/episodes/ep/finish", {"reward": 1.0})[0] == 200
    summary = export(proxy.settings.db, tmp_path / "out")
    rows = pq.read_table(tmp_path / "out" / "trajectories").to_pylist()
    calls = [c["call_id"] for c in proxy.calls("ep")]
    got = sorted((r["call_ids"], r["split_reason"], r["lineage_id"], r["parent_lineage_id"])
                 for r in rows)
    main_id, sub_id, title_id = calls[0], calls[1], calls[3]
    assert got == sorted([
        ([calls[0], calls[4]], None, main_id, None),
        ([calls[1], calls[2]], None, sub_id, main_id),
        # Named; its parent name unknown, so found: the main agent's tool call spawned it.
        ([calls[3]], None, title_id, main_id),
    ])
    assert summary.splits == {}
    by_call = {c["call_id"]: c for c in pq.read_table(tmp_path / "out" / "calls").to_pylist()}
    assert [by_call[c]["lineage_id"] for c in calls] == [main_id, sub_id, sub_id, title_id,
                                                         main_id]


def test_a_sub_agent_registered_as_an_episode_names_its_parent(proxy, tmp_path):
    """Registration field ``parent``: the sub-agent episode's root lineage hangs under the
    parent episode's root lineage (its first call)."""
    import openai
    import pyarrow.parquet as pq

    from tracetap.exporters import export

    assert proxy.admin("POST", "/tracetap/episodes", {"id": "boss"})[0] == 201
    assert proxy.admin("POST", "/tracetap/episodes", {"id": "helper", "parent": "boss"})[0] == 201
    assert proxy.admin("POST", "/tracetap/episodes", {"parent": "not an id!"})[0] == 400
    for episode in ("boss", "helper"):
        client = openai.OpenAI(base_url=proxy.episode_url(episode), api_key="k",
                               max_retries=0)
        client.chat.completions.create(model="mock-model", max_tokens=8,
                                       messages=[{"role": "user", "content": episode}])
        assert proxy.admin("POST", f"/tracetap/episodes/{episode}/finish", {})[0] == 200
    export(proxy.settings.db, tmp_path / "out")
    rows = {r["episode_id"]: r for r in pq.read_table(tmp_path / "out" / "trajectories")
            .to_pylist()}
    [boss] = proxy.calls("boss")
    assert rows["boss"]["lineage_id"] == boss["call_id"]
    assert rows["boss"]["parent_lineage_id"] is None
    assert rows["helper"]["parent_lineage_id"] == boss["call_id"]


def test_the_lineage_headers_never_reach_the_upstream():
    from tracetap.proxy.http.headers import upstream_request_headers

    sent = upstream_request_headers(
        {"X-Tracetap-Lineage": "sub", "X-Tracetap-Parent": "main", "Accept": "*/*"},
        api_key=None, forward_client_auth=False, identity=True)
    assert "Accept" in sent
    assert not any(name.lower().startswith("x-tracetap") for name in sent)
