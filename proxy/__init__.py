"""tracetap's proxy: an OpenAI-compatible reverse proxy that captures every model call."""

__version__ = "0.1.0"
__all__ = ["__version__"]
