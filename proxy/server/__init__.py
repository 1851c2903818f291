"""Running a proxy: the aiohttp application and its lifecycle, the one function that
composes its state, the listening sockets and their limits, workers on one port (told
by the kernel when their supervisor dies), the heap kept between turns, and the `serve`
and `db` commands.

Owns: `app`, `compose`, `serve`, `workers`, `parent_death`, `connections`, `heap`,
`serve_command`, `serve_flags`, `db_command`.
May import: `http`, `upstream`, `apis`, `tokens`, `episodes`, `policy`,
`overlays`, `runtime`, `call`, `admin`.
"""
