"""A runtime patch tries, from inside its worker, what an attacker would (docs/overlays.md,
"What a patch can reach"): steal the admin token, the data dir or the database, kill or
lock up the proxy, make files, look at the proxy's sockets. Against ``tracetap serve`` as
a real process (the worker's parent), through the admin API and the real openai SDK: the
patch reports what it got as its ``after_model`` rewrite, so the test reads exactly what
an agent would have received."""

from __future__ import annotations

import ast
import json
import os
import sqlite3
import sys
import urllib.request

import openai
import pytest
from helpers.http import register
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.migrations import upgrade
from tracetap.proxy.runtime.settings import Settings

# Each try is an expression; the patch records "ok: <value>" or the exception's type.
SPY = '''
import json, os
got = {}

def attempt(name, thunk):
    try:
        value = thunk()
        got[name] = "ok: " + (value if isinstance(value, str) else repr(value))[:2000]
    except BaseException as exc:
        got[name] = type(exc).__name__

def descriptors():
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink("/proc/self/fd/" + fd)
        except OSError:
            pass  # the listing's own, closed by now
    return out

%s

async def after_model(reply, state):
    return Rewrite(content=json.dumps(got), reason="spy")
'''


def spy(tries: dict[str, str]) -> str:
    lines = "\n".join(f"attempt({name!r}, lambda: {code})" for name, code in tries.items())
    return SPY % lines


@pytest.fixture
def served(run_proxy, engine, tmp_path):
    db = tmp_path / "tracetap.db"
    url = f"sqlite:///{db}"
    upgrade(url)
    return run_proxy(engine.url, url), db


def install(proxy, name: str, source: str) -> tuple[int, dict]:
    return proxy.admin("PUT", f"/tracetap/overlays/{name}", {"source": source})


def said(proxy, name: str) -> dict[str, str]:
    """Install the spy, run one call of an episode under it, and read what it reported."""
    status, reply = install(proxy, name, spy(TRIES[name](proxy)))
    assert status == 201, reply
    register(proxy, f"e-{name}", overlay=name)
    with openai.OpenAI(base_url=proxy.episode_url(f"e-{name}"), api_key="unused",
                       max_retries=0) as sdk:
        content = sdk.chat.completions.create(
            model="mock-model", messages=[{"role": "user", "content": "hi"}]
        ).choices[0].message.content
    return json.loads(content)


def _secrets(proxy) -> dict[str, str]:
    data = proxy.args[proxy.args.index("--data-dir") + 1]
    db = proxy.args[proxy.args.index("--db") + 1].removeprefix("sqlite:///")
    return {"pid": str(proxy.process.pid), "data": data, "db": db,
            "port": f":{proxy.port:04X}"}


TRIES = {
    "files": lambda p: {
        "token": f"open({_secrets(p)['data'] + '/admin-token'!r}).read()",
        "data_dir": f"os.listdir({_secrets(p)['data']!r})",
        "database": f"open({_secrets(p)['db']!r}, 'rb').read(64).decode('latin-1')",
        "cmdline": f"open('/proc/{_secrets(p)['pid']}/cmdline').read()",
        "environ": f"open('/proc/{_secrets(p)['pid']}/environ').read()",
        "home": "os.listdir(os.path.expanduser('~'))",
        "root": "sorted(os.listdir('/'))",
        "dev": "sorted(os.listdir('/dev'))",
        "init_cmdline": "open('/proc/1/cmdline').read()",
        "kernel": "open('/proc/loadavg').read()",
    },
    "processes": lambda p: {
        "pids": "sorted(int(d) for d in os.listdir('/proc') if d.isdigit())",
        "proxy_tcp": f"open('/proc/{_secrets(p)['pid']}/net/tcp').read()",
        "own_tcp": "open('/proc/net/tcp').read() + open('/proc/net/tcp6').read()",
        "uid": "(os.getresuid(), os.getresgid(), os.getgroups())",
        "caps": "[l for l in open('/proc/self/status') if l.startswith('CapEff')][0]",
        "fds": "descriptors()",
        "files_limit": "[open('/proc/self/status') for _ in range(64)]",
        "signal_parent": "__import__('signal').pidfd_send_signal("
                         "os.pidfd_open(os.getppid()), 0)",
        "ptrace_parent": "open(f'/proc/{os.getppid()}/mem', 'rb').read(1)",
    },
    "writes": lambda p: {
        "mkfifo_data": f"os.mkfifo({_secrets(p)['data'] + '/fifo'!r})",
        "mkfifo_tmp": "os.mkfifo('/tmp/fifo')",
        "mkfifo_shm": "os.mkfifo('/dev/shm/fifo')",
        "mknod_tmp": "os.mknod('/tmp/node')",
        "utime_usr": "os.utime('/usr', (0, 0))",
        "utime_db": f"os.utime({_secrets(p)['db']!r}, (0, 0))",
        "sqlite_new": "__import__('sqlite3').connect('/tmp/x.db').execute('create table a(b)')",
        "sqlite_shm": "__import__('sqlite3').connect('/dev/shm/x.db')"
                      ".execute('create table a(b)')",
        "sqlite_data": f"__import__('sqlite3').connect({_secrets(p)['data'] + '/x.db'!r})"
                       ".execute('create table a(b)')",
    },
}


