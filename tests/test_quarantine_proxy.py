"""Through the running proxy with the real openai SDK: an agent's hostile requests (token
ids no database column holds, NUL characters, a 300-character model name) do not stop
the capture of anyone else's calls; each is stored altered or kept in the dead-letter
file, and ``tracetap quarantine`` shows it."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import openai
import pytest

from tracetap.storage.quarantine import read_all
from tracetap.storage.storable import MARK

MESSAGES = [{"role": "user", "content": "hi"}]


def _client(proxy, episode: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.episode_url(episode), api_key="x", max_retries=0)


def test_hostile_requests_never_stop_capture_of_other_episodes(proxy):
    hostile = _client(proxy, "hostile")
    # A legacy completions prompt of ids outside int32: the engine rejects it, and the
    # ids are all the call has (SQLite and Postgres both refused this batch for ever).
    with pytest.raises(openai.BadRequestError):
        hostile.completions.create(model="mock", prompt=[1, 2**40, 3], max_tokens=4)
    # "\u0000" in JSON strings is a NUL in the model column (Postgres refuses it).
    # (The mock engine serves any model name; a real one answers 404: captured the same.)
    hostile.chat.completions.create(model="mock\u0000", messages=MESSAGES, max_tokens=4)
    hostile.chat.completions.create(model="m" * 300, messages=MESSAGES, max_tokens=4)
    hostile.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": "a\u0000b"}], max_tokens=4)
    # A raw NUL byte in the body (not JSON's escape): the request text holds a NUL.
    raw = urllib.request.Request(
        proxy.episode_url("hostile") + "/chat/completions", method="POST",
        data=b'{"model": "mock", "max_tokens": 4, "messages": [{"role": "user", '
             b'"content": "raw\x00nul"}]}', headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(raw, timeout=30).close()
    except urllib.error.HTTPError as err:  # refused as invalid JSON, and stored as such
        err.close()
    normal = _client(proxy, "normal")
    for _ in range(10):
        reply = normal.chat.completions.create(model="mock", messages=MESSAGES, max_tokens=4,
                                               logprobs=True)
        assert reply.choices[0].message.content

    calls = proxy.calls("normal")
    assert len(calls) == 10 and all(c["prompt_ids"] for c in calls)
    stored = proxy.calls("hostile")
    assert len(stored) == 5  # the hostile calls too: altered where they had to be
    by_model = {c["model"]: c for c in stored}
    ids_call = next(c for c in stored if c["endpoint"] == "completions")
    assert ids_call["prompt_ids"] is None and MARK in ids_call["error"]
    assert ids_call["http_status"] == 400
    postgres = proxy.state.engine.dialect.name == "postgresql"
    entries = {e.call_id: e for e in read_all(proxy.settings.data_dir)}
    for call in stored:
        altered = call["error"] is not None and MARK in call["error"]
        assert (call["call_id"] in entries) == altered
        if altered:  # the dead-letter file keeps the record as captured
            assert entries[call["call_id"]].kind == "altered"
    if postgres:
        assert "mock\ufffd" in by_model and "m" * 256 in by_model
        assert len(entries) == 4
        nul = next(c for c in stored if "raw" in (c["request"] or ""))
        assert "raw\\u0000nul" in nul["request"] and MARK in nul["error"]
        content = next(c for c in stored if c["model"] == "mock" and c is not ids_call)["request"]
        assert "a\\u0000b" in content  # the request's JSON escape, as the SDK sent it
    else:
        assert "mock\x00" in by_model and "m" * 300 in by_model
        assert len(entries) == 1
    metrics = proxy.state.metrics
    assert metrics.records_total.labels("altered")._value.get() == len(entries)
    assert metrics.records_total.labels("quarantined")._value.get() == 0

    # The CLI lists them with their reason, and shows one whole.
    listed = _cli("quarantine", "list", "--data-dir", proxy.settings.data_dir)
    assert listed.count("altered") >= len(entries) and "hostile" in listed
    assert "outside int32" in listed
    shown = json.loads(_cli("quarantine", "show", ids_call["call_id"], "--data-dir",
                            proxy.settings.data_dir))
    assert shown["kind"] == "altered" and shown["record"]["prompt_ids"] == [1, 2**40, 3]


def _cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tracetap", *args], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout
