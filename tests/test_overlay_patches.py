"""Runtime overlay patches (docs/overlays.md): installed through the admin API without a
restart, stored in the database, run in a confined worker process. Through the real
openai SDK against the running proxy and the mock engine."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import sys
import threading
from pathlib import Path

import openai
import pytest
from helpers.http import metrics_text, register
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.demo.engine import EngineConfig
from tracetap.migrations import upgrade
from tracetap.proxy.overlays import frames
from tracetap.proxy.overlays.workers import Confinement, Limits, Worker, WorkerDied
from tracetap.proxy.runtime.settings import Settings

NOTE = "Patched: answer in one word."
GOOD = f'''
async def on_episode_start(episode):
    return {{"calls": 0, "task": episode.task_id}}

async def before_model(request, state):
    state["calls"] += 1
    if state["calls"] == 1:
        return Inject(messages=[{{"role": "system", "content": "{NOTE} " + state["task"]}}],
                      at="after_system", reason="note")
'''
# Each misbehaves only when the harness's last message says so, so the same episode's
# next call shows the patch working again in a new worker.
TRIGGERED = """
import os
async def on_episode_start(episode):
    return {"started": 1}

async def before_model(request, state):
    said = request.messages[-1]["content"]
    if said == "go wrong":
        %s
    said = "working, started %%d" %% state["started"]
    return Inject(messages=[{"role": "user", "content": said}], reason="fine")
