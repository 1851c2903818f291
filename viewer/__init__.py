"""The trace viewer: pages over a tracetap database, in the browser; read-only but for the
annotations people make (viewer.annotate).

Served by the proxy at ``/tracetap/ui/`` (an admin route: the admin token opens it) and
by ``tracetap ui --db URL`` on its own port. Pages are rendered on the server (Jinja2,
everything escaped); the browser gets one small stylesheet and one small script, no
library and no CDN. Reads go through storage (storage.browse for lists, storage.details for
one episode or call, storage.changes for the live page, storage.scan for
token arrays) and the token view is the exporter's own trajectory builder.
"""

PREFIX = "/tracetap/ui"
