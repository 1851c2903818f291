"""proxy/exposure.py on its own: a path is decoded to a fixed point or refused, and what
the upstream is sent decodes to exactly the path that was checked."""

from __future__ import annotations

from urllib.parse import unquote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from yarl import URL

from tracetap.proxy.errors import ProxyError
from tracetap.proxy.exposure import Exposure, checked_path, is_control, upstream_path

# Pieces an attacker combines: escapes of escapes, dots, slashes, separators, lookalikes.
PIECES = ["/", ".", "..", "%", "%25", "%2e", "%2E", "%2f", "%5c", "%252e", "%3b", ";",
          "\\", "%00", "a", "v1", "models", "sleep", "%ef%bc%8e", "\uff0e", "+", "%2B",
          "@", ":", "~", "%41", "%zz", " ", "?"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12))
def test_an_accepted_path_is_what_the_upstream_decodes(pieces):
    raw = "/" + "".join(pieces)
    try:
        path = checked_path(raw)
    except ProxyError as error:
        assert error.status == 400 and error.code == "invalid_path"
        return
    assert unquote(path) == path  # a fixed point: nothing further along decodes it again
    segments = path.split("/")[1:]
    assert "." not in segments and ".." not in segments
    assert "//" not in path and "\\" not in path and ";" not in path and path.isascii()
    sent = upstream_path(path, "")
    url = URL("http://engine:8000" + sent, encoded=True)
    assert url.raw_path == sent  # not requoted or dot-resolved on the way out
    assert unquote(url.raw_path) == path  # the upstream decodes it once: the checked path


@pytest.mark.parametrize("raw", [
    "/v1/models/%252e%252e/x", "/v1/%2e%2e/x", "/v1/models/%25252f", "/v1/a;b", "/v1/%3b",
    "/v1/%ef%bc%8e%ef%bc%8e/x", "/v1//x", "/v1/./x", "/v1/x%5cy", "/v1/%ff",
])
def test_refused(raw):
    with pytest.raises(ProxyError):
        checked_path(raw)


def test_controls_need_an_exact_rule():
    exposure = Exposure(["/*", "/v1/*", "POST /sleep"])
    assert exposure.allows("POST", "/sleep")
    assert exposure.allows("POST", "/generate")
    for path in ("/wake_up", "/v1/load_lora_adapter", "/update_weights_from_ipc",
                 "/init_weights_send_group_for_remote_instance", "/v1/x/flush_cache",
                 "/start_expert_distribution_record", "/FLUSH_CACHE"):
        assert is_control(path), path
        assert not exposure.allows("POST", path), path
    assert not is_control("/v1/chat/completions")
    assert not is_control("/v1/models/Qwen/Qwen3-8B")
