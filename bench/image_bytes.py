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

    python bench/image_bytes.py --sessions 16 --api chat --db sqlite

``--sessions N`` runs N such agents at once through one writer cache (storage.dedup.
BlockCache, its default 64 MiB), their turns interleaved (a batch holds one call of each
session) and generated as they are written, and prints also the writer's seconds, the
calls whose conversation the cache had forgotten (each read back from the database and
its resent messages scanned and hashed again: ``cache_misses``, out of ``calls`` less the
first turns) and the cache's largest size.
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
from collections.abc import Iterator
from pathlib import Path

from pgtemp import create_database, drop_database

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from storage_bytes import size, store  # noqa: E402

from tracetap.migrations import upgrade  # noqa: E402
from tracetap.proxy.apis.messages.request import to_chat  # noqa: E402
from tracetap.storage.dedup import BlockCache  # noqa: E402
from tracetap.storage.engine import create_engine  # noqa: E402
from tracetap.storage.records import CallRecord, ChoiceRecord  # noqa: E402
from tracetap.storage.rows import insert_calls  # noqa: E402

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
    count = [0, 0]
    batches = [[record] for record in session(api, args, 0, count)]
    return batches, count[0], count[1]


def session(api: str, args: argparse.Namespace, number: int,
            count: list[int]) -> Iterator[CallRecord]:
    """One agent's records, turn by turn; ``count`` gains its unique tokens and image
    bytes."""
    rnd = random.Random(number)
    messages: list[dict] = []
    ids: list[int] = []
    now = time.time()
    episode = f"screens-{api}" + (f"-{number}" if number else "")
    for turn in range(args.turns):
        shot = b"\x89PNG\r\n\x1a\n" + os.urandom(args.image_kb * 1000 - 8)
        count[1] += len(shot)
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
        yield CallRecord(
            call_id=f"{episode}-{turn:04d}", episode_id=episode, seq=turn,
            endpoint="chat.completions" if api == "chat" else "messages", model="vlm",
            request=_encode(body), upstream_request=upstream,
            response=_encode({"choices": [{"index": 0, "message": {
                "role": "assistant", "content": text}, "finish_reason": "length"}]}),
            http_status=200, t_start=now + turn, t_end=now + turn + 1,
            prompt_tokens=len(ids), completion_tokens=len(out), prompt_ids=list(ids),
            choices=[ChoiceRecord(index=0, finish_reason="length", text=text,
                                  completion_ids=out, completion_logprobs=logprobs,
                                  token_source="engine")])
        count[0] += len(new) + len(out)
        messages.append({"role": "assistant", "content": text})
        ids += out


class _Counting(BlockCache):
    """The writer's cache, counting the conversations it had forgotten and its size."""

    def __init__(self) -> None:
        super().__init__()
        self.misses = 0
        self.peak = 0

    def get(self, episode_id: str):
        last = super().get(episode_id)
        self.misses += last is None
        return last

    def commit(self, plan) -> None:
        super().commit(plan)
        self.peak = max(self.peak, self._size)


async def _store_sessions(url: str, api: str, args, count: list[int]) -> tuple[float, _Counting]:
    engine = create_engine(url)
    cache = _Counting()
    agents = [session(api, args, n + 1, count) for n in range(args.sessions)]
    spent = 0.0
    try:
        for _ in range(args.turns):
            batch = [next(agent) for agent in agents]
            started = time.perf_counter()
            await insert_calls(engine, batch, cache)
            spent += time.perf_counter() - started
    finally:
        await engine.dispose()
    return spent, cache


def measure_sessions(api: str, db: str, args, folder: Path) -> dict:
    url = f"sqlite:///{folder / f'{api}-s.db'}" if db == "sqlite" else create_database()
    count = [0, 0]
    try:
        upgrade(url)
        empty = size(url)[0]
        seconds, cache = asyncio.run(_store_sessions(url, api, args, count))
        full = size(url)[0]
    finally:
        if db == "postgres":
            drop_database(url)
    calls = args.sessions * args.turns
    return {"api": api, "db": db, "sessions": args.sessions, "turns": args.turns,
            "image_kb": args.image_kb, "calls": calls,
            "cache_misses": cache.misses - args.sessions,  # first turns have nothing to miss
            "cache_peak_mb": round(cache.peak / 2**20, 1),
            "writer_seconds": round(seconds, 2),
            "bytes_per_unique_token": round((full - empty) / count[0], 2),
            "bytes_per_image_byte": round((full - empty) / count[1], 3)}


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
    p.add_argument("--sessions", type=int, default=1,
                   help="agents at once through one writer cache (see above)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tracetap-image-bytes-") as tmp:
        for api in ("chat", "messages") if args.api == "both" else (args.api,):
            for db in ("sqlite", "postgres") if args.db == "both" else (args.db,):
                run = measure_sessions if args.sessions > 1 else measure
                print(json.dumps(run(api, db, args, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