"""
MISBEHAVIOURS = {
    "raises": ("raise ValueError('patch broke')", "error", "ValueError: patch broke"),
    "allocates": (
        "x = bytearray(8 * 1024 ** 3)",
        "error",
        "MemoryError: past the patch's memory limit (--overlay-patch-memory)",
    ),
    "loops": ("while True: pass", "timeout", "ran past its 1 s budget"),
    "exits": ("os._exit(3)", "error", "its worker died (exit status 3)"),
    "exits-nicely": ("raise SystemExit(0)", "error", "SystemExit"),
}
SYSTEM = {"role": "system", "content": "Answer."}


@pytest.fixture
def engine_config() -> EngineConfig:
    return EngineConfig(flavor="vllm")


@pytest.fixture
def db_url(tmp_path):
    url = f"sqlite:///{tmp_path / 'tracetap.db'}"
    upgrade(url)
    return url


def start_proxy(loop_thread, engine, db_url, tmp_path, **options) -> Proxy:
    options.setdefault("port", free_port())
    settings = Settings(
        upstream=engine.url,
        db=db_url,
        data_dir=str(tmp_path / "data"),
        overlay_timeout=1.0,
        overlay=["fixed=tests.overlay_fixtures:noter"],
        **options,
    )
    return Proxy(loop_thread, settings).start()


@pytest.fixture
def proxy(loop_thread, engine, db_url, tmp_path):
    p = start_proxy(loop_thread, engine, db_url, tmp_path)
    yield p
    p.stop()


def install(proxy, name: str, source: str, expect: int = 201) -> dict:
    status, reply = proxy.admin("PUT", f"/tracetap/overlays/{name}", {"source": source})
    assert status == expect, reply
    return reply


def say(proxy, episode: str, text: str, **client):
    with openai.OpenAI(
        base_url=proxy.episode_url(episode), api_key="unused", max_retries=0, **client
    ) as sdk:
        return (
            sdk.chat.completions.create(
                model="mock-model", seed=1, messages=[SYSTEM, {"role": "user", "content": text}]
            )
            .choices[0]
            .message.content
        )


def overlay_of(call: dict) -> dict:
    return json.loads(call["overlay"])


def model_messages(call: dict) -> list[dict]:
    return json.loads(call["upstream_request"] or call["request"])["messages"]


def counted(proxy, overlay: str, hook: str, action: str) -> float:
    prefix = (
        f'tracetap_overlay_events_total{{action="{action}",hook="{hook}",overlay="{overlay}"}} '
    )
    lines = [line for line in metrics_text(proxy.url).splitlines() if line.startswith(prefix)]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


# ---- installed at run time ------------------------------------------------------------


def test_a_patch_installed_at_run_time_takes_effect_and_its_source_is_recorded(proxy):
    installed = install(proxy, "noter-1", GOOD)
    digest = hashlib.sha256(GOOD.encode()).hexdigest()
    assert installed["sha256"] == digest
    assert installed["hooks"] == ["on_episode_start", "before_model"]
    assert installed["limits"]["RLIMIT_AS"] == 512 * 1024**2
    register(proxy, "patched", overlay="noter-1", task_id="t-9")
    register(proxy, "plain", task_id="t-9")
    assert say(proxy, "patched", "hello") and say(proxy, "plain", "hello")
    (call,) = proxy.calls("patched")
    # The model got the note after the system prompt, with the task from the patch's state.
    assert model_messages(call)[1] == {"role": "system", "content": f"{NOTE} t-9"}
    record = overlay_of(call)
    assert (record["name"], record["patch"]) == ("noter-1", digest)
    assert record["events"] == [{"hook": "before_model", "action": "inject", "reason": "note"}]
    (plain,) = proxy.calls("plain")
    assert plain["overlay"] is None and plain["upstream_request"] is None
    assert proxy.episode("patched")["metadata"] == {"overlay": "noter-1"}
    # Listed beside the overlay loaded at start; read back with its source.
    status, listed = proxy.admin("GET", "/tracetap/overlays")
    assert status == 200
    assert [(o["name"], o["kind"]) for o in listed["overlays"]] == [
        ("fixed", "start"),
        ("noter-1", "patch"),
    ]
    status, one = proxy.admin("GET", "/tracetap/overlays/noter-1")
    assert (status, one["source"], one["sha256"]) == (200, GOOD, digest)
    # The same source again is accepted as it is; other source under the name is not.
    assert install(proxy, "noter-1", GOOD, expect=200)["sha256"] == digest
    refused = install(proxy, "noter-1", GOOD + "\n# edited\n", expect=409)
    assert refused["error"]["code"] == "overlay_exists"


def test_a_deleted_patch_is_no_longer_named_or_run(proxy):
    install(proxy, "gone", GOOD)
    register(proxy, "before", overlay="gone", task_id="t")
    status, reply = proxy.admin("DELETE", "/tracetap/overlays/gone")
    assert (status, reply) == (200, {"name": "gone", "deleted": True})
    say(proxy, "before", "hello")
    (call,) = proxy.calls("before")
    assert call["overlay"] is None  # deleted: its episodes run without it
    status, reply = proxy.admin("POST", "/tracetap/episodes", {"id": "after", "overlay": "gone"})
    assert (status, reply["error"]["code"]) == (400, "unknown_overlay")
    assert proxy.admin("DELETE", "/tracetap/overlays/gone")[0] == 404
    status, reply = proxy.admin("DELETE", "/tracetap/overlays/fixed")
    assert (status, reply["error"]["code"]) == (400, "overlay_loaded_at_start")


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("async def before_model(request, state)\n    pass\n", "line 1: expected ':'"),
        ("raise RuntimeError('no')\n", "importing it raised RuntimeError: no"),
        (
            "import socket\n",
            "importing it raised PermissionError: overlay patches may not import socket",
        ),
        ("X = 1\n", "it defines none of the hooks"),
        (
            "def before_model(request, state):\n    return None\n",
            "before_model must be a module-level 'async def'",
        ),
        (
            "AFTER_MODEL_SEES = 'all'\nasync def after_model(reply, state):\n    pass\n",
            "AFTER_MODEL_SEES is 'all'",
        ),
        ("import os\nos._exit(1)\n", "its worker died while loading it"),
    ],
)
def test_a_patch_that_does_not_load_is_a_clear_400(proxy, source, why):
    reply = install(proxy, "bad", source, expect=400)
    assert reply["error"]["code"] == "overlay_invalid"
    assert reply["error"]["message"].startswith("patch 'bad' does not load: ")
    assert why in reply["error"]["message"]
    assert proxy.admin("GET", "/tracetap/overlays/bad")[0] == 404  # nothing stored


# ---- the worker's limits, driven directly (short limits, so the test is short) -----------
def _worker_run(source: str, limits: Limits, *calls: frames.Call):
    async def run():
        worker = Worker("w", source, Confinement(limits))
        try:
            try:
                await worker.load()
            except ValueError as exc:
                return str(exc)
            for call in calls:
                try:
                    await worker.call(call, None)
                except WorkerDied as exc:
                    return str(exc)
            return None
        finally:
            await worker.kill()

    return asyncio.run(run())


def test_a_loop_at_import_ends_at_the_load_limit_not_in_a_race_with_the_cpu_limit():
    # Equal limits were a race (CI once saw the CPU limit end the load first, once the
    # wall limit): while loading, the worker's CPU limit is above the wall limit.
    why = _worker_run("while True:\n    pass\n", Limits(cpu_seconds=1, load_seconds=1))
    assert why == "loading it took longer than 1 s"


def test_a_hook_past_its_cpu_time_ends_its_worker_with_that_reason():
    # No wall budget here (the runner's --overlay-timeout is not in this path): the CPU
    # limit is the backstop that ends the loop, and says so.
    source = "async def before_model(request, state):\n    while True:\n        pass\n"
    why = _worker_run(source, Limits(cpu_seconds=1),
                      frames.Call(id=0, hook="before_model", episode="e"))
    assert why == "it used more than 1 s of CPU time (--overlay-patch-cpu)"


def test_installing_needs_the_admin_token_and_a_free_name(proxy):
    status, reply = proxy.admin("PUT", "/tracetap/overlays/x", {"source": GOOD}, token="wrong")
    assert status == 401
    assert install(proxy, "fixed", GOOD, expect=409)["error"]["code"] == "overlay_exists"
    assert (
        install(proxy, "no%20spaces", GOOD, expect=400)["error"]["code"] == "invalid_overlay_name"
    )
    status, reply = proxy.admin("PUT", "/tracetap/overlays/x", {"code": GOOD})
    assert status == 400 and "source" in reply["error"]["message"]


# ---- replayed on recorded calls -------------------------------------------------------


def test_a_patch_is_replayed_on_an_episodes_recorded_calls(proxy):
    register(proxy, "recorded", task_id="t-3")
    say(proxy, "recorded", "hello")
    say(proxy, "recorded", "again")
    install(proxy, "fine", GOOD)
    status, reply = proxy.admin(
        "POST", "/tracetap/overlays/fine/replay", {"episode": "recorded", "budget": 1}
    )
    # on_episode_start, then before_model and after_model (none here) on each call
    assert (status, reply) == (200, {"ok": True, "why": None, "hooks": 3, "calls": 2})
    breaks = "async def after_model(reply, state):\n    return reply.content.upper() + 1\n"
    install(proxy, "breaks", breaks)
    status, reply = proxy.admin("POST", "/tracetap/overlays/breaks/replay", {"episode": "recorded"})
    assert status == 200 and not reply["ok"] and reply["hooks"] == 1
    assert reply["why"].startswith("after_model failed on a recorded call: TypeError: ")
    assert proxy.admin("POST", "/tracetap/overlays/nope/replay", {"episode": "recorded"})[0] == 404
    assert proxy.admin("POST", "/tracetap/overlays/fine/replay", {"episode": "nobody"})[0] == 404
    status, reply = proxy.admin(
        "POST", "/tracetap/overlays/fine/replay", {"episode": "recorded", "budget": 0}
    )
    assert status == 400 and "budget" in reply["error"]["message"]


# ---- no network ---------------------------------------------------------------------------


def test_a_patch_cannot_connect_to_a_server_the_test_listens_on(proxy):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    tries = {
        "socket": f"__import__('socket').create_connection(('127.0.0.1', {port}), 1)",
        "asyncio": f"await __import__('asyncio').open_connection('127.0.0.1', {port})",
        "subprocess": f"__import__('subprocess').run(['nc', '127.0.0.1', '{port}'])",
        "system": f"__import__('os').system('nc 127.0.0.1 {port}')",
        "ctypes": "__import__('ctypes').CDLL(None).connect",
        "fork": "__import__('os').fork()",
    }
    body = "\n".join(
        f"    try:\n        {code}\n        out.append('{name}: done')\n"
        f"    except BaseException as exc:\n        out.append('{name}: ' + type(exc).__name__)"
        for name, code in tries.items()
    )
    source = (
        "async def before_model(request, state):\n    out = []\n"
        + body
        + "\n    return Inject(messages=[{'role': 'user', 'content': ', '.join(out)}])\n"
    )
    installed = install(proxy, "reach", source)
    register(proxy, "reach", overlay="reach")
    say(proxy, "reach", "hello")
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    thread = threading.Thread(target=accept)
    thread.start()
    thread.join()
    server.close()
    assert accepted == []  # no connection was made
    (call,) = proxy.calls("reach")
    said = model_messages(call)[-1]["content"]
    assert said == (
        "socket: PermissionError, asyncio: PermissionError, subprocess: "
        "PermissionError, system: PermissionError, ctypes: PermissionError, "
        "fork: PermissionError"
    )
    assert isinstance(installed["network_namespace"], bool)


# ---- misbehaving patches ------------------------------------------------------------------


@pytest.mark.parametrize("fail", ["open", "closed"])
def test_a_misbehaving_patch_never_takes_the_proxy_down(
    loop_thread, engine, db_url, tmp_path, fail
):
    """Raising, allocating too much, looping forever, exiting the process: each fails
    only its own hook (open: the call goes on as it was; closed: a clear 500), is counted
    and recorded, and the proxy keeps serving other episodes; the patch's next call runs
    in a new worker."""
    p = start_proxy(loop_thread, engine, db_url, tmp_path, overlay_fail=fail)
    try:
        install(p, "good", GOOD)
        for name, (code, action, why) in MISBEHAVIOURS.items():
            install(p, name, TRIGGERED % code)
            register(p, f"bad-{name}", overlay=name)
            register(p, f"other-{name}", overlay="good", task_id="t")
            if fail == "open":
                assert say(p, f"bad-{name}", "go wrong")  # the model answered
            else:
                with pytest.raises(openai.InternalServerError) as caught:
                    say(p, f"bad-{name}", "go wrong")
                assert caught.value.code == "overlay_failed"
                assert f"overlay '{name}' failed in before_model: " in caught.value.message
            assert say(p, f"other-{name}", "hello")  # another episode, served as ever
            assert say(p, f"bad-{name}", "fine now")  # the patch works again
            first, second = p.calls(f"bad-{name}")
            assert first["status"] == ("ok" if fail == "open" else "overlay_failed"), name
            (event,) = overlay_of(first)["events"]
            assert (event["hook"], event["action"]) == ("before_model", action), name
            assert why in event["reason"], (name, event)
            if fail == "open":
                assert first["upstream_request"] is None  # the request as the harness sent it
            assert model_messages(second)[-1]["content"] == "working, started 1", name
            assert counted(p, name, "before_model", action) == 1, name
            (other,) = p.calls(f"other-{name}")
            assert model_messages(other)[1]["content"] == f"{NOTE} t"
        assert p.state.overlays.patches.restarts()["loops"] == 1
        assert p.state.overlays.patches.restarts()["exits"] == 1
    finally:
        p.stop()


# ---- the database holds the patch ----------------------------------------------------------


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_a_restarted_proxy_runs_the_same_patch_from_the_database(
    request, loop_thread, engine, tmp_path, database
):
    url = (
        f"sqlite:///{tmp_path / 'restart.db'}"
        if database == "sqlite"
        else request.getfixturevalue("fresh_postgres")
    )
    upgrade(url)
    first = start_proxy(loop_thread, engine, url, tmp_path)
    try:
        digest = install(first, "kept", GOOD)["sha256"]
        register(first, "across", overlay="kept", task_id="t-1")
        say(first, "across", "before the restart")
    finally:
        first.stop()
    # The same port: the episode's base URL (its key) is the one registration gave.
    second = start_proxy(loop_thread, engine, url, tmp_path, port=first.settings.port)
    try:
        register(second, "after", overlay="kept", task_id="t-2")  # known from the database
        say(second, "across", "after the restart")
        say(second, "after", "hello")
        _, later = second.calls("across")
        (new,) = second.calls("after")
        for call, task in ((later, "t-1"), (new, "t-2")):
            assert overlay_of(call)["patch"] == digest
            # The episode's state started again here: its first call on this process.
            assert model_messages(call)[1] == {"role": "system", "content": f"{NOTE} {task}"}
    finally:
        second.stop()


# ---- tracetap run --overlay-file ----------------------------------------------------------


def test_tracetap_run_installs_the_patch_and_registers_every_episode_with_it(
    proxy, tmp_path, capsys
):
    from tracetap.cli import main

    scripts = Path(__file__).parent / "run_scripts"
    (tmp_path / "tasks").mkdir()
    with open(tmp_path / "tasks.jsonl", "w") as f:
        for task_id in ("t1", "t2"):
            f.write(json.dumps({"id": task_id}) + "\n")
            (tmp_path / "tasks" / f"{task_id}.json").write_text("{}")
    (tmp_path / "note.py").write_text(GOOD)
    harness = (
        f"{sys.executable} {scripts / 'harness.py'} {{base_url}} {{task.id}} x {{episode}} "
        f"{tmp_path}"
    )
    code = main(
        ["run", "--proxy", proxy.url, "--admin-token", proxy.admin_token, "--tasks",
         str(tmp_path / "tasks.jsonl"), "--harness", harness, "--overlay-file",
         str(tmp_path / "note.py"), "--run-id", "patched", "--json"]
    )  # fmt: skip
    assert code == 0
    assert json.loads(capsys.readouterr().out)["ran"] == 2
    digest = hashlib.sha256(GOOD.encode()).hexdigest()
    name = f"note-{digest[:8]}"  # the file's stem and its source's hash
    status, listed = proxy.admin("GET", "/tracetap/overlays")
    assert ("patch", name) in [(o["kind"], o["name"]) for o in listed["overlays"]]
    assert status == 200
    status, page = proxy.admin("GET", "/tracetap/episodes")
    assert status == 200
    episodes = [e for e in page["data"] if e["id"].startswith("patched.")]
    assert len(episodes) == 2
    for episode in episodes:
        assert proxy.episode(episode["id"])["metadata"]["overlay"] == name
        (call,) = proxy.calls(episode["id"])
        assert overlay_of(call)["patch"] == digest
        # The harness sends no system prompt: the note leads.
        assert model_messages(call)[0]["content"] == f"{NOTE} {episode['task_id']}"
