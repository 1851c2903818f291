"""The operator's side under /tracetap/: episodes, rewards, policy version, health,
runtime overlay patches, annotations, the admin token, the trace viewer's mount, and their
commands (`tracetap admin-token`, `tracetap ui`).

Owns: `api`, `annotations`, `overlays`, `token`, `token_command`, `finish_integrity`, `ui`,
`ui_command`.
May import: `http`, `upstream`, `apis`, `tokens`, `episodes`, `policy`,
`overlays`, `runtime`, `call`.
"""
