"""What the tests share, in one place (tests/conftest.py only loads the fixtures).

- ``loop``: an event loop in a thread, free ports.
- ``http``: one way to talk HTTP to a proxy or an upstream (JSON requests, the admin
  API, registering and finishing episodes, ``/metrics``).
- ``databases``: the test Postgres and the ``db_url`` fixtures (a pytest plugin).
- ``servers``: the proxy in-process and as a subprocess, the TCP forwarder, stored calls,
  and their fixtures (a pytest plugin).
- ``chat_upstreams``: scripted chat-completions upstreams and a translating server.
- ``seeding``: a synthetic database for the analysis commands and its ``seeded`` fixture
  (a pytest plugin).
- ``translation``, ``harnesses``, ``objectstore``, ``k8s_render``: what a few test files
  share about one subject each.
"""
