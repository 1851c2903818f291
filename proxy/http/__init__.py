"""The HTTP edge every wing shares: the proxy's own error type, which headers cross,
request bodies read under one limit, the SSE parser, the paths an agent may reach, and
the 500s the proxy itself answers.

Owns: `errors`, `headers`, `bodies`, `sse`, `exposure`, `failures`.
May import: nothing else of the proxy (storage only where a module says why).
"""
