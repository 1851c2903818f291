"""proxy/tokens/resolve.py on its own: which records are resolved, why each missing id is missing,
when an engine that cuts streams is asked, and what is counted and logged.

The engine's tokenize endpoints are played in-process (helpers.tokenize_engine: one id
per character); the end-to-end promises, through the proxy with the real SDK and the
mock engine, are in test_token_ids.py and test_local_tokenizer.py."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from helpers.tokenize_engine import BOS, TokenizeEngine, ids_of, render

from tracetap.proxy.tokens.engine_tokenizer import TokenizeFailed
from tracetap.proxy.tokens.resolve import REMEDIES, TokenResolver
from tracetap.proxy.upstream.traffic import Traffic
from tracetap.storage.records import CallRecord, ChoiceRecord, prompt_ids_of

UPSTREAM = "http://engine:8000/v1"
MESSAGES = [{"role": "user", "content": "hi"}]
PROMPT = ids_of(render(MESSAGES), bos=True)


def chat(request: dict | None = None, *, strs=("o", "k", "!"), endpoint="chat.completions",
         prompt_tokens: int | None = None, **fields) -> CallRecord:
    """A call whose engine returned token strings but no ids."""
    body = request if request is not None else {"model": "m", "messages": MESSAGES}
    choice = ChoiceRecord(index=0, text="".join(strs), token_strs=list(strs))
    fields = {"http_status": 200, "upstream": UPSTREAM, **fields}
    return CallRecord(call_id="c", endpoint=endpoint, t_start=0.0,
                      request=json.dumps(body),
                      prompt_tokens=len(PROMPT) if prompt_tokens is None else prompt_tokens,
                      choices=[choice], **fields)


def only(traffic: Traffic):
    """The pool's ``traffic``: the calls in flight to UPSTREAM, none known for another."""
    return lambda upstream: traffic if upstream == UPSTREAM else None


def resolve(records: list[CallRecord], engine: TokenizeEngine, hold: bool = True, **kwargs):
    """(records handed back, reasons counted) of one pass of a new resolver."""
    counted: list[str] = []
    resolver = TokenResolver(engine, counted.append, **kwargs)
    back = asyncio.run(resolver(records, hold))
    return back, counted


def test_engine_ids_are_filled_in_and_marked_with_their_source():
    record = chat(strs=("o", "k", "!"))
    back, counted = resolve([record], TokenizeEngine("vllm"))
    assert back == [] and counted == []
    assert prompt_ids_of(record) == PROMPT and record.prompt_source == "engine_tokenize"
    [choice] = record.choices
    assert choice.completion_ids == ids_of("ok!")
    assert choice.token_source == "verified_retokenized"
    assert record.ids_missing is None


@pytest.mark.parametrize("family", ["llama-server", "vllm", "llama-cpp-python"])
def test_each_family_gives_the_completion_ids_that_reproduce_the_engines_strings(family):
    record = chat(strs=("o", "k", "!"), endpoint="completions",
                  request={"model": "m", "prompt": "say ok"},
                  prompt_tokens=len(ids_of("say ok", bos=True)))
    back, counted = resolve([record], TokenizeEngine(family))
    assert back == [] and counted == []
    assert prompt_ids_of(record) == ids_of("say ok", bos=True)
    assert record.choices[0].completion_ids == ids_of("ok!")
    assert record.choices[0].token_source == "verified_retokenized"


def test_only_finished_calls_with_choices_that_lack_ids_are_resolved():
    engine = TokenizeEngine("vllm")
    failed, refused, empty, complete = (chat(status="error"), chat(http_status=500),
                                        chat(), chat(prompt_ids=[1, 2]))
    empty.choices = []
    complete.choices[0].completion_ids = [5]
    text_only = chat(prompt_ids=[1, 2])  # ids for the prompt, text without ids: resolved
    text_only.choices[0].token_strs = None
    back, counted = resolve([failed, refused, empty, complete, text_only], engine)
    assert back == [] and counted == ["no_token_strings"]
    assert [r.ids_missing for r in (failed, refused, empty, complete)] == [None] * 4
    assert [prompt_ids_of(r) for r in (failed, refused, empty)] == [None] * 3
    assert text_only.ids_missing == "no_token_strings"
    assert engine.asked  # the text-only call was taken up
    engine = TokenizeEngine("llama-cpp-python")
    traffic = Traffic()

    async def busy():  # an engine that cuts streams, busy: a record taken up would wait
        await traffic.admit()
        resolver = TokenResolver(engine, traffic=lambda upstream: traffic)
        return await resolver([complete, failed, refused, empty])

    assert asyncio.run(busy()) == [] and engine.asked == []


