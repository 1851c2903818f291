"""The one function that builds a running proxy's state (docs/architecture.md).

Every part is made here, in the order they need each other, and given what it reads at
construction: nothing is set on a part afterwards. Starting and stopping the parts (the
writer, the background tasks) is the app's lifecycle (proxy/server/app.py).
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Mapping
from typing import Any

from tracetap.proxy.admin.token import ensure_admin_token
from tracetap.proxy.apis.fields import RequestFields
from tracetap.proxy.apis.registry import exposed_paths, readers
from tracetap.proxy.apis.routing import Routing
from tracetap.proxy.episodes.arrivals import Arrivals
from tracetap.proxy.episodes.budgets import Budgets
from tracetap.proxy.episodes.ids import instance_id
from tracetap.proxy.episodes.model_map import ModelMap
from tracetap.proxy.episodes.policy_models import PolicyModels
from tracetap.proxy.episodes.repair import Repair
from tracetap.proxy.episodes.tagging import Tagger
from tracetap.proxy.http.exposure import Exposure
from tracetap.proxy.http.failures import Failures
from tracetap.proxy.overlays.bwrap import Launcher
from tracetap.proxy.overlays.patches import Patches
from tracetap.proxy.overlays.runner import Overlays
from tracetap.proxy.overlays.workers import Confinement, Limits
from tracetap.proxy.policy.controls import Controls
from tracetap.proxy.policy.gate import Gate
from tracetap.proxy.runtime.metrics import Metrics
from tracetap.proxy.runtime.settings import Settings, Worker
from tracetap.proxy.runtime.state import ProxyState
from tracetap.proxy.tokens.prompt_prefix import PromptPrefixes
from tracetap.proxy.tokens.resolve import TokenResolver
from tracetap.proxy.upstream.client import UpstreamClient
from tracetap.proxy.upstream.flavor import Flavor
from tracetap.proxy.upstream.pool import Pool
from tracetap.storage import queries
from tracetap.storage.engine import create_engine
from tracetap.storage.intents import Intents, NoIntents, intents_engine, replica_id
from tracetap.storage.journal import Journal
from tracetap.storage.writer import Writer


async def compose_state(settings: Settings, overlays: Mapping[str, Any],
                        worker: Worker | None = None) -> ProxyState:
    """The proxy's parts; the upstream client is started (it is the pool's), nothing else
    is. ``overlays``: the operator's hooks by name, imported at start."""
    engine = create_engine(settings.database_url)
    metrics = Metrics(multiprocess_dir=worker and worker.metrics_dir)
    journal = Journal(settings.worker_journal(worker.index if worker else 0),
                      settings.journal_max_bytes)
    client = UpstreamClient(timeout=settings.upstream_timeout,
                            connect_timeout=settings.connect_timeout,
                            max_connections=settings.max_connections,
                            api_key=settings.upstream_api_key)
    await client.start()
    pool = Pool(settings.upstreams, client)
    upstream_kind = Flavor(settings.upstream_flavor)
    # Token ids an engine did not return are asked of its tokenizer as records are written
    # (or of the local one --tokenizer names, loaded once here).
    local = await asyncio.to_thread(settings.local_tokenizer)  # a GGUF's: seconds
    prefixes = PromptPrefixes()  # the relay's and the resolver's: one bound, one forget
    resolver = TokenResolver(
        client, metrics.ids_missing, local=local, processes=worker.count if worker else 1,
        traffic=pool.traffic,  # llama-cpp-python cuts streams when asked meanwhile
        flavor=upstream_kind,
        address=pool.address,  # records name an upstream with its credentials masked
        prefixes=prefixes)
    gate = Gate(settings.pause_timeout)
    instance = instance_id()
    # Replicas share a Postgres: each call's intent is stored before its answer ends
    # (storage.intents), under the id its journal directory keeps across restarts.
    intents = (Intents(intents_engine(settings.database_url), replica_id(journal.directory),
                       journal=f"{os.uname().nodename}:{journal.directory}",
                       directory=journal.directory, owns_engine=True)
               if engine.dialect.name == "postgresql" else NoIntents())
    apis = readers()  # each API's conversation reader and stored request shape
    return ProxyState(
        settings=settings,
        admin_token=settings.admin_token or ensure_admin_token(settings.data_dir)[0],
        engine=engine,
        writer=Writer(engine, journal, observer=metrics, prepare=resolver,
                      search_index=settings.search_index, readers=apis),
        intents=intents,
        resolver=resolver,
        pool=pool,
        tagger=Tagger(
            key_owner=functools.partial(queries.key_owner, engine),
            is_registered=functools.partial(queries.is_registered, engine),
            is_finished=functools.partial(queries.is_finished, engine),
            require_episode=settings.require_episode,
            require_registered=settings.require_registered,
        ),
        metrics=metrics,
        exposure=Exposure(settings.allow_path, exposed_paths()),
        budgets=Budgets(settings.default_budget, engine),
        failures=Failures(metrics.internal_errors),
        repair=Repair(settings.repair_history, metrics.repaired),
        model_map=ModelMap(settings.model_map),
        request_fields=RequestFields(settings.allow_request_field),
        policy_models=PolicyModels(settings.policy_model, settings.other_models,
                                   functools.partial(queries.episode_registration, engine)),
        overlays=Overlays(overlays, fail=settings.overlay_fail,
                          timeout=settings.overlay_timeout,
                          max_resamples=settings.overlay_max_resamples, metrics=metrics,
                          registered=functools.partial(queries.episode_registration, engine),
                          patches=Patches(engine, _confinement(settings),
                                          reserved=frozenset(overlays))),
        routing=Routing(settings.translate),
        instance=instance,
        upstream_kind=upstream_kind,
        arrivals=Arrivals(),
        prompt_prefixes=prefixes,
        gate=gate,
        controls=Controls(engine, gate, instance, on_pause=metrics.set_paused),
        readers=apis,
    )


def _confinement(settings: Settings) -> Confinement:
    """The runtime patches' workers: limits, sandbox and cap (docs/overlays.md)."""
    limits = Limits(settings.overlay_patch_memory, settings.overlay_patch_cpu)
    return Confinement(limits, Launcher(settings.overlay_patch_sandbox),
                       settings.overlay_patch_max_workers)
