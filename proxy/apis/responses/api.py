"""The OpenAI Responses API as the registry (``apis/registry.py``) lists it: native on
vLLM (logprobs, and ids with ``enable_response_messages``), translated to chat elsewhere
(and on vLLM too when native capture would lose logprobs: ``apis/routing.for_request``)."""

from __future__ import annotations

from tracetap.proxy.apis import ClientApi
from tracetap.proxy.apis.responses import translate
from tracetap.proxy.apis.responses.capture import ResponsesApi
from tracetap.proxy.apis.responses.conversation import (
    RESPONSES_SHAPE,
    read_responses,
    responses_caps,
)
from tracetap.proxy.apis.responses.errors import ERRORS

RESPONSES = ClientApi(
    name="responses", path=ResponsesApi.path, exposed=(ResponsesApi.path,), errors=ERRORS,
    native=ResponsesApi, native_flavors=("vllm",), translation=translate, reader=read_responses,
    shape=RESPONSES_SHAPE, caps=responses_caps)