@pytest.mark.parametrize(("engine", "record", "reason"), [
    (TokenizeEngine("none"), chat(), "no_tokenizer"),
    (TokenizeEngine("llama-cpp-python"), chat(), "no_chat_template"),
    (TokenizeEngine("llama-server", fail=("/tokenize",)), chat(), "tokenize_failed"),
    (TokenizeEngine("vllm"), chat(prompt_tokens=3), "count_mismatch"),
    (TokenizeEngine("vllm"), chat(endpoint="embeddings"), "unsupported_request"),
    (TokenizeEngine("vllm"), chat({"model": "m", "prompt": ["a", "b"]}, endpoint="completions"),
     "unsupported_request"),
    (TokenizeEngine("vllm"), chat(request={}, upstream_request="not json"),
     "unsupported_request"),
])
def test_a_prompt_without_ids_says_why_and_comes_first(engine, record, reason):
    back, counted = resolve([record], engine)
    assert back == []
    assert prompt_ids_of(record) is None and record.prompt_source is None
    assert record.ids_missing == reason
    assert counted == [reason]  # one choice with content: counted once, the prompt's reason


@pytest.mark.parametrize(("strs", "engine", "reason"), [
    ((), TokenizeEngine("vllm"), "no_token_strings"),
    (("o", "\ufffd"), TokenizeEngine("vllm"), "unverified"),  # would retokenize "alike"
    (("ok", "!"), TokenizeEngine("vllm"), "unverified"),  # "ok" is two tokens here
    (("o", "k"), TokenizeEngine("vllm", pieces={ord("k") + 10: "K"}), "unverified"),
    (("o", "k"), TokenizeEngine("vllm", fail=("/detokenize",)), "unverified"),
    (("o", "k"), TokenizeEngine("llama-server", pieces={ord("k") + 10: None}), "unverified"),
])
def test_completion_ids_are_kept_only_when_they_reproduce_the_engines_strings(strs, engine,
                                                                              reason):
    record = chat(strs=strs, prompt_ids=[1])
    record.choices[0].text = "ok"  # content, so a missing id is counted
    back, counted = resolve([record], engine)
    assert back == [] and counted == [reason]
    assert record.choices[0].completion_ids is None
    assert record.choices[0].token_source == "none" and record.ids_missing == reason


def test_a_failing_retokenization_is_not_a_verified_one():
    record = chat(strs=("o", "k"), prompt_ids=[1])
    _back, counted = resolve([record], TokenizeEngine("llama-server", fail=("/tokenize",)))
    assert counted == ["tokenize_failed"] and record.choices[0].completion_ids is None


def test_every_choice_with_content_is_counted_the_prompts_reason_first(caplog):
    record = chat(prompt_tokens=99)
    record.choices = [ChoiceRecord(index=0, text="a", token_strs=["a"]),
                      ChoiceRecord(index=1, text="b"),  # no strings, no ids
                      ChoiceRecord(index=2)]  # no content: nothing to count
    with caplog.at_level(logging.WARNING, logger="tracetap.resolve"):
        _back, counted = resolve([record, chat(prompt_tokens=98)], TokenizeEngine("vllm"))
    assert counted == ["count_mismatch"] * 3
    assert record.ids_missing == "count_mismatch"
    assert record.choices[0].completion_ids == ids_of("a")  # still resolved
    [line] = [r.getMessage() for r in caplog.records]  # once per upstream and reason
    assert line == (f"upstream {UPSTREAM}: calls stored without token ids (count_mismatch) "
                    f"are left out of trajectories/; remedy: {REMEDIES['count_mismatch']}")


def test_the_first_reason_stays_and_nothing_needs_a_counter():
    record = chat(ids_missing="earlier", prompt_tokens=1)
    back = asyncio.run(TokenResolver(TokenizeEngine("vllm"))([record]))
    assert back == [] and record.ids_missing == "earlier"


