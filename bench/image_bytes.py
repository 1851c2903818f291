"""Database bytes of a screenshot-heavy agent run, through the real storage code.

    python bench/image_bytes.py                       # chat and Messages, SQLite and Postgres
    python bench/image_bytes.py --api messages --db sqlite --turns 20
    python bench/storage_bytes.py --screenshots       # the same, from the storage bench

A computer-use agent's replay: ``--turns`` turns, each adding a user message with a
little text and one ``--image-kb`` KB screenshot (random bytes behind a PNG header: as
incompressible as a real screenshot's deflated pixels), a completion of ``--out`` tokens
with logprobs; every request resends the whole conversation, every screenshot included.
``--api chat`` stores each call's chat request (image_url data URLs); ``--api messages``
stores the Messages request (image blocks with a base64 source) and the chat body the
proxy translates it to (proxy.apis.messages.request.to_chat), as the proxy does. The
engine's prompt ids render each image as ``--image-tokens`` pad tokens (a 1280x800
screenshot is about 1,300 for Qwen2.5-VL) between start and end tokens.

Printed per API and database: bytes the run added (as bench/storage_bytes.py measures
them), bytes per unique token (unique: every turn's new prompt tokens, image pads
included, and its completion) and per image byte (the distinct screenshots' bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from pgtemp import create_database, drop_database

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from storage_bytes import size, store  # noqa: E402

from tracetap.migrations import upgrade  # noqa: E402
from tracetap.proxy.apis.messages.request import to_chat  # noqa: E402
from tracetap.storage.records import CallRecord, ChoiceRecord  # noqa: E402

VOCAB, PAD, START, END = 151_000, 151_655, 151_652, 151_653  # Qwen2.5-VL's image tokens


def _encode(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def _user(api: str, turn: int, shot: bytes) -> dict:
    data = base64.b64encode(shot).decode()
    image = ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}}
             if api == "chat" else
             {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": data}})
    return {"role": "user", "content": [{"type": "text", "text": f"step {turn}: the screen"},
                                        image]}


def records(api: str, args: argparse.Namespace) -> tuple[list[list[CallRecord]], int, int]:
    """One record per turn (each its own batch), the unique tokens, the image bytes."""
    rnd = random.Random(0)
    messages: list[dict] = []
    ids: list[int] = []
    batches, unique, image_bytes, now = [], 0, 0, time.time()
    for turn in range(args.turns):
        shot = b"\x89PNG\r\n\x1a\n" + os.urandom(args.image_kb * 1000 - 8)
        image_bytes += len(shot)
        messages.append(_user(api, turn, shot))
        new = [rnd.randrange(1000, VOCAB) for _ in range(12)]
        new += [START, *[PAD] * args.image_tokens, END]
        ids += new
        out = [rnd.randrange(1000, VOCAB) for _ in range(args.out)]
        logprobs = [-round(rnd.random() * 4, 6) for _ in out]
        text = "".join(f" w{t}" for t in out)
        body = {"model": "vlm", "max_tokens": args.out, "messages": messages}
        upstream = None
        if api == "messages":
            upstream = _encode({**to_chat(body), "logprobs": True, "return_token_ids": True})
        batches.append([CallRecord(
            call_id=f"{api}-{turn:04d}", episode_id=f"screens-{api}", seq=turn,
            endpoint="chat.completions" if api == "chat" else "messages", model="vlm",
            request=_encode(body), upstream_request=upstream,
            response=_encode({"choices": [{"index": 0, "message": {
                "role": "assistant", "content": text}, "finish_reason": "length"}]}),
            http_status=200, t_start=now + turn, t_end=now + turn + 1,
            prompt_tokens=len(ids), completion_tokens=len(out), prompt_ids=list(ids),
            choices=[ChoiceRecord(index=0, finish_reason="length", text=text,
                                  completion_ids=out, completion_logprobs=logprobs,
                                  token_source="engine")])])
        unique += len(new) + len(out)
        messages.append({"role": "assistant", "content": text})
        ids += out
    return batches, unique, image_bytes


def measure(api: str, db: str, args, folder: Path) -> dict:
    batches, unique, image_bytes = records(api, args)
    url = f"sqlite:///{folder / f'{api}.db'}" if db == "sqlite" else create_database()
    try:
        upgrade(url)
        empty = size(url)[0]
        asyncio.run(store(url, batches, "blocks"))
        full = size(url)[0]
    finally:
        if db == "postgres":
            drop_database(url)
    added = full - empty
    return {"api": api, "db": db, "turns": args.turns, "image_kb": args.image_kb,
            "calls": len(batches), "unique_tokens": unique, "bytes": added,
            "bytes_per_unique_token": round(added / unique, 2),
            "bytes_per_image_byte": round(added / image_bytes, 3)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=30)
    p.add_argument("--image-kb", type=int, default=200)
    p.add_argument("--image-tokens", type=int, default=1300)
    p.add_argument("--out", type=int, default=60)
    p.add_argument("--api", choices=("chat", "messages", "both"), default="both")
    p.add_argument("--db", choices=("sqlite", "postgres", "both"), default="both")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tracetap-image-bytes-") as tmp:
        for api in ("chat", "messages") if args.api == "both" else (args.api,):
            for db in ("sqlite", "postgres") if args.db == "both" else (args.db,):
                print(json.dumps(measure(api, db, args, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
