"""``--tokenizer``: a local tokenizer renders and tokenizes what the engine cannot, checked
against the engine before anything is kept.

The test builds, with the ``tokenizers`` library, a real tokenizer.json (and a GGUF) of the
mock engine's own vocabulary (bytes 0..255, four special tokens) and a Jinja chat template
that renders its ChatML, so every id is checkable against the mock's own tokenizer.
"""

from __future__ import annotations

import json
import sys

import openai
import pytest
from aiohttp import web
from helpers.loop import free_port
from helpers.servers import Proxy

from tests.test_token_ids import TOOLS, chat_loop, export_rows, missing_metric
from tracetap.demo import tokenizer as tok
from tracetap.demo.engine import EngineConfig, make_engine_app
from tracetap.proxy.runtime.settings import Settings
from tracetap.proxy.tokens import local_tokenizer

TEMPLATE = (
    "{% if tools %}<|im_start|>tools\n"
    "{{ tools | tojson(separators=(',', ':'), sort_keys=true) }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}"
    "{% elif m.content %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\":{{ c.function.name | tojson }},"
    "\"arguments\":{{ c.function.arguments }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "Hi"}]},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "Caf\u00e9?"}]}],
     "tools": TOOLS},
    {"messages": [{"role": "user", "content": "Look it up."},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c1", "type": "function",
                       "function": {"name": "lookup", "arguments": '{"q":"x"}'}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "found <|im_end|>"}],
     "tools": TOOLS},
]


def _byte_chars() -> dict[int, str]:
    return {b: chr(c) for b, c in local_tokenizer._byte_map().items()}


