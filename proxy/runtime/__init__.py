"""What one running proxy holds: its settings, `ProxyState` (the parts that serve a call),
the application keys the app stores them under, and its metrics registry.

Owns: `settings`, `state`, `keys`, `metrics`.
May import: `http`, `upstream`, `apis`, `tokens`, `episodes`, `policy`, `overlays`.
"""
