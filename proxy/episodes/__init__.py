"""What a call says about its episode: which episode (tagging, keys), which conversation
inside it (lineage), its arrival order, its budget, the model names it sends, and the
history repair that gives the engine the model's own turns back.

Owns: `tagging`, `lineage`, `arrivals`, `budgets`, `ids`, `model_map`, `repair`, `recent`,
`policy_models`.
May import: `http`, `apis` (the repair reads the chat shape).
"""
