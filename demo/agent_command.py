"""The scripted agent (``demo.agent``) as a harness command for ``tracetap run``:

    python -m tracetap.demo.agent_command BASE_URL TASK_ID SEED

It exits 0 when the episode succeeded (every tool call's arguments fit the tool's schema)
and 1 when it failed, so ``tracetap run``'s default grader (the exit status) scores it.
"""

from __future__ import annotations

import asyncio
import sys

from openai import AsyncOpenAI

from tracetap.demo.agent import TASKS, run_agent


async def _main(base_url: str, task_id: str, seed: int) -> int:
    task = next((t for t in TASKS if t.id == task_id), None)
    if task is None:
        print(f"no task {task_id!r}; tasks: {', '.join(t.id for t in TASKS)}", file=sys.stderr)
        return 2
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        run = await run_agent(client, task, model="mock-model", seed=seed)
    if run.failure is not None:
        print(run.failure, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    url, task_id, seed = sys.argv[1:4]
    sys.exit(asyncio.run(_main(url, task_id, int(seed))))