def mock_vocab_tokenizer():
    """The mock engine's vocabulary as a byte-level BPE: id i is byte i, then specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    chars = _byte_chars()
    tokenizer = Tokenizer(BPE({chars[b]: b for b in range(256)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False)
                                  for s in tok.SPECIAL_TOKENS])
    return tokenizer


@pytest.fixture
def hf_dir(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    mock_vocab_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}))
    return folder


@pytest.fixture
def gguf_file(tmp_path):
    from gguf import GGUFWriter, TokenType

    path = tmp_path / "mock.gguf"
    chars = _byte_chars()
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chars[b] for b in range(256)] + list(tok.SPECIAL_TOKENS))
    writer.add_token_types([TokenType.NORMAL] * 256 + [TokenType.CONTROL] * 4)
    writer.add_token_merges([])
    writer.add_eos_token_id(tok.EOS)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("source", ["dir", "json", "gguf"])
def test_the_local_tokenizer_renders_and_tokenizes_as_the_engine(source, hf_dir, gguf_file):
    path = {"dir": hf_dir, "json": hf_dir / "tokenizer.json", "gguf": gguf_file}[source]
    local = local_tokenizer.load(str(path))
    for request in CONVERSATIONS:
        expected = tok.apply_chat_template(request["messages"], request.get("tools"))
        assert local.chat_prompt(request) == expected
    text = "Caf\u00e9 <tool_call> ok"
    assert [t for t, _ in local.pieces(text)] == tok.encode(text)
    assert [piece for _, piece in local.pieces("a\u00e9")] == [b"a", b"\xc3", b"\xa9"]
    assert local.prompt("Hi") == tok.encode("Hi")


def test_a_sentencepiece_gguf_merges_by_score_with_byte_fallback(tmp_path):
    """llama.cpp's SentencePiece tokenizer joins the adjacent pair whose joined piece
    scores highest, and spells what no piece covers in <0xNN> byte tokens."""
    from gguf import GGUFWriter, TokenType

    pieces = ["\u2581", "a", "b", "ab", "\u2581a", "\u2581ab", "ba"]
    scores = [-3.0, -4.0, -4.0, -2.0, -1.0, -0.5, -0.1]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>",
              *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    types = [TokenType.CONTROL] * 3 + [TokenType.UNKNOWN] + [TokenType.BYTE] * 256 + [
        TokenType.NORMAL] * len(pieces)
    path = tmp_path / "spm.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 260 + scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    local = local_tokenizer.load(str(path))
    piece = {t: i for i, t in enumerate(tokens)}
    # "ab ab": ▁a first (-1.0), then ▁ab (-0.5), then ab (-2.0); "ba" never forms.
    assert [t for t, _ in local.pieces("ab ab")] == [piece["ab"], piece["\u2581ab"]]
    assert [b for _, b in local.pieces("ab ab")] == [b"ab", b" ab"]
    assert [t for t, _ in local.pieces("\u00e9")] == [4 + 0xC3, 4 + 0xA9]  # byte fallback
    assert local.prompt("a") == [2, piece["a"]]  # BOS, as add_bos_token says
    assert local.chat_prompt({"messages": [{"role": "user", "content": "b"}]}) == [
        2, piece["b"]]  # the template beside the file, its BOS parsed as the special token


def test_a_missing_package_or_path_is_a_clear_error_at_start(hf_dir, monkeypatch):
    with pytest.raises(ValueError, match="no such file"):
        Settings(upstream="http://x/v1", tokenizer=str(hf_dir / "nope.json"))
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ValueError, match=r"pip install 'tracetap\[tokenizer\]'"):
        Settings(upstream="http://x/v1", tokenizer=str(hf_dir))


def _engine(serve_app, asked: list[str]) -> str:
    app = make_engine_app(EngineConfig(flavor="llama-cpp-python"))

    @web.middleware
    async def record(request, handler):
        asked.append(request.path)
        return await handler(request)

    app.middlewares.append(record)
    return serve_app(app) + "/v1"


def test_chat_on_llama_cpp_python_gets_verified_ids_from_the_local_tokenizer(
        loop_thread, db_url, tmp_path, serve_app, hf_dir):
    asked: list[str] = []
    settings = Settings(upstream=_engine(serve_app, asked), db=db_url, port=free_port(),
                        data_dir=str(tmp_path / "data"), tokenizer=str(hf_dir))
    proxy = Proxy(loop_thread, settings).start()
    try:
        calls = chat_loop(proxy, "local", 4)  # turns 1 and 3 stream
        metric = missing_metric(proxy)
        _, summary = export_rows(proxy, tmp_path, "local")
    finally:
        proxy.stop()
    for i, call in enumerate(calls):
        request = json.loads(call["request"])
        [choice] = call["choices"]
        # Completions: the engine's token strings, matched one for one.
        assert choice["token_source"] == "local_tokenizer"
        assert choice["completion_ids"] == tok.encode(choice["text"])
        if i % 2:  # a stream: llama-cpp-python reports no usage, so nothing to check against
            assert call["prompt_ids"] is None and call["ids_missing"] == "no_prompt_count"
        else:
            assert call["prompt_ids"] == tok.apply_chat_template(request["messages"],
                                                                 request.get("tools"))
            assert call["prompt_source"] == "local_tokenizer" and call["ids_missing"] is None
    assert metric == {"no_prompt_count": 2.0}
    assert summary.left_out == {"no_prompt_count": 2}
    assert not [p for p in asked if p.startswith("/extras/")]  # the engine was never asked


def test_a_template_that_renders_otherwise_is_not_kept(loop_thread, db_url, tmp_path,
                                                       serve_app, hf_dir):
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.replace("{{ m.role }}\n", "{{ m.role }}: ")
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    settings = Settings(upstream=_engine(serve_app, []), db=db_url, port=free_port(),
                        data_dir=str(tmp_path / "data"), tokenizer=str(hf_dir))
    proxy = Proxy(loop_thread, settings).start()
    try:
        client = openai.OpenAI(base_url=proxy.episode_url("off"), api_key="x", max_retries=0)
        with client:
            client.chat.completions.create(model="m", logprobs=True, top_logprobs=1,
                                           messages=[{"role": "user", "content": "Hi"}])
        [call] = proxy.calls("off")
    finally:
        proxy.stop()
    assert call["prompt_ids"] is None and call["ids_missing"] == "count_mismatch"
    assert call["choices"][0]["token_source"] == "local_tokenizer"
