"""Runtime overlay patches: installed through the admin API, stored in the database, run
in a worker process each (``overlays.workers``), never in the proxy's.

A patch is Python source with some of the four hooks as module-level ``async``
functions (docs/overlays.md). ``PatchOverlay`` gives the runner (``overlays.runner``) the
same object it gets for an overlay loaded at start, whose hooks forward to the worker, so
budgets, fail open/closed, events and records are the runner's own code for both.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.proxy.overlays import frames
from tracetap.proxy.overlays.hooks import EpisodeInfo, ModelReply, ModelRequest, Observation
from tracetap.proxy.overlays.workers import Confinement, Worker, WorkerDied, WorkerRefused
from tracetap.storage import patches as stored

log = logging.getLogger("tracetap.overlays")

NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_SOURCE = 256 * 1024  # characters of patch source
# A process with no patch yet looks for one when an install's notice comes (Postgres) or
# the database changed (SQLite), storage.notify; every IDLE_FOLLOW_SECONDS besides (a lost
# notice), and every FOLLOW_SECONDS while notices do not arrive.
FOLLOW_SECONDS = 5.0
IDLE_FOLLOW_SECONDS = 30.0


class PatchFailed(Exception):
    """The patch's hook raised, or returned something it may not (the worker says which)."""


class PatchRefused(Exception):
    """An install the API refuses: ``code`` is the error code, the message says why."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class PatchState:
    """What the runner keeps as a patched episode's state: only its registration (the
    patch's own state lives in the worker)."""

    def __init__(self, info: EpisodeInfo) -> None:
        self.info = info


class PatchOverlay:
    """An installed patch, as the runner sees an overlay. A hook the patch lacks is None
    here too (the runner reads that: no ``after_model``, no held streams)."""

    def __init__(
        self, name: str, sha256: str, worker: Worker, hooks: list[str], after_model_sees: str
    ) -> None:
        self.name = name
        self.sha256 = sha256
        self.worker = worker
        self.hooks = hooks
        self.after_model_sees = after_model_sees
        for hook in ("before_model", "after_model", "on_observation"):
            if hook not in hooks:
                setattr(self, hook, None)

    async def ready(self) -> None:
        """The worker started (a restart, a first use on this process), before a hook's
        time budget runs: starting a process is not the hook's time."""
        if not self.worker.alive:
            try:
                await self.worker.load()
            except (ValueError, WorkerRefused) as exc:
                raise PatchFailed(f"its worker did not start: {exc}") from exc

    async def on_episode_start(self, episode: EpisodeInfo) -> PatchState:
        state = PatchState(episode)
        if "on_episode_start" in self.hooks:
            await self._call(state, "on_episode_start")
        return state

    async def before_model(self, request: ModelRequest, state: PatchState) -> Any:
        return await self._call(state, "before_model", request=request)

    async def after_model(self, reply: ModelReply, state: PatchState) -> Any:
        return await self._call(state, "after_model", reply=reply)

    async def on_observation(self, observations: list[Observation], state: PatchState) -> Any:
        return await self._call(state, "on_observation", observations=observations)

    async def _call(self, state: PatchState | None, hook: str, **argument: Any) -> Any:
        if state is None:  # the start failed open: the episode runs with a fresh state
            state = PatchState(EpisodeInfo(id=""))
        episode = state.info.id
        start = None
        if "on_episode_start" in self.hooks:
            start = frames.Call(id=0, hook="on_episode_start", episode=episode, start=state.info)
        call = frames.Call(id=0, hook=hook, episode=episode, **argument)
        try:
            answer = await self.worker.call(call, start)
        except WorkerDied as exc:
            raise PatchFailed(f"its worker died ({exc}); it is started again") from exc
        if answer.kind == "error":
            raise PatchFailed(answer.error or "the hook failed")
        try:
            return frames.result(answer)
        except ValueError as exc:
            raise PatchFailed(str(exc)) from exc


