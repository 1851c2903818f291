"""The token view's pieces as one block of HTML, built in Python.

A 2,048-token window is 2,048 spans: through the template's loop they were most of a
later window's time; joined here they cost a tenth of that. Every text is escaped
(markupsafe), as the templates would; the markup is the same as the template wrote.
"""

from __future__ import annotations

from typing import Any

import msgspec
from markupsafe import Markup, escape

from tracetap.viewer import PREFIX

_JSON_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "'": "\\u0027"})


def pieces_html(pieces: list) -> Markup:
    out: list[str] = []
    for p in pieces:
        label = getattr(p, "label", None)
        if label is None:  # a Token (kind, text, newline)
            nl = " nl" if p.newline else ""
            out.append(f'<span class="t {p.kind}{nl}">{escape(p.text)}</span>')
        elif p.kind == "turn":
            out.append(f'<a class="mk mk-turn" href="{PREFIX}/calls/{escape(p.span.call_id)}">'
                       f"{escape(label)}</a>")
        elif p.kind == "split":
            out.append(f'<span class="mk mk-split" id="split">{escape(label)}</span>')
        else:
            out.append(f'<span class="mk mk-resp">{escape(label)}</span>')
    return Markup("".join(out))


def script_json(data: Any) -> Markup:
    """JSON for a <script type="application/json"> block, safe as Jinja's tojson is
    (no ``<``, ``>``, ``&`` or ``'`` left raw), at msgspec's speed."""
    return Markup(msgspec.json.encode(data).decode().translate(_JSON_ESCAPES))
