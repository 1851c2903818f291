"""Packets' steps across all of an episode's calls, and what an overlay did in them
(analysis.steps, analysis.packets): a harness that summarises its history keeps every
step; observations an overlay injected are marked; the overlay and its events travel in
the packet. Unit cases on bodies, then the real proxy with overlays and the openai SDK."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers.harnesses import faithful, run_episode, summarised
from helpers.http import finish, register
from helpers.loop import free_port
from helpers.servers import Proxy

from tests.overlay_fixtures import NOTE
from tracetap.analysis import conversation
from tracetap.analysis.packets import SCHEMA_FILE, Options, build
from tracetap.analysis.steps import CallBodies, read_steps
from tracetap.proxy.apis.registry import readers
from tracetap.proxy.runtime.settings import Settings
from tracetap.storage.scan import EpisodeFilter

SYSTEM = {"role": "system", "content": "Be an agent."}
USER = {"role": "user", "content": "Find it."}


def _call(n: int) -> dict:
    return {"id": f"c{n}", "type": "function", "function": {"name": "look", "arguments": "{}"}}


def _reply(message: dict) -> str:
    return json.dumps({"choices": [{"index": 0, "message": message}]})


def _turn(n: int) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [_call(n)]}


def _result(n: int) -> dict:
    return {"role": "tool", "tool_call_id": f"c{n}", "content": f"saw {n}"}


def test_a_summarised_history_keeps_every_step():
    summary = {"role": "user", "content": "Summary so far: saw 0, saw 1."}
    calls = [
        CallBodies(
            call_id="k0",
            endpoint="chat.completions",
            request=json.dumps({"messages": [SYSTEM, USER]}),
            response=_reply(_turn(0)),
        ),
        CallBodies(
            call_id="k1",
            endpoint="chat.completions",
            request=json.dumps({"messages": [SYSTEM, USER, _turn(0), _result(0)]}),
            response=_reply(_turn(1)),
        ),
        # The harness drops its turns and sends a summary instead.
        CallBodies(
            call_id="k2",
            endpoint="chat.completions",
            request=json.dumps({"messages": [SYSTEM, summary]}),
            response=_reply({"role": "assistant", "content": "It is north."}),
        ),
    ]
    task, steps, before = read_steps(readers(), calls, 200)
    assert (task.system, task.user, before) == ("Be an agent.", "Find it.", [])
    assert [(s.call_id, s.text, [c["name"] for c in s.tool_calls]) for s in steps] == [
        ("k0", None, ["look"]),
        ("k1", None, ["look"]),
        ("k2", "It is north.", []),
    ]
    assert [[o["content"] for o in s.observations] for s in steps] == [
        ["saw 0"],
        ["Summary so far: saw 0, saw 1."],
        [],
    ]
    # The last request alone (what packets read before) has lost the first two steps.
    _, last_only = conversation.read(readers(), "chat.completions", calls[-1].request, None,
                                     calls[-1].response, 200)
    assert [s.text for s in last_only] == ["It is north."]


def test_what_an_overlay_added_is_marked_and_a_vetoed_turn_is_no_action():
    note = {"role": "system", "content": "Overlay note."}
    vetoed = {"role": "assistant", "content": "guess"}
    feedback = {"role": "user", "content": "Try once more."}
    harness = [SYSTEM, USER, _turn(0), _result(0)]
    model = [SYSTEM, note, USER, _turn(0), _result(0), vetoed, feedback]
    calls = [
        CallBodies(
            call_id="k0",
            endpoint="chat.completions",
            request=json.dumps({"messages": [SYSTEM, USER]}),
            upstream_request=json.dumps({"messages": [SYSTEM, note, USER]}),
            response=_reply(_turn(0)),
        ),
        CallBodies(
            call_id="k1a",
            endpoint="chat.completions",
            status="vetoed",
            failed=True,
            request=json.dumps({"messages": harness}),
            response=_reply(vetoed),
        ),
        CallBodies(
            call_id="k1",
            endpoint="chat.completions",
            request=json.dumps({"messages": harness}),
            upstream_request=json.dumps({"messages": model}),
            response=_reply({"role": "assistant", "content": "north"}),
        ),
    ]
    task, steps, before = read_steps(readers(), calls, 200)
    assert before == [
        {"source": "system", "name": None, "content": "Overlay note.", "injected": True}
    ]
    assert task.system == "Be an agent."  # the harness's own, not the note
    assert [s.call_id for s in steps] == ["k0", "k1"]
    assert steps[0].observations == [
        {"source": "tool", "name": "look", "content": "saw 0", "injected": False},
        {"source": "user", "name": None, "content": "Try once more.", "injected": True},
    ]


def test_a_call_translated_between_apis_marks_only_what_the_overlay_added():
    # The harness spoke Anthropic Messages (two parallel tool uses, their results in one
    # user turn); the engine was given chat (upstream_request), with an overlay's hint.
    uses = [{"type": "tool_use", "id": f"c{n}", "name": "look", "input": {}} for n in (0, 1)]
    results = [
        {"type": "tool_result", "tool_use_id": f"c{n}", "content": f"saw {n}"} for n in (0, 1)
    ]
    messages = {
        "system": "Be an agent.",
        "messages": [
            {"role": "user", "content": "Find it."},
            {"role": "assistant", "content": uses},
            {"role": "user", "content": results},
        ],
    }
    both = {"role": "assistant", "content": None, "tool_calls": [_call(0), _call(1)]}
    hint = {"role": "user", "content": "Hint: look north."}
    chat = {"messages": [SYSTEM, USER, both, _result(0), _result(1), hint]}
    first = {"system": "Be an agent.", "messages": messages["messages"][:1]}
    reply = {"type": "message", "role": "assistant", "content": uses}
    calls = [
        CallBodies(call_id="k0", endpoint="messages:chat", request=json.dumps(first),
                   response=json.dumps(reply)),
        CallBodies(
            call_id="k1",
            endpoint="messages:chat",
            request=json.dumps(messages),
            upstream_request=json.dumps(chat),
            # the client's shape: a translated call stores the reply its client read
            response=json.dumps({"type": "message", "role": "assistant",
                                 "content": [{"type": "text", "text": "north"}]}),
        ),
    ]
    _, steps, before = read_steps(readers(), calls, 200)
    assert before == [] and [s.call_id for s in steps] == ["k0", "k1"]
    assert steps[0].observations == [
        {"source": "tool", "name": "look", "content": "saw 0", "injected": False},
        {"source": "tool", "name": "look", "content": "saw 1", "injected": False},
        {"source": "user", "name": None, "content": "Hint: look north.", "injected": True},
    ]


@pytest.fixture
def proxy(loop_thread, engine, db_url, tmp_path):
    settings = Settings(
        upstream=engine.url,
        db=db_url,
        data_dir=str(tmp_path / "data"),
        port=free_port(),
        overlay=[
            "noter=tests.overlay_fixtures:noter",
            "vetoer=tests.overlay_fixtures:first_vetoer",
        ],
    )
    p = Proxy(loop_thread, settings).start()
    yield p
    p.stop()


def test_packets_carry_the_overlay_its_events_and_every_step(proxy):
    register(proxy, "noted", overlay="noter", task_id="t-noted")
    run_episode(proxy, "noted", summarised, turns=3)
    register(proxy, "vetoed", overlay="vetoer", task_id="t-vetoed")
    run_episode(proxy, "vetoed", faithful, turns=2)
    proxy.flush()
    for episode in ("noted", "vetoed"):
        finish(proxy, episode, 0.0)
    result = build(proxy.settings.db, EpisodeFilter(), Options(max_chars=400, steps=10),
                   readers())
    noted, vetoed = sorted(result.packets, key=lambda p: p.episode_id)
    calls = proxy.calls("noted")

    # Every call's action is a step, though the third request summarised the first two.
    assert [s.call_id for s in noted.steps] == [c["call_id"] for c in calls]
    assert noted.steps_total == 3
    assert any("Summary so far" in (o["content"] or "") for o in noted.steps[1].observations)
    assert noted.overlay.name == "noter"
    assert [(e.hook, e.action, e.call_id) for e in noted.overlay.events] == [
        ("before_model", "inject", calls[0]["call_id"])
    ]
    assert noted.overlay.injected_context == [
        {"source": "system", "name": None, "content": NOTE, "injected": True}
    ]
    assert noted.steps[0].overlay_events == [
        {
            "call_id": calls[0]["call_id"],
            "attempt": 0,
            "hook": "before_model",
            "action": "inject",
            "reason": "note",
        }
    ]

    # The vetoer: each turn's first sample was vetoed. Those attempts are no steps and
    # no call errors; their events go with the action that replaced them, and their
    # feedback is an injected observation.
    statuses = [c["status"] for c in proxy.calls("vetoed")]
    assert statuses == ["vetoed", "ok", "vetoed", "ok"]
    assert vetoed.outcome.failure == ["unsuccessful"] and vetoed.outcome.call_errors == []
    assert vetoed.steps_total == 2
    first = vetoed.steps[0]
    assert [(e["action"], e["attempt"]) for e in first.overlay_events] == [
        ("veto", 0),
        ("accept", 1),
    ]
    injected = [o for o in first.observations if o["injected"]]
    assert [o["content"] for o in injected] == ["Try once more."]
    assert all(not o["injected"] for o in first.observations if o["source"] == "tool")


def test_packets_stay_byte_identical_with_overlays(proxy, tmp_path):
    from tracetap.analysis.packets import write

    register(proxy, "vetoed", overlay="vetoer", task_id="t")
    run_episode(proxy, "vetoed", faithful, turns=2)
    proxy.flush()
    finish(proxy, "vetoed", 0.0)
    one = write(tmp_path / "one", build(proxy.settings.db, EpisodeFilter(), Options(), readers()))
    two = write(tmp_path / "two", build(proxy.settings.db, EpisodeFilter(), Options(), readers()))
    assert [p.read_bytes() for p in one] == [p.read_bytes() for p in two]
    schema = json.loads(SCHEMA_FILE.read_text())
    for line in (tmp_path / "one" / "packets.jsonl").read_text().splitlines():
        packet = json.loads(line)
        jsonschema.validate(packet, schema)
        assert packet["overlay"]["name"] == "vetoer"
