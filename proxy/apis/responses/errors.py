"""The error body Responses clients read: OpenAI's (``apis/chat/errors.py``), since
Responses is an OpenAI API too."""

from __future__ import annotations

from tracetap.proxy.apis.chat.errors import OPENAI_ERRORS

ERRORS = OPENAI_ERRORS
