"""proxy/http/exposure.py on its own: a path is decoded to a fixed point or refused, and what
the upstream is sent decodes to exactly the path that was checked."""

from __future__ import annotations

from urllib.parse import unquote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from yarl import URL

from tracetap.proxy.apis.registry import APIS, exposed_paths
from tracetap.proxy.http.errors import ProxyError
from tracetap.proxy.http.exposure import (
    DEFAULT_RULES,
    Exposure,
    Rule,
    checked_path,
    is_control,
    parse_rule,
    refused,
    upstream_path,
)

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


# ---- --allow-path rules, parsed in-process (the CLI test runs `serve` as a subprocess) ----

@pytest.mark.parametrize(("text", "rule"), [
    ("/v1/embeddings", Rule("*", "/v1/embeddings")),
    ("post /v1/embeddings", Rule("POST", "/v1/embeddings")),
    ("GET /v1/files/*", Rule("GET", "/v1/files/*")),
    ("/*", Rule("*", "/*")),
    ("* /generate", Rule("*", "/generate")),
])
def test_an_allow_path_rule_is_a_method_and_a_plain_path(text, rule):
    assert parse_rule(text) == rule


@pytest.mark.parametrize(("text", "why"), [
    ("relative/path", "plain absolute path"),
    ("/v1/../sleep", "plain absolute path"),
    ("/v1/./x", "plain absolute path"),
    ("/tracetap/episodes", "plain absolute path"),
    ("/tracetapx", "plain absolute path"),
    ("/v1/a;b", "plain absolute path"),
    ("/v1/%41", "plain absolute path"),
    ("/v1/a%2*", "plain absolute path"),
    ("/v1/x%", "plain absolute path"),
    ("/v1/%41/*", "plain absolute path"),
    ("FETCH /x", "unknown method 'FETCH'"),
    ("POST /x extra", "use '/path', '/prefix/*' or 'METHOD /path'"),
    ("", "use '/path', '/prefix/*' or 'METHOD /path'"),
])
def test_a_bad_allow_path_rule_is_refused_with_why(text, why):
    with pytest.raises(ValueError, match="--allow-path") as refused:
        parse_rule(text)
    assert why in str(refused.value)


def test_a_rule_matches_its_method_and_exactly_its_path_or_below_its_prefix():
    exact, prefix, anything = Rule("POST", "/v1/x"), Rule("GET", "/v1/files/*"), Rule("*", "/v1/x")
    assert exact.matches("POST", "/v1/x")
    assert not exact.matches("GET", "/v1/x") and not exact.matches("POST", "/v1/x/y")
    assert not exact.matches("POST", "/v1/xy")
    assert anything.matches("DELETE", "/v1/x") and anything.matches("GET", "/v1/x")
    assert prefix.prefix and not exact.prefix
    assert prefix.matches("GET", "/v1/files/a") and prefix.matches("GET", "/v1/files/a/b")
    assert not prefix.matches("GET", "/v1/files/")  # the prefix itself names nothing below
    assert not prefix.matches("GET", "/v1/files") and not prefix.matches("GET", "/v1/filesx")
    assert not prefix.matches("GET", "/v1/filesxyz")
    assert not prefix.matches("POST", "/v1/files/a")
    assert str(prefix) == "GET /v1/files/*"


def test_the_exposure_in_force_is_the_model_apis_then_the_defaults_then_the_operators():
    exposure = Exposure(["POST /v1/embeddings", "/v1/files/*"], ("/v1/chat/completions",))
    assert exposure.rules == (Rule("POST", "/v1/chat/completions"), *DEFAULT_RULES,
                              Rule("POST", "/v1/embeddings"), Rule("*", "/v1/files/*"))
    assert exposure.describe() == ", ".join(
        ["POST /v1/chat/completions"] + [f"{r.method} {r.path}" for r in DEFAULT_RULES]
        + ["POST /v1/embeddings", "* /v1/files/*"])
    assert exposure.allows("POST", "/v1/embeddings") and exposure.allows("PUT", "/v1/files/f")
    assert not exposure.allows("GET", "/v1/embeddings")
    assert not Exposure().allows("POST", "/v1/embeddings")
    assert Exposure().allows("GET", "/v1/models/Qwen/Qwen3-8B")


def test_the_upstream_is_sent_the_path_encoded_once_and_the_query_as_it_came():
    assert upstream_path("/v1/models/a b", "") == "/v1/models/a%20b"
    assert upstream_path("/v1/models/x", "a=1&b=%2F;c?d") == "/v1/models/x?a=1&b=%2F;c?d"
    assert upstream_path("/v1/models/x", "q=a b#") == "/v1/models/x?q=a%20b%23"
    assert upstream_path("/v1/models/é", "") == "/v1/models/%C3%A9"
    plain = "/v1/models/a-b.c_d~e!f$g&h'i(j)k*l+m,n=o:p@q"
    assert upstream_path(plain, "") == plain  # what the check let through, sent as it is


def test_the_query_is_not_checked_as_the_path_and_refusals_say_why():
    assert checked_path("/v1/models?next=../%2e%2e//x") == "/v1/models"
    assert checked_path("/v1/models?a=1?b=2") == "/v1/models"  # the first "?" ends it
    assert checked_path("/v1/models/%41b") == "/v1/models/Ab"
    why = {
        "/v1/%ff": "percent-encoded bytes that are not UTF-8",
        "/v1/%25ff": "percent-encoded bytes that are not UTF-8",  # once decoded, still not
        "/v1/%2541": "percent-encoding inside percent-encoding",
        "/v1/../x": "dot segments, empty segments, encoded dots or slashes, and characters "
                    "outside plain ASCII are not accepted",
        "/v1/models/a%2eb": "dot segments, empty segments, encoded dots or slashes, and "
                            "characters outside plain ASCII are not accepted",
    }
    for raw, message in why.items():
        with pytest.raises(ProxyError) as refusal:
            checked_path(raw)
        error = refusal.value
        assert (error.status, error.type, error.code) == (400, "invalid_request_error",
                                                          "invalid_path"), raw
        assert error.message == "invalid request path: " + message, raw
    error = refused("DELETE", "/v1/models/m")
    assert (error.status, error.code, error.type) == (404, "not_exposed", "invalid_request_error")
    assert error.message == ("DELETE /v1/models/m is not exposed by this proxy: agents reach "
                             "only the model API (the operator can allow more with "
                             "--allow-path)")


def test_the_model_apis_paths_come_from_the_registry():
    """Every captured path of every registered API is reachable, POST only; nothing else
    of them is (a new API's paths are its ClientApi's, not a table here)."""
    exposure = Exposure((), exposed_paths())
    for api in APIS:
        assert exposure.allows("POST", api.path) and not exposure.allows("GET", api.path)
    assert exposure.allows("POST", "/v1/messages/count_tokens")
    assert not Exposure().allows("POST", "/v1/chat/completions")
