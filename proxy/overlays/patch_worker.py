"""A patch's worker process: confines itself, loads the patch, then answers hook calls.

Started by the proxy (``overlays.workers``), in the sandbox ``overlays.bwrap`` builds,
as ``patch_worker MEMORY_MB CPU_SECONDS FILES LOAD_SECONDS SANDBOX``, with frames
(``overlays.frames``) on stdin and stdout; ``patch_worker probe`` only confines itself
and says ``sandboxed`` (the proxy's check that the sandbox works here). Everything it
needs is imported and every file descriptor it uses is open before it confines itself;
the patch is compiled and run after, so nothing in it runs unconfined. Hooks run one at
a time; the episodes' states (what ``on_episode_start`` returned) live here and never
leave the process.
"""

from __future__ import annotations

import inspect
import os
import signal
import sys
import types
from collections import OrderedDict
from typing import Any

from tracetap.proxy.overlays import frames, hooks, sandbox
from tracetap.proxy.overlays.hooks import HOOKS, Inject, Rewrite, Veto

MAX_EPISODES = 10_000  # as the proxy keeps: the least recently used state goes first
RETURNS = {"before_model": (Inject,), "on_observation": (Inject,), "after_model": (Rewrite, Veto)}
KINDS = {Inject: "inject", Rewrite: "rewrite", Veto: "veto"}


class Pipe:
    """The frames: read from stdin, written to a private copy of stdout (fd 1 itself is
    pointed at stderr, so a patch's print() cannot corrupt a frame by accident)."""

    def __init__(self) -> None:
        self.inp = 0
        self.out = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def read(self) -> bytes | None:
        header = self._exactly(4)
        return None if header is None else self._exactly(frames.length(header))

    def _exactly(self, n: int) -> bytes | None:
        parts, left = [], n
        while left:
            piece = os.read(self.inp, min(left, 1 << 20))
            if not piece:
                return None  # the proxy went away
            parts.append(piece)
            left -= len(piece)
        return b"".join(parts)

    def write(self, message: Any) -> None:
        data = frames.frame(message)
        while data:
            data = data[os.write(self.out, data) :]


def load(name: str, source: str) -> types.ModuleType:
    """The patch as a module; ValueError naming what is wrong with it."""
    module = types.ModuleType(f"tracetap_patch_{name.replace('-', '_').replace('.', '_')}")
    module.__dict__.update(Inject=Inject, Rewrite=Rewrite, Veto=Veto, ToolCall=hooks.ToolCall)
    try:
        code = compile(source, f"<patch {name}>", "exec")
    except SyntaxError as exc:
        raise ValueError(f"line {exc.lineno}: {exc.msg}") from exc
    try:
        exec(code, module.__dict__)
    except BaseException as exc:  # SystemExit included: a patch never ends the worker
        raise ValueError(f"importing it raised {type(exc).__name__}: {exc}") from exc
    found = [h for h in HOOKS if module.__dict__.get(h) is not None]
    if not found:
        raise ValueError(f"it defines none of the hooks {', '.join(HOOKS)}")
    for hook in found:
        if not inspect.iscoroutinefunction(module.__dict__[hook]):
            raise ValueError(f"{hook} must be a module-level 'async def'")
    sees = module.__dict__.get("AFTER_MODEL_SEES", "reply")
    if sees not in ("reply", "tool_calls"):
        raise ValueError(f"AFTER_MODEL_SEES is {sees!r}, not 'reply' or 'tool_calls'")
    return module


class Served:
    """The loaded patch and its episodes' states."""

    def __init__(self, module: types.ModuleType, cpu_seconds: int) -> None:
        self.module = module
        self.cpu_seconds = cpu_seconds
        self.states: OrderedDict[str, Any] = OrderedDict()

    def answer(self, call: frames.Call) -> frames.Answer:
        sandbox.cpu_budget(self.cpu_seconds)
        try:
            value = _complete(self._run(call))
        except BaseException as exc:  # SystemExit, MemoryError, RecursionError: reported
            return frames.Answer(id=call.id, kind="error", error=_why(exc))
        if value is None:
            return frames.Answer(id=call.id, kind="none")
        return frames.Answer(id=call.id, kind=KINDS[type(value)], value=frames.encode(value))

    async def _run(self, call: frames.Call) -> Any:
        fn = self.module.__dict__.get(call.hook)
        if call.hook == "on_episode_start":
            state = None if fn is None else await fn(call.start)
            self.states[call.episode] = state
            self.states.move_to_end(call.episode)
            if len(self.states) > MAX_EPISODES:
                self.states.popitem(last=False)
            return None
        if fn is None:
            return None
        state = self.states.get(call.episode)
        argument = {
            "before_model": call.request,
            "after_model": call.reply,
            "on_observation": call.observations,
        }[call.hook]
        value = await fn(argument, state)
        allowed = RETURNS[call.hook]
        if value is not None and type(value) not in allowed:
            raise TypeError(
                f"returned {type(value).__name__}, not "
                f"{' or '.join(t.__name__ for t in allowed)} or None"
            )
        return value


def _complete(coroutine: Any) -> Any:
    """Run a hook's coroutine to its end. There is no event loop here: asyncio imports
    subprocess (and _posixsubprocess, which spawns processes unaudited), so the worker
    never loads it, and a hook that awaits something that suspends it (a sleep, a
    future) fails instead."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError(
        "the hook awaited something that suspends it (asyncio is not "
        "available to patches: hooks run to their end at once)"
    )


def _why(exc: BaseException) -> str:
    if isinstance(exc, MemoryError) and not str(exc):  # RLIMIT_AS said no: say so
        return "MemoryError: past the patch's memory limit (--overlay-patch-memory)"
    return f"{type(exc).__name__}: {exc}"[:500]


def probe() -> int:
    """Confine as a worker does, with nothing to load, and say so."""
    sandbox.confine(memory_mb=256, cpu_seconds=5, files=16, sandboxed=True)
    os.write(1, b"sandboxed\n")
    return 0


def main(argv: list[str]) -> int:
    if argv == ["probe"]:
        return probe()
    memory_mb, cpu_seconds, files, load_seconds = (int(a) for a in argv[:4])
    sandboxed = argv[4] == "bwrap"
    sys.dont_write_bytecode = True
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past RLIMIT_FSIZE fails, quietly
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the proxy's to handle
    pipe = Pipe()
    first = pipe.read()
    if first is None:
        return 0
    request = frames.to_worker(first)
    assert isinstance(request, frames.Load)
    served = Served(types.ModuleType("unloaded"), cpu_seconds)
    confined = sandbox.confine(
        memory_mb=memory_mb, cpu_seconds=cpu_seconds, files=files, sandboxed=sandboxed
    )
    sandbox.cpu_budget(load_seconds + cpu_seconds)  # the proxy's wall limit ends a load first
    try:
        served.module = load(request.name, request.source)
    except ValueError as exc:
        pipe.write(frames.Failed(error=str(exc)))
        return 1
    pipe.write(
        frames.Loaded(
            hooks=[h for h in HOOKS if served.module.__dict__.get(h) is not None],
            after_model_sees=served.module.__dict__.get("AFTER_MODEL_SEES", "reply"),
            network_namespace=confined.network_namespace,
            limits=confined.limits,
            sandbox=argv[4],
            uid=confined.uid,
            seccomp=confined.seccomp,
        )
    )
    while (data := pipe.read()) is not None:
        call = frames.to_worker(data)
        if isinstance(call, frames.Call):
            pipe.write(served.answer(call))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
