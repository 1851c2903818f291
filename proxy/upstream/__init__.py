"""The model servers: one pooled client, several upstreams with affinity and failover,
the calls in flight to each, which kind of engine each is, and the look at each before
serving.

Owns: `client`, `pool`, `traffic`, `flavor`, `specs`, `startup_check`.
May import: `http`.
"""
