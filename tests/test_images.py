"""Images (storage.images, storage.image_parts, exporters.images): each distinct image
stored once whatever body and shape holds it, every body read back byte for byte, and the
export gives a VLM trainer every image's bytes and its placeholder span in the prompt."""

from __future__ import annotations

import asyncio
import base64
import json
import os

import pytest
from sqlalchemy import text

from tracetap.demo import tokenizer as tok
from tracetap.storage import queries
from tracetap.storage.blocks import unpack_refs
from tracetap.storage.dedup import BlockCache
from tracetap.storage.engine import create_engine
from tracetap.storage.image_parts import image_parts
from tracetap.storage.records import CallRecord
from tracetap.storage.rows import insert_calls


def screenshot(seed: int, size: int = 20_000) -> bytes:
    """PNG magic and noise: as incompressible as a real screenshot's deflated pixels."""
    return b"\x89PNG\r\n\x1a\n" + os.urandom(size - 8) + bytes([seed % 256])


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _run(url: str, step):
    async def main():
        engine = create_engine(url)
        try:
            return await step(engine)
        finally:
            await engine.dispose()

    return asyncio.run(main())


async def _image_blocks(engine) -> list[int]:
    """Sizes of the stored image blocks (format byte 5: the payload's bytes)."""
    async with engine.connect() as conn:
        rows = (await conn.execute(text("SELECT data FROM blocks"))).all()
    return [len(bytes(d)) - 1 for (d,) in rows if bytes(d)[0] == 5]


def test_one_image_in_every_shape_is_stored_once_and_every_body_reads_back_exactly(db_url):
    shot, other = screenshot(1), screenshot(2)
    url = "data:image/png;base64," + b64(shot)
    chat = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]}]}
    messages = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": b64(shot)}}]}]}
    responses = {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": url}]}]}
    wrapped = b64(other)
    svg = b"<svg xmlns='http://www.w3.org/2000/svg'><script>alert(1)</script>" + b" " * 2000
    bodies = [
        (json.dumps(chat), None),
        (json.dumps(messages), json.dumps(chat, indent=2)),  # and the translated body
        (json.dumps(responses), json.dumps(chat)),
        # The same bytes in shapes that are not canonical base64 stay text, as sent.
        (json.dumps(chat).replace("/", "\\/"), None),
        (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url",
          "image_url": {"url": "data:image/png;base64," + "\n".join(
              wrapped[i:i + 76] for i in range(0, len(wrapped), 76))}}]}]}), None),
        # Malformed, SVG, not data: — kept as text, byte for byte.
        ('{"messages":[{"role":"user","content":[{"type":"image_url","image_url":'
         '{"url":"data:image/png;base64,' + "A" * 2001 + '"}}]}]}', None),
        (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url",
          "image_url": {"url": "data:image/svg+xml;base64," + b64(svg)}}]}]}), None),
        (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url",
          "image_url": {"url": "https://example.com/x.png"}}]}]}), None),
        ('{"messages":[{"role":"user","content":"\\ud800 data:image/png;base64,'
         + b64(shot) + '"}]}', None),
    ]
    records = [CallRecord(call_id=f"c{i}", episode_id=f"e{i % 3}", seq=i, endpoint="x",
                          model="m", t_start=1000.0 + i, t_end=1001.0 + i, http_status=200,
                          request=request, upstream_request=upstream, response="{}")
               for i, (request, upstream) in enumerate(bodies)]

    async def step(engine):
        await insert_calls(engine, records[:4], BlockCache())
        await insert_calls(engine, records[4:], BlockCache())
        stored = [c for e in ("e0", "e1", "e2") for c in await queries.calls_of(engine, e)]
        return stored, await _image_blocks(engine)

    stored, blocks = _run(db_url, step)
    by_id = {c["call_id"]: c for c in stored}
    for record in records:
        assert by_id[record.call_id]["request"] == record.request
        assert by_id[record.call_id]["upstream_request"] == record.upstream_request
    # Six bodies hold `shot` canonically (chat, Messages + its translation, Responses +
    # its translation, and inside a text): one block, the image's own bytes; the SVG's
    # base64 is a block too (bytes are bytes; the viewer never serves it as an image).
    assert sorted(blocks) == sorted([len(shot), len(svg)])


