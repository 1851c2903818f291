"""tracetap's proxy: an OpenAI-compatible reverse proxy that captures every model call."""