def test_a_patch_reads_no_token_no_data_dir_no_database_and_no_proxy_process(served):
    proxy, db = served
    got = said(proxy, "files")
    read = [n for n in ("token", "data_dir", "database", "cmdline", "environ", "home")
            if got[n].startswith("ok")]
    assert read == [], got
    everything = json.dumps(got)
    assert proxy.admin_token not in everything
    assert "SQLite format 3" not in everything and str(db) not in everything
    # What it can read: bubblewrap's init's command line (binds, no secret), bubblewrap's
    # minimal /dev, what the kernel tells any process.
    assert got["init_cmdline"].startswith("ok") and got["kernel"].startswith("ok")
    assert _secrets(proxy)["data"] not in got["init_cmdline"]
    assert set(ast.literal_eval(got["dev"].removeprefix("ok: "))) <= {
        "core", "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin",
        "stdout", "tty", "urandom", "zero"}
    # Its root holds the system's libraries, the Python install and its own code only.
    assert set(ast.literal_eval(got["root"].removeprefix("ok: "))) <= {
        "bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "proc", "dev",
        "tracetap-worker", os.path.realpath(sys.base_prefix).split("/")[1],
    }


def test_a_patch_sees_no_other_process_and_runs_as_another_user_with_nothing_but_its_pipes(
    served,
):
    proxy, _ = served
    got = said(proxy, "processes")
    # Its own PID namespace: bubblewrap's init and the worker, nobody else.
    assert ast.literal_eval(got["pids"].removeprefix("ok: ")) == [1, 2]
    assert got["proxy_tcp"] == "FileNotFoundError"
    # Its own network namespace: the proxy's listening port is in no table it can read.
    assert _secrets(proxy)["port"] not in got["own_tcp"]
    uids, gids, groups = ast.literal_eval(got["uid"].removeprefix("ok: "))
    assert set(uids) == {65534} and set(gids) == {65534} and set(groups) <= {65534}
    assert got["caps"].split()[-1] == "0000000000000000"
    # Every descriptor it holds is one of its three pipes to the proxy (frames in on 0,
    # out on 3, stderr on 1 and 2, and copies of them): no file, socket or database.
    fds = ast.literal_eval(got["fds"].removeprefix("ok: "))
    assert set(fds.values()) == {fds[0], fds[2], fds[3]} and fds[1] == fds[2], fds
    assert got["files_limit"] == "OSError"  # RLIMIT_NOFILE: too many open files
    assert got["signal_parent"] == "PermissionError"
    assert not got["ptrace_parent"].startswith("ok")