def test_image_parts_are_read_from_each_api_in_order_and_never_trusted():
    svg = b"<svg onload='x'>" + b" " * 2000
    body = {"messages": [
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": b64(svg)}}]},
        {"role": "user", "content": [{"type": "input_image", "image_url": "https://h/x"}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": "data:x;base64,@@"}]},
        {"role": "user", "content": [{"type": "image_url",
                                      "image_url": {"url": "data:image/gif;base64,"
                                                    + b64(b"GIF89a" + b"\0" * 10)}}]}]}
    parts = image_parts(json.dumps(body))
    assert [p.media_type for p in parts] == ["application/octet-stream", None, None,
                                             "image/gif"]
    assert parts[1].url == "https://h/x" and parts[2].sha256 is None  # keeps its place
    assert image_parts("not json") == [] and image_parts("[" * 100_000) == []


@pytest.fixture
def proxy_settings(engine, db_url, tmp_path):
    from helpers.loop import free_port

    from tracetap.proxy.runtime.settings import Settings

    return Settings(upstream=engine.url, db=db_url, data_dir=str(tmp_path / "data"),
                    port=free_port(), upstream_flavor="vllm", translate="all")


def _messages_episode(proxy, shots: list[bytes]) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=proxy.url + "/episodes/shots-messages", api_key="k",
                                 max_retries=0)
    history: list[dict] = []
    for i, shot in enumerate(shots):
        history.append({"role": "user", "content": [
            {"type": "text", "text": f"step {i}"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64(shot)}}]})
        reply = client.messages.create(model="mock", max_tokens=8, messages=history)
        history.append({"role": "assistant", "content": reply.content[0].text})


def _chat_episode(proxy, shots: list[bytes]) -> None:
    import openai

    client = openai.OpenAI(base_url=proxy.episode_url("shots-chat"), api_key="k",
                           max_retries=0)
    history: list[dict] = []
    for i, shot in enumerate(shots):
        history.append({"role": "user", "content": [
            {"type": "text", "text": f"step {i}"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(shot)}}]})
        reply = client.chat.completions.create(model="mock", max_tokens=8, messages=history)
        history.append({"role": "assistant", "content": reply.choices[0].message.content})


def _responses_episode(proxy, shots: list[bytes]) -> None:
    import openai

    client = openai.OpenAI(base_url=proxy.episode_url("shots-responses"), api_key="k",
                           max_retries=0)
    history: list[dict] = []
    for i, shot in enumerate(shots):
        history.append({"role": "user", "content": [
            {"type": "input_text", "text": f"step {i}"},
            {"type": "input_image", "image_url": "data:image/png;base64," + b64(shot)}]})
        reply = client.responses.create(model="mock", max_output_tokens=8, input=history,
                                        store=False)
        history.append({"role": "assistant", "content": reply.output_text})


def test_every_image_is_recoverable_from_the_export_with_its_placeholder_span(proxy, tmp_path):
    """Through the proxy with the real SDKs (Messages and Responses translated to chat,
    and chat) to the mock engine: 20 screenshots, each resent every later turn."""
    import pyarrow.dataset as ds

    from tracetap.exporters import export

    shots = [screenshot(i, 4_000) for i in range(20)]
    _messages_episode(proxy, shots[:8])
    _responses_episode(proxy, shots[8:14])
    _chat_episode(proxy, shots[14:])
    for episode in ("shots-messages", "shots-responses", "shots-chat"):
        assert proxy.admin("POST", f"/tracetap/episodes/{episode}/finish", {})[0] == 200
    calls = proxy.calls("shots-messages")
    assert calls[-1]["upstream_request"] is not None  # translated: two bodies per call
    blocks = proxy.loop.run(_image_blocks(proxy.state.engine))
    assert sorted(blocks) == sorted(len(s) for s in shots)  # each image stored once

    export(proxy.settings.db, tmp_path / "out")
    rows = ds.dataset(tmp_path / "out" / "trajectories").to_table().to_pylist()
    pixels = {r["sha256"]: r for r in ds.dataset(tmp_path / "out" / "images").to_table()
              .to_pylist()}
    recovered = set()
    for row in rows:
        tokens = row["prompt_ids"] + row["response_ids"]
        for image in row["images"]:
            assert image["start"] is not None, row["images"]
            span = tokens[image["start"] - 1:image["end"] + 1]
            assert span == [tok.VISION_START, *[tok.IMAGE_PAD] * tok.IMAGE_PAD_TOKENS,
                            tok.VISION_END]
            stored = pixels[image["sha256"]]
            assert stored["media_type"] == image["media_type"] == "image/png"
            recovered.add(stored["data"])
    assert recovered == set(shots)  # 20 of 20
    assert len(pixels) == 20  # each written once
    calls_rows = ds.dataset(tmp_path / "out" / "calls").to_table(
        columns=["call_id", "images", "prompt_ids"]).to_pylist()
    last = max((r for r in calls_rows), key=lambda r: len(r["images"]))
    assert len(last["images"]) == 8
    assert all(last["prompt_ids"][i["start"]] == tok.IMAGE_PAD for i in last["images"])
    # Without calls/, the trajectories read the bodies they need themselves.
    export(proxy.settings.db, tmp_path / "only", datasets=["trajectories"])
    alone = ds.dataset(tmp_path / "only" / "trajectories").to_table().to_pylist()
    assert [r["images"] for r in alone] == [r["images"] for r in rows]
    assert ds.dataset(tmp_path / "only" / "images").count_rows() == 20