def sha256(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


class Patches:
    """The patches this process knows, by name; every one is also in the database."""

    def __init__(
        self, engine: AsyncEngine, confinement: Confinement, reserved: frozenset[str]
    ) -> None:
        self.engine = engine
        self.confinement = confinement  # limits, sandbox, cap: shared by every worker
        self.reserved = reserved  # the names of overlays loaded at start
        self._live: dict[str, PatchOverlay] = {}
        self._lock = asyncio.Lock()
        self.any = False  # whether a patch may exist: until then, calls skip the lookup

    async def install(self, name: str, source: str) -> tuple[dict[str, Any], bool]:
        """Load the patch in a worker and store it; (its description, whether it is new).
        PatchRefused when the name is taken or the patch does not load."""
        if not NAME.fullmatch(name):
            raise PatchRefused(
                400,
                "invalid_overlay_name",
                f"overlay name {name!r}: 1-64 characters A-Z a-z 0-9 . _ -",
            )
        if name in self.reserved:
            raise PatchRefused(
                409,
                "overlay_exists",
                f"overlay {name!r} is loaded at start (--overlay); choose another name",
            )
        if len(source) > MAX_SOURCE:
            raise PatchRefused(
                400,
                "overlay_too_large",
                f"the patch has {len(source)} characters; at most {MAX_SOURCE}",
            )
        digest = sha256(source)
        existing = await stored.get(self.engine, name)
        if existing is not None:
            return self._same(name, digest, existing), False
        worker = self.worker(name, source)
        try:
            loaded = await worker.load()
        except WorkerRefused as exc:
            await worker.kill()
            raise PatchRefused(503, exc.code, f"patch {name!r} is not installed: {exc}") from exc
        except ValueError as exc:
            await worker.kill()
            raise PatchRefused(
                400, "overlay_invalid", f"patch {name!r} does not load: {exc}"
            ) from exc
        row = await stored.add(
            self.engine,
            name=name,
            sha256=digest,
            source=source,
            hooks=loaded.hooks,
            after_model_sees=loaded.after_model_sees,
        )
        if row["sha256"] != digest:  # another process stored another patch first
            await worker.kill()
            return self._same(name, digest, row), False
        async with self._lock:
            old = self._live.pop(name, None)
            self._live[name] = PatchOverlay(
                name, digest, worker, loaded.hooks, loaded.after_model_sees
            )
        if old is not None:
            await old.worker.kill()
        self.any = True
        log.info(
            "overlay patch %s installed (sha256 %s, sandbox %s, uid %d, seccomp %s)",
            name,
            digest[:12],
            loaded.sandbox,
            loaded.uid,
            loaded.seccomp,
        )
        return {
            **_described(row),
            "network_namespace": loaded.network_namespace,
            "limits": loaded.limits,
            "sandbox": loaded.sandbox,
            "uid": loaded.uid,
            "seccomp": loaded.seccomp,
        }, True

    def worker(self, name: str, source: str) -> Worker:
        """A worker for this patch source, in this process's sandbox and under its cap
        (installed patches, and the short-lived ones of a replay)."""
        return Worker(name, source, self.confinement)

    def _same(self, name: str, digest: str, row: dict[str, Any]) -> dict[str, Any]:
        if row["sha256"] != digest:
            raise PatchRefused(
                409,
                "overlay_exists",
                f"overlay {name!r} is installed with other source (sha256 "
                f"{row['sha256'][:12]}...); delete it first",
            )
        return _described(row)

    async def get(self, name: str) -> PatchOverlay | None:
        """The patch of that name (from the database when this process has not loaded it:
        installed on another replica, or before a restart); None if there is none."""
        patch = self._live.get(name)
        if patch is not None or not NAME.fullmatch(name):
            return patch
        row = await stored.get(self.engine, name)
        if row is None:
            return None
        async with self._lock:
            patch = self._live.get(name)
            if patch is None:  # its worker starts at its first hook
                patch = self._live[name] = PatchOverlay(
                    name,
                    row["sha256"],
                    self.worker(name, row["source"]),
                    row["hooks"],
                    row["after_model_sees"],
                )
        self.any = True
        return patch

    async def remove(self, name: str) -> bool:
        found = await stored.remove(self.engine, name)
        patch = self._live.pop(name, None)
        if patch is not None:
            await patch.worker.kill()
        return found or patch is not None

    async def described(self, name: str) -> dict[str, Any] | None:
        """One stored patch, with its source."""
        row = await stored.get(self.engine, name) if NAME.fullmatch(name) else None
        return None if row is None else {**_described(row), "source": row["source"]}

    async def listed(self) -> list[dict[str, Any]]:
        return [_described(row) for row in await stored.listed(self.engine)]

    def restarts(self) -> dict[str, int]:
        return {name: p.worker.restarts for name, p in self._live.items()}

    async def refresh(self) -> None:
        """Whether the database holds a patch yet (installed elsewhere, or before)."""
        try:
            self.any = self.any or await stored.any_stored(self.engine)
        except Exception as exc:  # the database is down: follow() looks again later
            log.debug("cannot look for overlay patches: %s", exc)

    async def follow(self, wait: Callable[[], Awaitable[None]] | None = None) -> None:
        """Until a patch is known: look for one when ``wait`` returns (an install's
        notice, storage.notify), or every FOLLOW_SECONDS."""
        while not self.any:
            if wait is None:
                await asyncio.sleep(FOLLOW_SECONDS)
            else:
                await wait()
            await self.refresh()

    async def close(self) -> None:
        for patch in list(self._live.values()):
            await patch.worker.kill()
        self._live.clear()


def _described(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": row["name"],
        "kind": "patch",
        "sha256": row["sha256"],
        "hooks": row["hooks"],
        "after_model_sees": row["after_model_sees"],
        "created_at": row["created_at"],
    }
