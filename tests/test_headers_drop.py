"""Which headers cross the proxy: the fixed drop set, and what a Connection header names
(built per request only when there is one)."""

from multidict import CIMultiDict, CIMultiDictProxy

from tracetap.proxy.http.headers import response_headers, upstream_request_headers


def _incoming(*pairs: tuple[str, str]) -> CIMultiDictProxy:
    return CIMultiDictProxy(CIMultiDict([("Host", "p"), ("Content-Type", "application/json"),
                                         ("X-Forwarded-For", "1.2.3.4"),
                                         ("X-Tracetap-Episode", "e1"), ("X-Custom", "kept"),
                                         *pairs]))


def test_request_headers_drop_the_fixed_set_and_keep_the_rest():
    sent = upstream_request_headers(_incoming(), api_key="k", forward_client_auth=False,
                                    identity=True)
    assert sent == {"Content-Type": "application/json", "X-Custom": "kept",
                    "Accept-Encoding": "identity", "Authorization": "Bearer k"}


def test_request_headers_drop_what_connection_names():
    sent = upstream_request_headers(_incoming(("Connection", "X-Custom, keep-alive")),
                                    api_key=None, forward_client_auth=False, identity=False)
    assert "X-Custom" not in sent and "Connection" not in sent
    assert sent == {"Content-Type": "application/json"}
    # The next request without a Connection header keeps it: nothing leaked into the
    # fixed set.
    again = upstream_request_headers(_incoming(), api_key=None, forward_client_auth=False,
                                     identity=False)
    assert again["X-Custom"] == "kept"


def test_response_headers_drop_hop_by_hop_and_what_connection_names():
    upstream = [("Content-Type", "application/json"), ("Content-Length", "10"),
                ("Connection", "X-Hop"), ("X-Hop", "1"), ("X-Engine", "vllm")]
    assert response_headers(upstream) == [("Content-Type", "application/json"),
                                          ("X-Engine", "vllm")]
    assert response_headers([("X-Hop", "1")]) == [("X-Hop", "1")]