def test_a_patch_makes_no_file_fifo_node_or_database_and_changes_no_timestamp(
    served, tmp_path
):
    proxy, db = served
    before = os.stat(db).st_mtime_ns
    files_before = sorted(os.listdir(tmp_path / "data"))
    got = said(proxy, "writes")
    done = [name for name, outcome in got.items() if outcome.startswith("ok")]
    assert done == [], got
    assert sorted(os.listdir(tmp_path / "data")) == files_before
    assert os.stat(db).st_mtime_ns >= before  # not set back (utime_db)


def test_a_patch_cannot_kill_the_proxy_while_it_is_installed(served):
    proxy, _ = served
    kill = ("import os, signal\n"
            "signal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGKILL)\n"
            "async def before_model(request, state):\n    return None\n")
    status, reply = install(proxy, "killer", kill)
    assert status == 400, reply
    assert "PermissionError" in reply["error"]["message"]
    with urllib.request.urlopen(proxy.url + "/healthz", timeout=5) as answer:
        assert answer.status == 200
    assert proxy.process.poll() is None


def test_a_patch_cannot_hold_the_database_locked(served):
    proxy, db = served
    # Wrapped, so the patch loads whatever happens: then registration, finishing and
    # deleting overlays must still work.
    lock = (f"import sqlite3\ntry:\n    held = sqlite3.connect({str(db)!r}, "
            "isolation_level=None, timeout=0)\n    held.execute('BEGIN IMMEDIATE')\n"
            "    HELD = 'locked'\nexcept Exception as exc:\n    HELD = type(exc).__name__\n"
            "async def after_model(reply, state):\n    return Rewrite(content=HELD)\n")
    status, reply = install(proxy, "locker", lock)
    assert status == 201, reply
    register(proxy, "after-lock", overlay="locker")
    with openai.OpenAI(base_url=proxy.episode_url("after-lock"), api_key="unused",
                       max_retries=0) as sdk:
        content = sdk.chat.completions.create(
            model="mock-model", messages=[{"role": "user", "content": "hi"}]
        ).choices[0].message.content
    assert content == "OperationalError"
    status, _ = proxy.admin("POST", "/tracetap/episodes/after-lock/finish", {"reward": 1.0})
    assert status == 200
    assert proxy.admin("DELETE", "/tracetap/overlays/locker")[0] == 200
    with sqlite3.connect(db, timeout=0) as mine:  # nobody holds it
        mine.execute("BEGIN IMMEDIATE")
        mine.rollback()


# ---- where there is no sandbox; the cap on workers -----------------------------------------
GOOD = "async def before_model(request, state):\n    return None\n"


def start(loop_thread, engine, tmp_path, **options) -> Proxy:
    url = f"sqlite:///{tmp_path / 'in-process.db'}"
    if not (tmp_path / "in-process.db").exists():
        upgrade(url)
    settings = Settings(upstream=engine.url, db=url, data_dir=str(tmp_path / "data"),
                        port=free_port(), **options)
    return Proxy(loop_thread, settings).start()


@pytest.mark.parametrize("bwrap", ["missing", "refusing"])
def test_where_the_sandbox_cannot_be_set_up_patches_are_refused_unless_trusted_by_name(
    loop_thread, engine, tmp_path, monkeypatch, caplog, bwrap
):
    folder = tmp_path / "bin"
    folder.mkdir()
    if bwrap == "refusing":  # what bubblewrap says where the kernel allows no namespace
        fake = folder / "bwrap"
        fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace, "
                        "likely because the kernel does not allow non-privileged user "
                        "namespaces.' >&2\nexit 1\n")
        fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(folder))
    refusing = start(loop_thread, engine, tmp_path)
    try:
        status, reply = install(refusing, "note", GOOD)
        assert (status, reply["error"]["code"]) == (503, "overlay_sandbox_unavailable")
        why = {"missing": "bubblewrap (bwrap) is not installed",
               "refusing": "bwrap: No permissions to create new namespace"}[bwrap]
        assert why in reply["error"]["message"]
        assert "--overlay-patch-sandbox unsandboxed" in reply["error"]["message"]
        assert refusing.admin("GET", "/tracetap/overlays/note")[0] == 404  # nothing stored
    finally:
        refusing.stop()
    trusting = start(loop_thread, engine, tmp_path, overlay_patch_sandbox="unsandboxed")
    try:
        status, reply = install(trusting, "note", GOOD)
        assert (status, reply["sandbox"]) == (201, "unsandboxed")
        assert "runtime overlay patches run unsandboxed" in caplog.text  # said in the log
    finally:
        trusting.stop()


