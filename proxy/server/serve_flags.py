"""``tracetap serve``'s flags and TRACETAP_* variables, read into ``Settings``
(``proxy.runtime.settings``): each flag's help ends with its variable and default."""

from __future__ import annotations

import argparse
from pathlib import Path

from tracetap.proxy.episodes.policy_models import OTHER_MODELS
from tracetap.proxy.overlays.bwrap import SANDBOXES as PATCH_SANDBOXES
from tracetap.proxy.overlays.loader import FAIL_MODES
from tracetap.proxy.runtime.settings import FLAVORS, Settings
from tracetap.storage import config
from tracetap.storage.config import env as _env
from tracetap.storage.config import env_flag as _env_bool


def _int_env(name: str) -> int | None:
    value = _env(name)
    return None if value is None else int(value)


def _float_env(name: str) -> float | None:
    value = _env(name)
    return None if value is None else float(value)


def _documented(parser: argparse.ArgumentParser, defaults: Settings):
    """``add_argument`` that ends each help text with its variable and default."""

    def add(flag: str, **kw):
        name = flag.lstrip("-").replace("-", "_")
        action = kw.get("action")
        shown = {"store_true": "off", "store_false": "on"}.get(
            action, getattr(defaults, kw.get("dest", name), None))
        if shown == ["http://unset"]:
            shown = None
        var = kw.pop("var", None) or config.variable(flag)  # --no-X may be read as X=0
        kw["help"] = config.described(kw.get("help", ""), var=var, default=shown)
        return parser.add_argument(flag, **kw)

    return add


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    d = Settings(upstream=["http://unset"])  # defaults, one place
    a = _documented(parser, d)
    a("--upstream", action="append", default=None,
      help="model server base URL, e.g. http://127.0.0.1:8000/v1; repeat for several, or "
           "model=NAME,url=URL to send one model to its own server")
    a("--host", default=_env("host", d.host),
      help="address to listen on; a non-loopback address needs --admin-token")
    a("--port", type=int, default=int(_env("port", d.port)), help="port agents connect to")
    a("--upstream-api-key", default=_env("upstream_api_key"),
      help="sent upstream; never stored (prefer the variable: a flag shows in the process list)")
    a("--upstream-flavor", default=_env("upstream_flavor", d.upstream_flavor), choices=FLAVORS,
      help="what the engine is, for what to ask it (auto: detected from /v1/models, /version)")
    a("--tokenizer", default=_env("tokenizer"), metavar="PATH",
      help="the model's tokenizer, for engines that return no token ids and cannot render "
           "a chat (llama-cpp-python): a Hugging Face tokenizer directory or tokenizer.json "
           "with its chat template, or the engine's GGUF file (best effort); tracetap renders "
           "and tokenizes with it instead of asking the engine, and keeps only ids that match "
           "the engine's usage.prompt_tokens and its per-token strings (token source "
           "local_tokenizer). Needs pip install 'tracetap[tokenizer]'")
    a("--upstream-timeout", type=float, default=float(_env("upstream_timeout", d.upstream_timeout)),
      help="seconds to wait for each upstream read (no total limit on streams)")
    a("--connect-timeout", type=float, default=float(_env("connect_timeout", d.connect_timeout)),
      help="seconds to connect to the upstream")
    a("--max-connections", type=int, default=int(_env("max_connections", d.max_connections)),
      help="pooled upstream connections")
    a("--forward-client-auth", action="store_true", default=_env_bool("forward_client_auth"),
      help="pass the client's own Authorization header upstream")
    a("--db", default=_env("db"), metavar="URL",
      help=config.db_help("to store into"))
    a("--data-dir", default=_env("data_dir", d.data_dir), metavar="DIR",
      help=config.DATA_DIR_HELP)
    a("--max-body", type=int, default=int(_env("max_body", d.max_body)),
      help="request body limit in bytes on every agent path, counted after gzip or "
           "deflate is inflated (413 above)")
    a("--body-timeout", type=float, default=float(_env("body_timeout", d.body_timeout)),
      help="seconds a request body may stall between bytes before a 408")
    a("--idle-timeout", type=float, default=float(_env("idle_timeout", d.idle_timeout)),
      help="seconds a client connection may go without sending a whole request's headers "
           "(idle keep-alive, or headers sent slowly) before it is closed")
    a("--max-peer-connections", type=int,
      default=int(_env("max_peer_connections", d.max_peer_connections)),
      help="open connections one client address may hold; past it a 429 and close "
           "(0: no cap)")
    a("--journal-max-bytes", type=int, default=int(_env("journal_max_bytes", d.journal_max_bytes)),
      help="journal bound; past it records are dropped and counted")
    a("--drain-timeout", type=float, default=float(_env("drain_timeout", d.drain_timeout)),
      help="seconds to finish in-flight calls on SIGTERM")
    a("--admin-token", default=_env("admin_token"),
      help="bearer token for the admin API (default: generated once into DATA_DIR/admin-token); "
           "a flag's value shows in the process list: prefer --admin-token-file or the variable")
    a("--admin-token-file", metavar="PATH", default=_env("admin_token_file"),
      help="read the admin API's bearer token from this file (kept out of the process list)")
    a("--admin-port", type=int, default=_int_env("admin_port"),
      help="serve the admin API on this port only (same --host), not on the agent port")
    a("--admin-socket", default=_env("admin_socket"),
      help="serve the admin API on this Unix socket only, not on the agent port")
    a("--allow-path", action="append", default=None, metavar="RULE",
      help="also expose '/path', '/prefix/*' or 'METHOD /path' to agents (repeatable; "
           "TRACETAP_ALLOW_PATH takes a comma-separated list)")
    a("--allow-request-field", action="append", default=None, metavar="NAME",
      help="let agents send this request field to the engine although it is not a "
           "sampling field of its API (docs/apis.md: e.g. priority); repeatable; "
           "TRACETAP_ALLOW_REQUEST_FIELD takes a comma-separated list")
    a("--translate", default=_env("translate", d.translate),
      help="which client APIs to translate to chat completions upstream: auto (Messages "
           "always, Responses unless the upstream is vLLM), none, all, or a list such as "
           "'responses,messages'")
    a("--model-map", action="append", default=None, metavar="PATTERN=MODEL",
      help="send MODEL upstream when a client names a model matching PATTERN, e.g. "
           "'claude-*=qwen3-8b' (repeatable; TRACETAP_MODEL_MAP takes a comma-separated list)")
    a("--policy-model", action="append", default=None, metavar="NAME",
      help="a model the episodes' calls may use, as sent upstream (after --model-map): "
           "registration's policy_models overrides it; none named allows every model "
           "(repeatable; TRACETAP_POLICY_MODEL takes a comma-separated list)")
    a("--other-models", default=_env("other_models", d.other_models), choices=OTHER_MODELS,
      help="a call to a model outside its episode's policy models: refuse (403, never "
           "sent upstream) or store (served, stored with status other_model: no policy "
           "version, never trained)")
    a("--repair-history", action="store_true", default=_env_bool("repair_history"),
      help="send the engine the model's own earlier turns when a harness resends them "
           "reformatted (equal after normalisation; docs/fidelity.md); per episode: "
           '"repair_history" at registration')
    a("--overlay", action="append", default=None, metavar="NAME=MODULE:FACTORY",
      help="load an overlay (lifecycle hooks at the model boundary; docs/overlays.md) from "
           "your own code: package.module:factory, options as ,key=value; episodes opt in "
           'with "overlay": NAME at registration (an agent\'s X-Tracetap-Overlay header is '
           "refused) (repeatable; TRACETAP_OVERLAY takes a space-separated list)")
    a("--overlay-fail", default=_env("overlay_fail", d.overlay_fail), choices=FAIL_MODES,
      help="when a hook raises or runs over --overlay-timeout: open leaves the call as it "
           "was, closed fails it with a clear error; both log and count it")
    a("--overlay-timeout", type=float,
      default=float(_env("overlay_timeout", d.overlay_timeout)),
      help="seconds each hook may run")
    a("--overlay-max-resamples", type=int,
      default=int(_env("overlay_max_resamples", d.overlay_max_resamples)),
      help="times a vetoed reply is sampled again before the last one is delivered")
    a("--overlay-patch-memory", type=int, metavar="MIB",
      default=int(_env("overlay_patch_memory", d.overlay_patch_memory)),
      help="address space (RLIMIT_AS) of each runtime patch's worker process "
           "(PUT /tracetap/overlays/NAME; docs/overlays.md)")
    a("--overlay-patch-cpu", type=int, metavar="SECONDS",
      default=int(_env("overlay_patch_cpu", d.overlay_patch_cpu)),
      help="CPU seconds (RLIMIT_CPU) a runtime patch's hook may use before its worker is "
           "ended: a backstop behind --overlay-timeout")
    a("--overlay-patch-max-workers", type=int, metavar="N",
      default=int(_env("overlay_patch_max_workers", d.overlay_patch_max_workers)),
      help="runtime patch workers at once (so at most N x --overlay-patch-memory in all); "
           "an install past it is refused (503 overlay_capacity)")
    a("--overlay-patch-sandbox", choices=PATCH_SANDBOXES,
      default=_env("overlay_patch_sandbox", d.overlay_patch_sandbox),
      help="bwrap runs each runtime patch in bubblewrap's namespaces as another user, with "
           "seccomp (patches are refused where it cannot be set up); unsandboxed runs them "
           "as plain child processes that can read what the proxy can: only for patches "
           "you trust (docs/overlays.md)")
    a("--episode-max-calls", type=int, default=_int_env("episode_max_calls"),
      help="default per-episode budget: model calls")
    a("--episode-max-tokens", type=int, default=_int_env("episode_max_tokens"),
      help="default per-episode budget: prompt + completion tokens")
    a("--episode-max-seconds", type=float, default=_float_env("episode_max_seconds"),
      help="default per-episode budget: seconds from registration or first call")
    a("--require-episode", action="store_true", default=_env_bool("require_episode"),
      help="refuse calls that carry no episode (400)")
    a("--require-registered", action="store_true", default=_env_bool("require_registered"),
      help="refuse episode ids not created through the admin API")
    a("--no-overhead-header", dest="overhead_header", action="store_false",
      default=not _env_bool("no_overhead_header"),
      help="do not add x-tracetap-overhead-ms to non-streaming replies")
    a("--public-url", default=_env("public_url"), help="base URL agents reach the proxy at")
    a("--workers", type=int, default=int(_env("workers", d.workers)),
      help="processes serving the port (SO_REUSEPORT; Linux, BSD, macOS), each with its own "
           "journal (DATA_DIR/journal, journal-1, ...); a crashed one is restarted "
           "(docs/scaling.md)")
    a("--pause-timeout", type=float, default=float(_env("pause_timeout", d.pause_timeout)),
      help="seconds a call waits while paused (POST /tracetap/pause) before a 503")
    a("--call-deadline", type=float, default=float(_env("call_deadline", d.call_deadline)),
      help="seconds a model call may take in all, however it is stuck (a stream its client "
           "does not read holds a pause): then it is ended and stored as deadline_exceeded; "
           "0: no deadline")
    a("--routed-experts", action="store_true", default=_env_bool("routed_experts"),
      help="ask the engine for the MoE experts it routed each completion token to "
           "(return_routed_experts; vLLM: serve with --enable-return-routed-experts), keep "
           "them from the agent, store and export them for router replay (docs/export.md)")
    a("--no-search-index", dest="search_index", action="store_false",
      var=config.SEARCH_INDEX_VARIABLE, default=config.search_index(),
      help="do not index calls for the viewer's full-text search (the search page then "
           "finds episodes by id), for a smaller database and a faster writer "
           "(docs/scaling.md, Storage per token); the variable turns it off with 0")


def settings_from_args(args: argparse.Namespace) -> Settings:
    if not args.upstream and _env("upstream"):
        args.upstream = [_env("upstream")]  # flags win over the environment
    if not args.upstream:
        raise ValueError("--upstream (or TRACETAP_UPSTREAM) is required")
    if args.allow_path is None:
        args.allow_path = config.env_list("allow_path")
    if args.allow_request_field is None:
        args.allow_request_field = config.env_list("allow_request_field")
    if args.model_map is None:
        args.model_map = config.env_list("model_map")
    if args.policy_model is None:
        args.policy_model = config.env_list("policy_model")
    if args.overlay is None:
        args.overlay = (config.env("overlay") or "").split()
    token_file = getattr(args, "admin_token_file", None)
    if token_file:
        if args.admin_token:
            raise ValueError("--admin-token and --admin-token-file: give one")
        args.admin_token = read_token_file(token_file)
    fields = {f: getattr(args, f) for f in Settings.__struct_fields__ if hasattr(args, f)}
    return Settings(**fields)


def read_token_file(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"--admin-token-file {path}: {exc.strerror or exc}") from None
    if not token:
        raise ValueError(f"--admin-token-file {path} is empty")
    return token
