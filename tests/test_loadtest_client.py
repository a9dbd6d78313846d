"""The load generator's SSE framing and chunk classification: pure, byte-level."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.client import SSEDecoder, error_text, has_content

FIXTURES = Path(__file__).parent / "fixtures"


def decode_in_pieces(data: bytes, size: int) -> list[bytes]:
    dec = SSEDecoder()
    out: list[bytes] = []
    for i in range(0, len(data), size):
        out += dec.feed(data[i : i + size])
    assert dec.pending == b""
    return out


def test_sse_decoder_gives_the_same_events_however_the_bytes_are_split():
    data = (FIXTURES / "vllm_chat_stream.txt").read_bytes()
    whole = decode_in_pieces(data, len(data))
    assert whole[-1] == b"[DONE]" and len(whole) == 11  # role, 7 content, finish, usage, DONE
    for size in (1, 2, 3, 7, 64, 333):
        assert decode_in_pieces(data, size) == whole
    # CRLF line ends, split between "\r" and "\n" too.
    crlf = data.replace(b"\n", b"\r\n")
    for size in (1, 5, len(crlf)):
        assert decode_in_pieces(crlf, size) == whole


def test_sse_decoder_joins_data_lines_and_skips_comments_and_other_fields():
    dec = SSEDecoder()
    events = dec.feed(b': keep-alive\n\nevent: x\ndata: {"a":\ndata:1}\nid: 3\n\ndata: tail')
    assert events == [b'{"a":\n1}']
    assert dec.pending == b"data: tail"  # an unfinished event is held, not guessed


def test_role_chunk_is_not_content_but_text_tool_calls_and_audio_are():
    events = SSEDecoder().feed((FIXTURES / "vllm_chat_stream.txt").read_bytes())
    chunks = [json.loads(e) for e in events[:-1]]
    assert not has_content(chunks[0])  # {"role": "assistant", "content": ""}
    assert has_content(chunks[1])  # "Hello"
    assert [has_content(c) for c in chunks].count(True) == 7
    assert not has_content(chunks[-1])  # usage chunk, choices: []
    tool = {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}}]}
    assert has_content(tool)
    assert has_content({"choices": [{"delta": {"audio": {"data": "AAA"}}}]})
    assert has_content({"choices": [{"index": 0, "text": "hi"}]})  # /v1/completions
    assert not has_content({"choices": [{"index": 0, "text": ""}]})


def test_error_text_reads_openai_and_flat_error_shapes():
    body = (FIXTURES / "vllm_error_404_model.json").read_bytes()
    assert error_text(404, body) == "404: The model `gpt-4o` does not exist."
    assert error_text(500, b'{"message": "flat"}') == "500: flat"
    assert error_text(502, b"<html>bad gateway</html>") == "502: <html>bad gateway</html>"
    assert error_text(503, b"") == "503: (empty body)"
