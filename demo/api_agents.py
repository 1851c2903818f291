"""The demo's agent on the other two wire APIs: OpenAI Responses and Anthropic Messages.

Same task, tool and reward as ``agent.run_agent``; only the SDK calls and the history
format differ, as they do between a Responses-only and a Messages-only harness. Each
resends the whole conversation every turn (``store=False`` for Responses), like the
coding-agent CLIs that use these APIs.
"""

from __future__ import annotations

import json
from typing import Any

from tracetap.demo.agent import MAX_TURNS, SYSTEM, TOOLS, AgentRun, Task, Turn, lookup

RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]
MESSAGES_TOOLS = [{"name": f["name"], "description": f["description"],
                   "input_schema": f["parameters"]} for f in (TOOLS[0]["function"],)]


async def run_responses_agent(client, task: Task, *, model: str,
                              extra_body: dict | None = None) -> AgentRun:
    """``client`` is an ``openai.AsyncOpenAI``; every other turn streams."""
    run = AgentRun(task)
    items: list[dict[str, Any]] = [{"role": "user", "content": task.question}]
    for number in range(1, MAX_TURNS + 1):
        kwargs = dict(model=model, instructions=SYSTEM, input=items, tools=RESPONSES_TOOLS,
                      store=False, extra_body=extra_body or None)
        streamed = number % 2 == 0
        if streamed:
            async with client.responses.stream(**kwargs) as stream:
                reply = await stream.get_final_response()
        else:
            reply = await client.responses.create(**kwargs)
        calls = [o for o in reply.output if o.type == "function_call"]
        run.turns.append(Turn(streamed, [
            {"id": c.call_id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls],
            reply.output_text or None))
        if not calls:
            return run
        items.extend(o.model_dump(exclude_none=True) for o in reply.output)
        items.extend({"type": "function_call_output", "call_id": c.call_id,
                      "output": lookup(task, c.arguments)} for c in calls)
    raise RuntimeError(f"the agent gave up on {task.id!r} after {MAX_TURNS} turns")


async def run_messages_agent(client, task: Task, *, model: str,
                             extra_body: dict | None = None) -> AgentRun:
    """``client`` is an ``anthropic.AsyncAnthropic``; every other turn streams."""
    run = AgentRun(task)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.question}]
    for number in range(1, MAX_TURNS + 1):
        kwargs = dict(model=model, system=SYSTEM, messages=messages, tools=MESSAGES_TOOLS,
                      max_tokens=512, extra_body=extra_body or None)
        streamed = number % 2 == 0
        if streamed:
            async with client.messages.stream(**kwargs) as stream:
                reply = await stream.get_final_message()
        else:
            reply = await client.messages.create(**kwargs)
        uses = [b for b in reply.content if b.type == "tool_use"]
        text = "".join(b.text for b in reply.content if b.type == "text")
        run.turns.append(Turn(streamed, [
            {"id": u.id, "type": "function",
             "function": {"name": u.name, "arguments": json.dumps(u.input)}} for u in uses],
            text or None))
        if not uses:
            return run
        messages.append({"role": "assistant",
                         "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": u.id,
             "content": lookup(task, json.dumps(u.input))} for u in uses]})
    raise RuntimeError(f"the agent gave up on {task.id!r} after {MAX_TURNS} turns")
