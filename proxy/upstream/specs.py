"""``--upstream`` values: the model servers to send to, each optionally for one model."""

from __future__ import annotations

from urllib.parse import urlsplit

import msgspec

from tracetap.storage.config import redact_credentials


class UpstreamSpec(msgspec.Struct, frozen=True):
    url: str  # as given: may hold credentials (user:password@), so never shown
    model: str | None = None  # only this model's calls go here

    @property
    def shown(self) -> str:
        """The URL to show, log or store: credentials masked."""
        return redact_credentials(self.url)

    @property
    def has_credentials(self) -> bool:
        return "@" in urlsplit(self.url).netloc


def parse_upstreams(values: list[str]) -> list[UpstreamSpec]:
    """``URL`` or ``model=NAME,url=URL`` entries; a flag value may hold several URLs."""
    specs = []
    for value in values:
        tokens = [t.strip() for t in value.split(",") if t.strip()]
        i = 0
        while i < len(tokens):
            token = tokens[i]
            if token.startswith(("model=", "url=")):
                fields = dict(t.split("=", 1) for t in tokens[i:i + 2])
                if set(fields) != {"model", "url"}:
                    raise ValueError(f"--upstream {value!r}: use model=NAME,url=URL")
                specs.append(UpstreamSpec(url=fields["url"], model=fields["model"]))
                i += 2
            else:
                specs.append(UpstreamSpec(url=token))
                i += 1
    for spec in specs:
        if not spec.url.startswith(("http://", "https://")):
            raise ValueError(f"--upstream must be an http(s) URL, got {spec.shown!r}")
    if not specs:
        raise ValueError("--upstream (or TRACETAP_UPSTREAM) is required")
    return specs
