"""A harness for tests/test_run.py: one chat call with the real openai SDK at the base
URL it is given, with behaviour the task asks for, leaving files the test reads.

    harness.py BASE_URL TASK_ID STYLE EPISODE DIR

Task behaviour comes from DIR/tasks/TASK_ID.json: ``exit`` (its exit status), ``sleep``
(seconds, after starting a child that sleeps too: a timeout must kill both), ``barrier``
(wait until that many harnesses run at once, up to 15 s; it records
how many it saw running, at the barrier and at most), ``block`` (wait while the file
DIR/block exists, up to 30 s), ``stderr`` (text it prints to stderr before it exits).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import openai

base_url, task_id, style, episode, where = sys.argv[1:6]
where = Path(where)
task = json.loads((where / "tasks" / f"{task_id}.json").read_text())
running = where / "running"
running.mkdir(exist_ok=True)
(running / episode).touch()
with open(where / "started", "a") as log:
    log.write(f"{task_id} {episode} {os.getpid()}\n")
seen = peak = 1  # harnesses running when the barrier opened; the most seen at once
if task.get("barrier"):
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        seen = len(list(running.iterdir()))
        peak = max(peak, seen)
        if seen >= task["barrier"]:
            break
        time.sleep(0.05)
if task.get("block"):
    deadline = time.monotonic() + 30
    while (where / "block").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
if task.get("sleep"):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (where / "child.pid").write_text(str(child.pid))
    time.sleep(task["sleep"])
client = openai.OpenAI(base_url=base_url, api_key=os.environ["OPENAI_API_KEY"], max_retries=0)
reply = client.chat.completions.create(
    model="mock-model",
    max_tokens=4,
    messages=[{"role": "user", "content": f"solve {task_id} in style {style}"}],
)
peak = max(peak, len(list(running.iterdir())))
out = where / "out"
out.mkdir(exist_ok=True)
(out / f"{episode}.json").write_text(
    json.dumps(
        {
            "argv": sys.argv[1:],
            "env_base_url": os.environ["OPENAI_BASE_URL"],
            "env_episode": os.environ["TRACETAP_EPISODE"],
            "seen": seen,
            "peak": peak,
            "admin_token_leaked": any(k == "TRACETAP_ADMIN_TOKEN" for k in os.environ),
            "reply": reply.choices[0].message.content,
        }
    )
)
(running / episode).unlink()
sys.stderr.write(task.get("stderr", ""))  # why it failed, in its own words
sys.exit(task.get("exit", 0))
