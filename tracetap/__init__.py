"""tracetap: an OpenAI-compatible capture proxy that stores agent episodes token-exactly
for RL and exports them as Parquet.

The repository's top-level folders (proxy/, storage/, exporters/, migrations/, viewer/,
demo/, analysis/) are installed under this one import name: `tracetap.proxy`,
`tracetap.storage`, ... (pyproject.toml maps them), so a user's own `storage/` folder
shadows nothing.
"""

__version__ = "0.6.0"
__all__ = ["__version__"]
