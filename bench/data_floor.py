"""The least a database can hold of the agentic replay's data: its information, not a
layout.

    python bench/data_floor.py                 # the replay's shape, ~1 min
    python bench/data_floor.py --sessions 2 --turns 3

What every turn must keep, whatever the storage: the text it adds (the tool result and
the completion, as the client sent and got them), the ids of those tokens, and the
completion's logprobs (float32, as engines compute them). Each part of the whole run,
and all of them together, is compressed with ``xz -9e`` (LZMA, preset 9 extreme: far more
than any database spends on a row) and divided by the run's unique tokens
(bench/storage_bytes.py's records, the same seeds). The replay's tokens are random below
151,000: their ids carry ~17 bits each, and their text (`` w<id>``) the same digits again,
which no compressor can derive from the ids without the tokenizer. No row, page or search
index is counted: those come on top (``storage_bytes.py --index-floor`` for the index),
nor the shared system prompt (a floor left lower stays a floor).
"""

from __future__ import annotations

import argparse
import json
import lzma
import struct

from storage_bytes import add_shape_arguments, records

_XZ = 9 | lzma.PRESET_EXTREME


def data_floor(args: argparse.Namespace) -> dict:
    text, ids, logprobs = bytearray(), bytearray(), bytearray()
    for batch in records(args):
        for record in batch:
            messages = json.loads(record.request)["messages"]
            text += messages[-1]["content"].encode()  # the tool result this turn added
            (choice,) = record.choices
            text += choice.text.encode()
            new = record.prompt_ids[-args.tool:] + choice.completion_ids
            ids += struct.pack(f"<{len(new)}I", *new)
            logprobs += struct.pack(f"<{len(choice.completion_logprobs)}f",
                                    *choice.completion_logprobs)
    unique = args.system + args.sessions * args.turns * (args.tool + args.out)
    parts = {"text": text, "ids": ids, "logprobs": logprobs}
    out = {name: round(len(lzma.compress(bytes(blob), preset=_XZ)) / unique, 2)
           for name, blob in parts.items()}
    out["all"] = round(len(lzma.compress(bytes(text + ids + logprobs), preset=_XZ)) / unique, 2)
    return {"unique_tokens": unique, "xz_bytes_per_unique_token": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser)
    print(json.dumps(data_floor(parser.parse_args())))


if __name__ == "__main__":
    main()