def _get(url: str, token: str | None) -> tuple[int, dict, bytes]:
    import urllib.error
    import urllib.request

    headers = {"Accept": "*/*", **({"Authorization": f"Bearer {token}"} if token else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=30) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, dict(err.headers), err.read()


def test_the_viewer_shows_thumbnails_and_serves_only_real_images_behind_its_gate(proxy):
    import openai

    from tracetap.storage.image_blocks import key

    png = screenshot(7, 3_000)
    svg = b"<svg xmlns='http://www.w3.org/2000/svg' onload='alert(1)'>" + b" " * 2000 + b"</svg>"
    client = openai.OpenAI(base_url=proxy.episode_url("thumbs"), api_key="k", max_retries=0)
    client.chat.completions.create(model="mock", max_tokens=4, messages=[{"role": "user",
                                                                         "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(png)}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(svg)}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@" + "A" * 3000}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}])
    [call] = proxy.calls("thumbs")
    ui = proxy.url + "/tracetap/ui"
    status, _, page = _get(f"{ui}/calls/{call['call_id']}", proxy.admin_token)
    assert status == 200
    assert f'<img class="thumb" src="/tracetap/ui/images/{key(png)}"'.encode() in page
    assert f"[image {key(png)}]".encode() in page  # the conversation's mark for it
    assert b"[image https://example.com/a.png]" in page and b"[image]" in page

    status, headers, body = _get(f"{ui}/images/{key(png)}", proxy.admin_token)
    assert (status, headers["Content-Type"], body) == (200, "image/png", png)
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert _get(f"{ui}/images/{key(png)}", None)[0] == 401  # behind the gate
    assert _get(f"{ui}/images/{key(svg)}", proxy.admin_token)[0] == 404  # sent as image/png
    text_block = unpack_refs(_refs(proxy, call["call_id"]))[0][0]  # the JSON before messages
    assert _get(f"{ui}/images/{text_block.hex()}", proxy.admin_token)[0] == 404
    assert _get(f"{ui}/images/{'0' * 32}", proxy.admin_token)[0] == 404


def _refs(proxy, call_id: str) -> bytes:
    async def read():
        async with proxy.state.engine.connect() as conn:
            return (await conn.execute(text("SELECT request_refs FROM calls WHERE call_id = :c"),
                                       {"c": call_id})).scalar()

    return bytes(proxy.loop.run(read()))


def test_placeholder_runs_are_matched_one_to_one_or_not_at_all():
    from array import array

    from tracetap.exporters.images import pad_runs, placed
    from tracetap.storage.image_parts import from_bytes

    ids = array("i", [1, 261, 261, 2, 261, 3, 151655, 151655, 151655]).tobytes()
    assert pad_runs(ids, 261) == [(1, 3), (4, 5)]
    assert pad_runs(b"\x00" + array("i", [261 << 8]).tobytes()[:3] + b"\x00" * 4, 1) == []
    one, two = from_bytes(b"GIF89a1"), from_bytes(b"GIF89a2")
    # Qwen's pad comes first among known ids, but has one run for two images: the mock's.
    assert [(p["start"], p["end"]) for p in placed([one, two], ids)] == [(1, 3), (4, 5)]
    assert [(p["start"], p["end"]) for p in placed([one], ids)] == [(6, 9)]
    assert [p["start"] for p in placed([one, two, one], ids)] == [None] * 3  # no match


def test_a_body_of_many_images_is_cut_into_a_bounded_number_of_blocks():
    from tracetap.storage.blocks import cut_text, join_text, pack_block, unpack_block
    from tracetap.storage.images import MAX_PER_SEGMENT

    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(
        screenshot(3, 1_200))}}
    body = json.dumps({"messages": [{"role": "user", "content": [part] * 600}]})
    pieces, _ = cut_text(body, "messages")
    assert len(pieces) <= 2 * MAX_PER_SEGMENT + 4
    assert len({h for (h, _), _ in pieces}) < 10  # one image: one block, however often
    assert join_text(unpack_block(pack_block(d)) for _, d in pieces) == body


