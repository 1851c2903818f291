"""A long agentic episode as stored call records: 30 turns whose one trajectory ends at
about 65,000 tokens, the last call sending 60 messages (the viewer's long-page case).

Tokens are the mock engine's (demo.tokenizer: byte-level ChatML), so each prompt is the
previous prompt + completion + the tool's answer, as a real append-only harness makes
it, and the engine's /detokenize gives every token's text. Texts are drawn from a fixed
word list by a seeded generator: the same records every time, as varied as source code
and logs (they compress about as well as real ones, not better).
"""

from __future__ import annotations

import json
import random

from tracetap.demo.tokenizer import IM_END, apply_chat_template, encode
from tracetap.storage.records import CallRecord, ChoiceRecord

MODEL = "mock-model"
T0 = 1_770_000_000.0
_VOCABULARY = (
    "self value result config path error return import from def class assert test "
    "request response token episode call row window data list dict int str none "
    "true false await async yield raise except finally with open read write close "
    "index count total start end size limit offset cursor query filter sort page "
    "parse format encode decode split join strip lower upper append extend update "
    "logger warning info debug cache store fetch load save build check verify run "
    "session client server proxy engine model prompt completion choice reward")
_WORDS = tuple(_VOCABULARY.split())


def _line(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _tool_output(rng: random.Random, turn: int, size: int) -> str:
    lines, used = [], 0
    while used < size:
        kind = rng.randrange(4)
        if kind == 0:
            where = f"src/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.py:{rng.randrange(1, 900)}"
            line = f"{where}: {_line(rng, rng.randrange(3, 9))}"
        elif kind == 1:
            args = _line(rng, 2).replace(" ", ", ")
            line = f"    {rng.choice(_WORDS)} = {rng.choice(_WORDS)}({args})"
        elif kind == 2:
            verdict = rng.choice(("PASSED", "FAILED", "PASSED", "SKIPPED"))
            line = f"test_{rng.choice(_WORDS)}_{turn}.py::{rng.choice(_WORDS)} " \
                   f"{verdict} [{rng.randrange(100)}%]"
        else:
            line = f"# {_line(rng, rng.randrange(5, 12))}"
        lines.append(line)
        used += len(line) + 1
    return "\n".join(lines)


def _assistant(rng: random.Random, turn: int, last: bool) -> dict:
    text = f"Turn {turn}: {_line(rng, rng.randrange(30, 50))}."
    if last:
        return {"role": "assistant", "content": text + " The fix is in; every test passes."}
    arguments = json.dumps({"cmd": f"pytest -q tests/test_{rng.choice(_WORDS)}.py",
                            "timeout": 60})
    return {"role": "assistant", "content": text, "tool_calls": [
        {"id": f"call_{turn}", "type": "function",
         "function": {"name": "shell", "arguments": arguments}}]}


def _logprobs(rng: random.Random, n: int) -> list[float]:
    # mostly confident, one token in ~60 unlikely (what the low-probability panel finds)
    return [-rng.uniform(2.5, 5.0) if rng.random() < 1 / 60 else -rng.uniform(0.0, 0.4)
            for _ in range(n)]


def long_episode(episode_id: str = "long-30", turns: int = 30, tool_chars: int = 1_750,
                 seed: int = 45) -> list[CallRecord]:
    """The calls of one episode of ``turns`` append-only turns (ids: EPISODE-00..)."""
    rng = random.Random(seed)
    messages: list[dict] = [
        {"role": "system", "content": "You are a coding agent.\n" + _tool_output(rng, 0, 3_000)},
        {"role": "user", "content": "Fix the failing tests. " + _line(rng, 60)},
    ]
    records = []
    for k in range(turns):
        prompt = apply_chat_template(messages)
        reply = _assistant(rng, k + 1, k == turns - 1)
        text = reply["content"] + "".join(
            f'<tool_call>{{"name":"shell","arguments":{c["function"]["arguments"]}}}</tool_call>'
            for c in reply.get("tool_calls", ()))
        completion = [*encode(text), IM_END]
        t = T0 + k * 4.0
        body = {"model": MODEL, "messages": messages, "logprobs": True}
        answer = {"id": f"cmpl-{k}", "object": "chat.completion", "model": MODEL, "choices": [
            {"index": 0, "message": reply,
             "finish_reason": "stop" if k == turns - 1 else "tool_calls"}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion)}}
        records.append(CallRecord(
            call_id=f"{episode_id}-{k:02d}", episode_id=episode_id, seq=k, instance="demo",
            endpoint="chat.completions", model=MODEL, t_start=t, t_first_byte=t + 0.08,
            t_end=t + 1.5, status="ok", http_status=200, prompt_ids=prompt,
            prompt_tokens=len(prompt), completion_tokens=len(completion),
            request=json.dumps(body), response=json.dumps(answer), choices=[ChoiceRecord(
                index=0, finish_reason=answer["choices"][0]["finish_reason"], text=text,
                completion_ids=completion, completion_logprobs=_logprobs(rng, len(completion)),
                token_source="engine")]))
        messages = [*messages, reply]
        if k < turns - 1:
            messages.append({"role": "tool", "tool_call_id": f"call_{k + 1}",
                             "content": _tool_output(rng, k + 1, tool_chars)})
    return records
