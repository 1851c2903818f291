"""tracetap's proxy: an OpenAI-compatible reverse proxy that captures every model call.

Its wings follow a request, each importing only the wings before it in this list (each
wing's own docstring says what it owns; tests/test_imports.py enforces the order):
`http` (the edge every wing shares), `upstream` (the model servers), `apis` (one package
per wire API), `tokens` (ids the engine did not return), `episodes` (which episode and
conversation a call belongs to), `policy` (pause, policy version), `overlays` (operator
hooks), `runtime` (settings, state, metrics), `call` (one model call's life), `admin`
(the operator's API), `server` (the running process and its commands).
"""
