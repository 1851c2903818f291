"""One agent framework, as its docs show it, on one small task: ``python frameworks.py NAME``.

Runs in the frameworks' own venv (install.sh), not the suite's: the frameworks pin their
own ``openai``/``pydantic``. Reads ``OPENAI_BASE_URL`` (tracetap's episode URL, with /v1),
``OPENAI_API_KEY`` and ``HARNESS_MODEL``; works in the current directory, where the test put
``notes.txt``. Prints the final answer. The tool's ``path`` is an enum, so a model that
follows the schema (the mock engine does) reads the real file.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Literal

TASK = "Read notes.txt with the read_file tool, then tell me the answer it holds."
MODEL = os.environ.get("HARNESS_MODEL", "mock-model")
BASE_URL = os.environ["OPENAI_BASE_URL"]
KEY = os.environ.get("OPENAI_API_KEY", "dummy")


def read_file(path: Literal["notes.txt"]) -> str:
    """Read a text file in the working directory.

    Args:
        path: the file to read.
    """
    try:
        return Path(path).read_text()
    except OSError as exc:  # the tool's answer to the model, as a real tool would give
        return f"error: {exc}"


def openai_agents() -> str:
    """The Agents SDK with its defaults: the Responses API."""
    from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no trace export to OpenAI's servers
    set_default_openai_client(AsyncOpenAI(base_url=BASE_URL, api_key=KEY))
    agent = Agent(name="reader", instructions="Use the tool, then answer.", model=MODEL,
                  tools=[function_tool(read_file)])
    return str(Runner.run_sync(agent, TASK, max_turns=4).final_output)


def langchain_openai() -> str:
    """ChatOpenAI with bound tools, the tool loop written out as langchain's docs do."""
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    read = tool(read_file)
    model = ChatOpenAI(model=MODEL, base_url=BASE_URL, api_key=KEY, max_retries=0)
    bound = model.bind_tools([read])
    messages = [SystemMessage("Use the tool, then answer."), HumanMessage(TASK)]
    for _ in range(4):
        reply = bound.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            return str(reply.content)
        for call in reply.tool_calls:
            messages.append(ToolMessage(read.invoke(call["args"]), tool_call_id=call["id"]))
    raise SystemExit("langchain: no answer after 4 turns")


def pydantic_ai() -> str:
    """pydantic-ai's Agent on its OpenAI chat model with an OpenAI-compatible provider."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=BASE_URL, api_key=KEY))
    agent = Agent(model, instructions="Use the tool, then answer.", tools=[read_file])
    return str(agent.run_sync(TASK).output)


def smolagents() -> str:
    """smolagents' ToolCallingAgent on OpenAIServerModel."""
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    model = OpenAIServerModel(model_id=MODEL, api_base=BASE_URL, api_key=KEY)
    agent = ToolCallingAgent(tools=[tool(read_file)], model=model, max_steps=3,
                             verbosity_level=0)
    return str(agent.run(TASK))


FRAMEWORKS = {"openai-agents": openai_agents, "langchain-openai": langchain_openai,
              "pydantic-ai": pydantic_ai, "smolagents": smolagents}


def main() -> None:
    answer = FRAMEWORKS[sys.argv[1]]()
    print(json.dumps({"answer": answer}))


if __name__ == "__main__":
    main()
