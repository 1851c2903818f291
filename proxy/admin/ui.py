"""The trace viewer inside the proxy: an admin route at /tracetap/ui, gated like the admin API.

The viewer reads the same database with its own connection pool (viewer.source), asks the
first upstream for token text (/detokenize), and opens with the proxy's admin token; when
the admin API has a listener of its own, the viewer is served only there.
"""

from __future__ import annotations

from aiohttp import web

from tracetap.proxy.admin.api import serves_admin
from tracetap.proxy.apis.registry import readers
from tracetap.proxy.runtime.keys import STATE
from tracetap.proxy.runtime.settings import Settings
from tracetap.viewer import PREFIX
from tracetap.viewer.access import Access
from tracetap.viewer.app import ViewerConfig, build_viewer


def mount_viewer(app: web.Application, settings: Settings) -> None:
    config = ViewerConfig(database_url=settings.database_url, agent_url=settings.base_url,
                          detokenize_url=settings.upstreams[0].url,
                          engine_api_key=settings.upstream_api_key,
                          data_dir=str(settings.data_dir),
                          search_index=settings.search_index)
    gate = Access(token=lambda request: request.config_dict[STATE].admin_token,
                  served_here=lambda request: serves_admin(request, settings))
    app.add_subapp(PREFIX, build_viewer(config, gate, readers()))