def _shots_episode(proxy, episode: str, shots: list[bytes]) -> None:
    import openai

    client = openai.OpenAI(base_url=proxy.episode_url(episode), api_key="k", max_retries=0)
    history: list[dict] = []
    with client:
        for i, shot in enumerate(shots):
            history.append({"role": "user", "content": [
                {"type": "text", "text": f"step {i}"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(shot)}}]})
            reply = client.chat.completions.create(model="mock", max_tokens=8, messages=history)
            history.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert proxy.admin("POST", f"/tracetap/episodes/{episode}/finish", {})[0] == 200


def test_incremental_runs_write_each_image_once_per_export_directory(proxy, tmp_path):
    """Two incremental runs whose episodes share screenshots: the second writes only the
    images the first did not (its manifest entry lists what each run wrote), and every
    row of both runs finds its pixels in ``images/``."""
    import hashlib

    import pyarrow.dataset as ds

    from tracetap.exporters import export
    from tracetap.exporters.parquet import decode_manifest

    shots = [screenshot(i, 3_000) for i in range(4)]
    out = tmp_path / "out"
    _shots_episode(proxy, "inc-a", shots[:3])
    assert export(proxy.settings.db, out, incremental=True).episodes == 1
    _shots_episode(proxy, "inc-b", shots[1:])  # two screenshots the first run wrote
    assert export(proxy.settings.db, out, incremental=True).episodes == 1
    images = ds.dataset(out / "images").to_table().to_pylist()
    digest = [hashlib.sha256(s).hexdigest() for s in shots]
    assert sorted(r["sha256"] for r in images) == sorted(digest)  # each once, across runs
    assert {r["sha256"]: r["data"] for r in images} == dict(zip(digest, shots, strict=True))
    manifest = decode_manifest((out / "_manifest.json").read_bytes(), "manifest")
    assert [sorted(r.images) for r in manifest.runs] == [sorted(digest[:3]), [digest[3]]]
    rows = ds.dataset(out / "trajectories").to_table().to_pylist()
    named = {i["sha256"] for r in rows for i in r["images"]}
    assert named == set(digest)  # every row's images are in images/
    # A fresh (not incremental) export over it writes them all again, once.
    export(proxy.settings.db, out, overwrite=True)
    assert ds.dataset(out / "images").count_rows() == 4


def test_the_writers_cache_keeps_a_screenshot_conversation_at_about_its_text(db_url):
    """The writer's cache (storage.dedup) keeps each conversation's last request prefix to
    recognise the next call's resent part: its images by a keyed hash, not their base64,
    so 30 turns of screenshots cost it about their text; a resent image that changed
    (same length, other bytes) is not taken for the one it replaces, and every request
    reads back byte for byte."""
    shots = [screenshot(i, 20_000) for i in range(7)]
    history: list[dict] = []
    records = []
    for i, shot in enumerate(shots[:6]):
        history.append({"role": "user", "content": [
            {"type": "text", "text": f"step {i}"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(shot)}}]})
        records.append(json.dumps({"model": "m", "messages": history}))
        history.append({"role": "assistant", "content": f"ok {i}"})
    # The last call resends a history whose second screenshot was swapped in place.
    swapped = json.loads(records[-1])
    swapped["messages"][2]["content"][1]["image_url"]["url"] = (
        "data:image/png;base64," + b64(shots[6]))
    swapped["messages"].append({"role": "user", "content": "and now?"})
    records.append(json.dumps(swapped))
    assert len(records[-2]) > 150_000

    async def step(engine):
        cache = BlockCache()
        sizes = []
        for i, body in enumerate(records):
            await insert_calls(engine, [CallRecord(
                call_id=f"k{i}", episode_id="shots", seq=i, endpoint="chat.completions",
                model="m", t_start=1000.0 + i, t_end=1001.0 + i, http_status=200,
                request=body, response="{}", prompt_ids=[1, 2, 3 + i])], cache)
            sizes.append(cache.get("shots").size)
        return sizes, await queries.calls_of(engine, "shots"), await _image_blocks(engine)

    sizes, stored, blocks = _run(db_url, step)
    assert [c["request"] for c in stored] == records  # byte for byte
    assert sorted(blocks) == sorted(len(s) for s in shots)  # the swapped-in one too
    assert max(sizes) < 2_000  # the text, not 120,000 bytes of base64
