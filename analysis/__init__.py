"""Harness engineering on captured episodes: failure packets, Δ_B comparison of harness
variants, harness-factor coverage. Reads storage (and export's selection flags); nothing
in storage or exporters imports this package."""