def test_patch_workers_are_capped_in_number_and_a_deleted_patch_frees_its_place(
    loop_thread, engine, tmp_path
):
    proxy = start(loop_thread, engine, tmp_path, overlay_patch_max_workers=2,
                  overlay_patch_memory=128)
    try:
        for name in ("one", "two"):
            status, reply = install(proxy, name, GOOD + f"# {name}\n")
            assert (status, reply["sandbox"], reply["uid"], reply["seccomp"]) == (
                201, "bwrap", 65534, True)
        status, reply = install(proxy, "three", GOOD + "# three\n")
        assert (status, reply["error"]["code"]) == (503, "overlay_capacity")
        assert "--overlay-patch-max-workers 2: 256 MiB in all" in reply["error"]["message"]
        assert proxy.admin("GET", "/tracetap/overlays/three")[0] == 404
        # A replay's worker counts too.
        register(proxy, "recorded")
        status, reply = proxy.admin("POST", "/tracetap/overlays/one/replay",
                                    {"episode": "recorded"})
        assert (status, reply["error"]["code"]) == (503, "overlay_capacity")
        assert proxy.admin("DELETE", "/tracetap/overlays/one")[0] == 200
        assert install(proxy, "three", GOOD + "# three\n")[0] == 201
    finally:
        proxy.stop()


def test_a_proxy_running_as_another_user_confines_patches_in_a_user_namespace(
    monkeypatch, tmp_path
):
    """The path a proxy that is not root takes (the image's): bubblewrap makes a user
    namespace in which the worker is 65534. Driven here by telling the launcher it does
    not run as root."""
    import asyncio

    from tracetap.proxy.overlays import bwrap, frames
    from tracetap.proxy.overlays.hooks import ModelReply
    from tracetap.proxy.overlays.workers import Confinement, Limits, Worker

    monkeypatch.setattr(bwrap, "_as_root", lambda: False)
    secret = tmp_path / "admin-token"
    secret.write_text("s3cret")
    source = spy({
        "token": f"open({str(secret)!r}).read()",
        "uid": "(os.getresuid(), os.getresgid())",
        "pids": "sorted(int(d) for d in os.listdir('/proc') if d.isdigit())",
        "signal_parent": "__import__('signal').pidfd_send_signal("
                         "os.pidfd_open(os.getppid()), 0)",
        "mkfifo_shm": "os.mkfifo('/dev/shm/fifo')",
        "sqlite_root": "__import__('sqlite3').connect('/x.db').execute('create table a(b)')",
    })

    async def run():
        worker = Worker("userns", source, Confinement(Limits(), bwrap.Launcher("bwrap")))
        try:
            loaded = await worker.load()
            reply = ModelReply(content="x", tool_calls=[], finish_reason="stop", tools=None,
                               attempt=0)
            answer = await worker.call(
                frames.Call(id=0, hook="after_model", episode="e", reply=reply), None)
            return loaded, json.loads(frames.result(answer).content)
        finally:
            await worker.kill()

    loaded, got = asyncio.run(run())
    assert "--unshare-user" in bwrap.bwrap_argv("bwrap", [])
    assert (loaded.sandbox, loaded.uid, loaded.seccomp) == ("bwrap", 65534, True)
    assert got["token"] == "FileNotFoundError"
    uids, gids = ast.literal_eval(got["uid"].removeprefix("ok: "))
    assert set(uids) == set(gids) == {65534}
    assert ast.literal_eval(got["pids"].removeprefix("ok: ")) == [1, 2]
    for name in ("signal_parent", "mkfifo_shm", "sqlite_root"):
        assert not got[name].startswith("ok"), (name, got[name])
