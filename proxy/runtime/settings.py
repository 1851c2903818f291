"""Configuration for ``tracetap serve``, read once from flags and TRACETAP_* variables."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import msgspec

from tracetap.proxy.apis.registry import exposed_paths
from tracetap.proxy.apis.routing import parse_translate
from tracetap.proxy.episodes.budgets import Budget
from tracetap.proxy.episodes.model_map import ModelMap
from tracetap.proxy.episodes.policy_models import OTHER_MODELS
from tracetap.proxy.http.exposure import Exposure
from tracetap.proxy.overlays.bwrap import SANDBOXES as PATCH_SANDBOXES
from tracetap.proxy.overlays.loader import FAIL_MODES, parse_specs
from tracetap.proxy.upstream.specs import UpstreamSpec, parse_upstreams
from tracetap.storage import config

FLAVORS = ("auto", "openai", "vllm", "sglang", "llamacpp")
MAX_WORKERS = 256


class Worker(msgspec.Struct, frozen=True):
    """Which of ``serve --workers N`` processes this is (``proxy.server.workers``)."""

    index: int
    count: int
    metrics_dir: str  # prometheus_client's multiprocess directory, shared by the workers


class Settings(msgspec.Struct, kw_only=True):
    upstream: list[str]
    host: str = "127.0.0.1"
    port: int = 8080
    upstream_api_key: str | None = None
    upstream_flavor: str = "auto"
    upstream_timeout: float = 600.0
    connect_timeout: float = 10.0
    max_connections: int = 1024
    forward_client_auth: bool = False
    db: str | None = None
    data_dir: str = config.DEFAULT_DATA_DIR
    max_body: int = 64 << 20
    body_timeout: float = 60.0
    idle_timeout: float = 75.0
    max_peer_connections: int = 1024
    journal_max_bytes: int = 1 << 30
    drain_timeout: float = 30.0
    admin_token: str | None = None
    require_episode: bool = False
    require_registered: bool = False
    overhead_header: bool = True
    public_url: str | None = None
    pause_timeout: float = 120.0
    call_deadline: float = 1800.0  # proxy.call.deadline; 0: none
    allow_path: list[str] = []
    allow_request_field: list[str] = []  # engine fields agents may send (proxy.apis.fields)
    admin_port: int | None = None
    admin_socket: str | None = None
    episode_max_calls: int | None = None
    episode_max_tokens: int | None = None
    episode_max_seconds: float | None = None
    translate: str = "auto"
    model_map: list[str] = []
    policy_model: list[str] = []  # the models an episode may use (registration overrides)
    other_models: str = "refuse"  # a call to another: refuse (403) or store (not trained)
    repair_history: bool = False
    overlay: list[str] = []
    overlay_fail: str = "open"
    overlay_timeout: float = 2.0
    overlay_max_resamples: int = 2
    overlay_patch_memory: int = 512  # MiB of address space for a runtime patch's worker
    overlay_patch_cpu: int = 10  # CPU seconds a runtime patch's hook may use (a backstop)
    overlay_patch_max_workers: int = 8  # patch workers at once (x --overlay-patch-memory)
    overlay_patch_sandbox: str = "bwrap"  # or "unsandboxed": the operator trusts patches
    workers: int = 1
    tokenizer: str | None = None
    routed_experts: bool = False  # ask for MoE routing, store it (proxy.call.routed_experts)
    search_index: bool = True  # index calls for the viewer's search (storage.search_index)

    def local_tokenizer(self):
        """The tokenizer --tokenizer names (proxy.tokens.local_tokenizer), loaded; None without."""
        if self.tokenizer is None:
            return None
        from tracetap.proxy.tokens import local_tokenizer
        return local_tokenizer.load(self.tokenizer)

    @property
    def upstreams(self) -> list[UpstreamSpec]:
        return parse_upstreams(self.upstream)

    @property
    def database_url(self) -> str:
        return config.database_url(self.db, self.data_dir)

    @property
    def default_budget(self) -> Budget:
        return Budget(max_calls=self.episode_max_calls, max_tokens=self.episode_max_tokens,
                      max_seconds=self.episode_max_seconds)

    @property
    def journal_dir(self) -> Path:
        return self.worker_journal(0)

    def worker_journal(self, index: int) -> Path:
        """Worker 0 (and a single process) keeps DATA_DIR/journal; worker i, journal-i.
        Worker i keeps index i across restarts, so its journal is replayed by itself."""
        return Path(self.data_dir) / ("journal" if index == 0 else f"journal-{index}")

    @property
    def admin_listener(self) -> bool:
        """Whether the admin API has a listener of its own (and so not the agent port)."""
        return self.admin_port is not None or self.admin_socket is not None

    @property
    def base_url(self) -> str:
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")

    def __post_init__(self) -> None:
        # Checked in this order, so that a command line with several mistakes names the
        # same one first whatever is refactored here.
        self._check_listening()
        self._check_behaviour()
        self._check_reaching()

    def _check_listening(self) -> None:
        """The upstreams, ports, timeouts and processes."""
        if isinstance(self.upstream, str):
            self.upstream = [self.upstream]
        parse_upstreams(self.upstream)  # fail at start, with the flag's name
        if not 0 < self.port < 65536:
            # Episode base URLs carry the port, so it must be the one agents will use.
            raise ValueError(f"--port must be 1-65535, got {self.port}")
        if self.admin_port is not None and not (
                0 < self.admin_port < 65536 and self.admin_port != self.port):
            raise ValueError(f"--admin-port must be 1-65535 and not --port, got {self.admin_port}")
        for name in ("body_timeout", "idle_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if not self.call_deadline >= 0:
            raise ValueError("--call-deadline must be 0 (none) or more")
        if self.max_peer_connections < 0:
            raise ValueError("--max-peer-connections must be 0 (no cap) or more")
        if not 0 < self.workers <= MAX_WORKERS:
            raise ValueError(f"--workers must be 1-{MAX_WORKERS}, got {self.workers}")

    def _check_behaviour(self) -> None:
        """What the proxy does to calls: paths, models, translation, overlays, budgets."""
        Exposure(self.allow_path, exposed_paths())  # fail at start on a bad --allow-path
        for name in self.allow_request_field:  # proxy.apis.fields lets them through
            if not name or not all(c.isalnum() or c in "_-." for c in name):
                raise ValueError(f"--allow-request-field {name!r}: give a request field's name")
        ModelMap(self.model_map)
        if self.other_models not in OTHER_MODELS:
            raise ValueError(f"--other-models must be one of {', '.join(OTHER_MODELS)}")
        parse_translate(self.translate)
        parse_specs(self.overlay)
        if self.overlay_fail not in FAIL_MODES:
            raise ValueError(f"--overlay-fail must be one of {', '.join(FAIL_MODES)}")
        if not self.overlay_timeout > 0:
            raise ValueError(f"--overlay-timeout must be positive, got {self.overlay_timeout}")
        if self.overlay_max_resamples < 0:
            raise ValueError("--overlay-max-resamples must be 0 or more")
        if self.overlay_patch_memory < 64 or self.overlay_patch_cpu < 1:
            raise ValueError("--overlay-patch-memory is 64 MiB or more, "
                             "--overlay-patch-cpu 1 s or more")
        if self.overlay_patch_max_workers < 1:
            raise ValueError("--overlay-patch-max-workers is 1 or more")
        if self.overlay_patch_sandbox not in PATCH_SANDBOXES:
            raise ValueError(
                f"--overlay-patch-sandbox is one of {', '.join(PATCH_SANDBOXES)}")
        self.default_budget  # noqa: B018 -- fail at start on a non-positive limit

    def _check_reaching(self) -> None:
        """How the proxy reaches the engine, and who may reach the proxy's admin API."""
        if self.upstream_flavor not in FLAVORS:
            raise ValueError(f"--upstream-flavor must be one of {', '.join(FLAVORS)}")
        if self.tokenizer is not None:
            from tracetap.proxy.tokens import local_tokenizer
            local_tokenizer.check(self.tokenizer)  # the path, and the optional package
        if any(spec.has_credentials for spec in self.upstreams) and (
                self.upstream_api_key or self.forward_client_auth):
            # Both would be the upstream's Authorization header: say so now, rather than
            # fail every call.
            raise ValueError(
                "an --upstream URL with user:password@ authenticates with HTTP Basic, which "
                "takes the Authorization header that --upstream-api-key (or "
                "--forward-client-auth) also sets: use one or the other")
        if not is_loopback(self.host) and not self.admin_token:
            raise ValueError(
                f"refusing to listen on {self.host} without --admin-token: the admin API "
                "would be open to the network"
            )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
