"""The model servers: one pooled client (and its lean path for tokenizer questions), a
stream's stall watch, several upstreams with affinity and failover, the calls in flight
to each, which kind of engine each is, and the look at each before serving.

Owns: `client`, `lean_http`, `stall`, `pool`, `traffic`, `flavor`, `specs`, `startup_check`.
May import: `http`.
"""
