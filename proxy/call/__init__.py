"""One model call's life: the handlers, the driver (`ModelCall`, the one owner of a call's
state), its request (its upstream body: the payload as read and checked, encoded again),
relay, timings, record, review API for overlays, the
continuation of a call cut by a weight sync, and the routed experts it asks for.

Owns: `handlers`, `driver`, `request`, `relay`, `timings`, `record`, `review`,
`services`, `continuation`, `routed_experts`, `deadline`.
May import: `http`, `upstream`, `apis`, `tokens`, `episodes`, `policy`,
`overlays`, `runtime`.
"""
