"""``tracetap engineer``: an engineer model patches the harness, and Δ_B rewards it
(Harness-R1; docs/harness-engineering.md). ``prompt`` turns failure packets into the
engineer's request and its reply into a patch, ``ask`` calls the engineer through a
tracetap proxy as an episode of its own, ``loop`` drives baseline → packets →
candidates → validation (the proxy loads each patch and replays its hooks on the
packet's recorded calls in its sandbox, ``proxy/overlays/replay.py``) → batch → Δ_B →
reward, and ``table`` prints the candidates.
"""
