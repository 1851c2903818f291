"""``tracetap run``: a batch of tasks through a black-box harness, each task x config x
repeat registered as an episode on a running proxy (its admin API, over HTTP), run with
its own base URL, graded and finished; a rerun resumes (docs/harness-engineering.md).

``plan`` expands the inputs into slots with deterministic episode ids, ``template``
fills command templates, ``admin`` is the admin API's client, ``process`` runs one
command in its own process group, ``grade`` reads a reward, ``episode`` drives one slot,
``batch`` runs them all, ``progress`` and ``summary`` report.
"""
