"""Which turns of a conversation the viewer shows collapsed: everything before the last
turn (what followed the request's last assistant message, then the reply), in each API's
shape, and never every turn."""

from __future__ import annotations

import json

import pytest

from tracetap.proxy.apis.registry import readers
from tracetap.viewer.conversation import open_from, preview, turns

TOOL_CALL = {"id": "c1", "type": "function",
             "function": {"name": "shell", "arguments": '{"cmd": "ls"}'}}
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "list"},
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py\nb.py"}]
REPLY = json.dumps({"choices": [{"message": {"role": "assistant", "content": "two files"}}]})


@pytest.mark.parametrize("endpoint,request_body,response_body,roles_open", [
    # the tool result and the reply open; system, user and the tool call collapsed
    ("chat.completions", {"messages": CHAT}, REPLY, ["tool", "assistant"]),
    # a first call: nothing before its last turn
    ("chat.completions", {"messages": CHAT[:2]}, REPLY, ["system", "user", "assistant"]),
    # a failed call (no reply): the tool result stays open
    ("chat.completions", {"messages": CHAT}, None, ["tool"]),
    # a prefill (the request ends with the assistant's words), no reply: that message
    ("chat.completions", {"messages": [*CHAT[:2], {"role": "assistant", "content": "Su"}]},
     None, ["assistant"]),
    ("responses", {"input": [{"type": "message", "role": "user", "content": "list"},
                             {"type": "function_call", "name": "shell", "arguments": "{}",
                              "call_id": "c1"},
                             {"type": "function_call_output", "call_id": "c1",
                              "output": "a.py"}]},
     json.dumps({"output": [{"type": "message", "role": "assistant", "content": "ok"}]}),
     ["tool", "assistant"]),
    ("messages", {"messages": [
        {"role": "user", "content": "list"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shell",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "a.py"}]}]},
     json.dumps({"role": "assistant", "content": [{"type": "text", "text": "ok"}]}),
     ["tool", "assistant"]),
])
def test_the_last_turn_is_open_and_the_turns_before_it_collapsed(endpoint, request_body,
                                                                 response_body, roles_open):
    shown = turns(readers(), endpoint, json.dumps(request_body), response_body)
    assert [t.role for t in shown[open_from(shown):]] == roles_open


def test_a_collapsed_turn_reads_as_one_line_of_its_text_or_its_tool_calls():
    shown = turns(readers(), "chat.completions", json.dumps({"messages": [
        {"role": "user", "content": "first   line\n\nsecond " + "word " * 100}, CHAT[2]]}), None)
    assert preview(shown[0]).startswith("first line second word word")
    assert len(preview(shown[0])) == 140 and preview(shown[0]).endswith("\u2026")
    assert preview(shown[1]) == "shell()"