def test_the_upstream_request_is_what_the_engine_tokenized():
    translated = {"model": "m", "messages": [{"role": "user", "content": "translated"}]}
    record = chat(request={"model": "m", "input": "x"}, upstream_request=json.dumps(translated),
                  endpoint="responses:chat", prompt_tokens=None)
    record.prompt_tokens = None  # no count reported: the engine's render is kept as it is
    _back, counted = resolve([record], TokenizeEngine("vllm"))
    assert counted == [] and prompt_ids_of(record) == ids_of(render(translated["messages"]),
                                                         bos=True)


def test_an_engine_that_cuts_streams_is_asked_only_between_calls():
    traffic = Traffic()
    engine = TokenizeEngine("llama-cpp-python")

    async def run():
        resolver = TokenResolver(engine, traffic=only(traffic),
                                 flavor=lambda: "llama-cpp-python")
        await traffic.admit()  # a call streams
        held = await resolver([first := chat(prompt_ids=[1])])
        asked_while_busy = list(engine.asked)
        stored = await resolver([second := chat(prompt_ids=[1])], hold=False)
        traffic.release()
        later = await resolver([first])
        return held, asked_while_busy, stored, later, first, second

    held, asked_while_busy, stored, later, first, second = asyncio.run(run())
    assert [r.call_id for r in held] == ["c"] and asked_while_busy == []
    assert stored == [] and second.ids_missing == "engine_busy"
    assert later == [] and first.ids_missing is None
    assert first.choices[0].completion_ids == ids_of("ok!")


def test_an_engine_that_never_cuts_streams_is_asked_while_calls_run():
    traffic = Traffic()
    engine = TokenizeEngine("vllm")

    async def run():
        await traffic.admit()
        resolver = TokenResolver(engine, traffic=only(traffic),
                                 flavor=lambda: "openai")
        await resolver.identify([UPSTREAM])  # between calls: the kind is learnt
        await traffic.admit()  # another call streams: a vLLM is asked all the same
        return await resolver([record := chat()]), record

    async def main():
        task = asyncio.ensure_future(run())
        await asyncio.sleep(0.05)
        assert not task.done()  # the probes wait while a call is in flight
        traffic.release()
        return await task

    back, record = asyncio.run(main())
    assert back == [] and prompt_ids_of(record) == PROMPT and traffic.inflight == 1


@pytest.mark.parametrize("flavor", ["vllm", "sglang", "llamacpp"])
def test_a_patient_engine_kind_is_asked_at_once_and_never_probed_at_start(flavor):
    traffic = Traffic()
    engine = TokenizeEngine("vllm")

    async def run():
        await traffic.admit()
        resolver = TokenResolver(engine, traffic=only(traffic), flavor=lambda: flavor)
        await resolver.identify([UPSTREAM])
        probes = list(engine.asked)
        return probes, await resolver([record := chat()]), record

    probes, back, record = asyncio.run(run())
    assert probes == [] and back == [] and prompt_ids_of(record) == PROMPT


def test_identify_probes_each_upstream_once_unless_told_its_kind():
    engine = TokenizeEngine("vllm")

    async def run(**kwargs):
        resolver = TokenResolver(engine, **kwargs)
        await resolver.identify([UPSTREAM, "http://other:1/v1"])
        await resolver.identify([UPSTREAM])
        return resolver

    resolver = asyncio.run(run())
    origins = [origin for origin, _, _ in engine.asked]
    assert origins == ["http://engine:8000"] * 2 + ["http://other:1"] * 2  # 2 probes each
    assert asyncio.run(resolver.tokenizer(UPSTREAM)).kind == "vllm"


def test_a_down_upstream_is_asked_again_one_without_endpoints_is_not(caplog):
    down, none = TokenizeEngine("down"), TokenizeEngine("none")

    async def run():
        first = TokenResolver(down, address=lambda shown: shown.replace("engine", "real"))
        a = [await first.tokenizer(UPSTREAM) for _ in range(2)]
        second = TokenResolver(none)
        b = [await second.tokenizer(UPSTREAM) for _ in range(2)]
        return a, b, await first.tokenizer("")

    with caplog.at_level(logging.INFO, logger="tracetap.resolve"):
        a, b, empty = asyncio.run(run())
    assert a == [None, None] and b == [None, None] and empty is None
    assert len(down.asked) == 6 and {o for o, _, _ in down.asked} == {"http://real:8000"}
    assert len(none.asked) == 3  # asked once: it has none of the three
    assert [r.getMessage() for r in caplog.records] == [
        f"upstream {UPSTREAM}: token ids it does not return come from nowhere",
        "upstream : token ids it does not return come from nowhere"]


def test_concurrent_records_of_one_upstream_probe_it_once(caplog):
    engine = TokenizeEngine("llama-server")

    async def run():
        resolver = TokenResolver(engine)
        return await asyncio.gather(*(resolver.tokenizer(UPSTREAM) for _ in range(5)))

    with caplog.at_level(logging.INFO, logger="tracetap.resolve"):
        found = asyncio.run(run())
    assert len({id(t) for t in found}) == 1 and found[0].kind == "llama-server"
    assert len(engine.asked) == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"upstream {UPSTREAM}: token ids it does not return come from its llama-server "
        "tokenize endpoints"]


@pytest.mark.parametrize(("family", "processes", "warned"), [
    ("llama-cpp-python", 2, True), ("llama-cpp-python", 1, False), ("vllm", 4, False),
    ("llama-cpp-python", None, False)])  # None: the default, one process
def test_workers_that_share_an_engine_that_cuts_streams_are_warned(family, processes, warned,
                                                                    caplog):
    async def run():
        workers = {} if processes is None else {"processes": processes}
        await TokenResolver(TokenizeEngine(family), **workers).tokenizer(UPSTREAM)

    with caplog.at_level(logging.WARNING, logger="tracetap.resolve"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ([f"upstream {UPSTREAM} (llama-cpp-python) ends a stream when asked "
                      f"anything, and with --workers {processes} no worker sees the others' "
                      "calls: its tokenizer may cut their streams; pass --tokenizer, serve "
                      "it with --interrupt_requests false, or use one worker"]
                     if warned else [])


def test_at_most_the_concurrency_of_records_is_resolved_at_once():
    engine = TokenizeEngine("vllm")
    out, peak = [0], [0]  # prompts being tokenized: one a record
    real = engine.post_json

    async def slow(url, body, timeout=10.0):
        prompt = "messages" in body
        out[0] += prompt
        peak[0] = max(peak[0], out[0])
        await asyncio.sleep(0.01)
        out[0] -= prompt
        return await real(url, body, timeout)

    engine.post_json = slow
    records = [chat() for _ in range(6)]
    back, counted = resolve(records, engine, concurrency=2)
    assert back == [] and counted == [] and peak[0] == 2


class Local:
    """--tokenizer's interface (proxy.local_tokenizer), with the same one-id-a-char rule."""

    def __init__(self, fail: bool = False):
        self.fail = fail

    def chat_prompt(self, request: dict) -> list[int]:
        if self.fail:
            raise TokenizeFailed("no template")
        return ids_of(render(request["messages"]), bos=True)

    def prompt(self, text: str) -> list[int]:
        return ids_of(text, bos=True)

    def pieces(self, text: str) -> list[tuple[int, bytes | None]]:
        return [(t, chr(t - 10).encode()) for t in ids_of(text)]


def test_the_local_tokenizer_does_both_and_the_engine_is_never_asked():
    engine = TokenizeEngine("vllm")
    records = [chat(strs=("o", "k")),
               chat({"model": "m", "prompt": "go"}, endpoint="completions", strs=("o", "k"),
                    prompt_tokens=3)]
    back, counted = resolve(records, engine, local=Local())
    assert back == [] and counted == [] and engine.asked == []
    assert [prompt_ids_of(r) for r in records] == [PROMPT, [BOS, ord("g") + 10, ord("o") + 10]]
    assert {r.prompt_source for r in records} == {"local_tokenizer"}
    assert {r.choices[0].token_source for r in records} == {"local_tokenizer"}
    assert [r.choices[0].completion_ids for r in records] == [ids_of("ok")] * 2


@pytest.mark.parametrize(("record", "local", "reason"), [
    (chat(prompt_tokens=5), Local(), "count_mismatch"),
    (chat(), Local(fail=True), "tokenize_failed"),
    (chat(request={}, upstream_request="{"), Local(), "unsupported_request"),
    (chat({"model": "m", "prompt": [1, 2]}, endpoint="completions"), Local(),
     "unsupported_request"),
    (chat(endpoint="embeddings"), Local(), "unsupported_request"),
])
def test_the_local_tokenizers_prompt_says_why_it_is_missing(record, local, reason):
    _back, counted = resolve([record], TokenizeEngine("vllm"), local=local)
    assert counted == [reason] and prompt_ids_of(record) is None and record.ids_missing == reason
    assert record.choices[0].completion_ids == ids_of("ok!")  # the completion still is


def test_a_chat_prompt_rendered_locally_needs_the_engines_count():
    record = chat()
    record.prompt_tokens = None
    _back, counted = resolve([record], TokenizeEngine("vllm"), local=Local())
    assert counted == ["no_prompt_count"] and prompt_ids_of(record) is None
    completions = chat({"model": "m", "prompt": "go"}, endpoint="completions")
    completions.prompt_tokens = None  # a completions prompt needs no template: kept
    resolve([completions], TokenizeEngine("vllm"), local=Local())
    assert prompt_ids_of(completions) == ids_of("go", bos=True)


@pytest.mark.parametrize(("strs", "reason"), [((), "no_token_strings"),
                                              (("o", "\ufffd"), "unverified"),
                                              (("ok",), "unverified")])
def test_the_local_tokenizers_completion_is_verified_as_the_engines(strs, reason):
    record = chat(strs=strs, prompt_ids=[1])
    record.choices[0].text = "ok"
    _back, counted = resolve([record], TokenizeEngine("vllm"), local=Local())
    assert counted == [reason] and record.choices[0].completion_ids is None


def test_a_completion_without_a_tokenizer_says_so():
    record = chat(prompt_ids=[1])  # the prompt has ids: the completion's reason is counted
    back, counted = resolve([record], TokenizeEngine("none"))
    assert back == [] and counted == ["no_tokenizer"] and record.ids_missing == "no_tokenizer"


def test_a_record_naming_no_upstream_asks_nothing():
    engine = TokenizeEngine("vllm")
    _, counted = resolve([chat(prompt_ids=[1], upstream=None)] * 2, engine)
    assert counted == ["no_tokenizer"] * 2 and engine.asked == []


def test_each_upstream_and_reason_is_logged_once(caplog):
    other = "http://other:1/v1"
    records = [chat(prompt_tokens=99), chat(prompt_tokens=98, upstream=other),
               chat(prompt_tokens=97), chat(prompt_ids=[1], strs=("ok",))]
    with caplog.at_level(logging.WARNING, logger="tracetap.resolve"):
        resolve(records, TokenizeEngine("vllm"))
    logged = sorted(r.getMessage().split(" are left out")[0] for r in caplog.records)
    assert logged == [f"upstream {UPSTREAM}: calls stored without token ids (count_mismatch)",
                      f"upstream {UPSTREAM}: calls stored without token ids (unverified)",
                      f"upstream {other}: calls stored without token ids (count_mismatch)"]


def test_every_choice_with_ids_or_strings_counts_as_content():
    record = chat(prompt_tokens=99)
    record.choices = [ChoiceRecord(index=0, token_strs=["a"]),
                      ChoiceRecord(index=1, completion_ids=[5]), ChoiceRecord(index=2)]
    _, counted = resolve([record], TokenizeEngine("vllm"))
    assert counted == ["count_mismatch"] * 2
    assert record.choices[0].completion_ids == ids_of("a")


def test_the_local_tokenizer_never_replaces_the_engines_own_completion_ids():
    record = chat(strs=("o", "k"))
    record.choices[0].completion_ids, record.choices[0].token_source = [99, 98], "engine"
    _, counted = resolve([record], TokenizeEngine("vllm"), local=Local())
    assert counted == [] and prompt_ids_of(record) == PROMPT
    assert record.choices[0].completion_ids == [99, 98]
    assert record.choices[0].token_source == "engine"


def test_an_upstream_slow_to_answer_its_probes_holds_up_no_other():
    class Slow(TokenizeEngine):
        def __init__(self):
            super().__init__("vllm")
            self.release = asyncio.Event()

        async def post_json(self, url, body, timeout=10.0):
            if url.startswith("http://slow"):
                await self.release.wait()
            return await super().post_json(url, body, timeout)

    async def run():
        engine = Slow()
        resolver = TokenResolver(engine)
        slow = asyncio.ensure_future(resolver.tokenizer("http://slow:1/v1"))
        await asyncio.sleep(0)
        fast = await asyncio.wait_for(resolver.tokenizer(UPSTREAM), 2)
        engine.release.set()
        return fast, await slow

    fast, slow = asyncio.run(run())
    assert fast.kind == slow.kind == "vllm" and fast is not slow
