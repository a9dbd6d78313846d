"""Micro-benchmark of what a continuable stream pays per SSE event, before and after, in one run.

Run: ``.venv/bin/python -m loadtest.bench_parse`` (about ten seconds). Prints the median of
several repeats in µs per event for a vLLM chat chunk carrying token ids (what an eligible stream
asks for): decoding it with ``json.loads`` against ``sse.decode_json`` (msgspec), nulling its ids
with the regular expression the relay used before against ``continuation.strip_ids``, and the
whole per-event path of ``proxy/relay/resume.py`` (split, parse, note the ids, strip, look for
content) with each decoder, and an ordinary token chunk relayed unparsed against the stream's
learned template (what every token chunk after the first pays now); and a read of 64 token
chunks (a burst, or a reader that fell behind) taken event by event against as one run
(``Splice.take_run``). A plain stream pays none of this after its first content. Then what
a continuable request pays per request over the overhead benchmark's burst (the mocks' 64-token
stream in one read, as vLLM writes it): marking it, its first chunk, its token run and its
finish, beside what the plain relay parses of the same stream. Last, what every request pays
for its access-log line: ``json.dumps`` (before) against ``encode_line``.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from typing import Any

from loadtest.bench_decisions import per_call_us
from loadtest.fake_upstream import MODEL, stream_events
from proxy.config import ContinuationConfig
from proxy.observe.accessline import encode_line
from proxy.relay import continuation as cont
from proxy.relay import sse

CHUNK = (
    b'data: {"id":"chatcmpl-8a1f","object":"chat.completion.chunk","created":1767225600,'
    b'"model":"Qwen/Qwen2.5-0.5B-Instruct","choices":[{"index":0,"delta":{"content":" word"},'
    b'"logprobs":null,"finish_reason":null,"token_ids":[1234]}]}'
)
# A streamed request's access-log record (``accessline.record_of``), encoded per request.
ACCESS_RECORD: dict[str, Any] = {
    "ts": 1767225600.123, "request_id": "3f2a9c1e8b7d4e6fa1b2c3d4", "path": "/v1/chat/completions",
    "api": "chat", "lane": "interactive", "pool": "fast", "replica": "fast-0", "status": 200,
    "stream": True, "model": "Qwen/Qwen2.5-0.5B-Instruct", "prompt_tokens_est": 12,
    "prompt_tokens": 12, "output_tokens": 64, "content_chunks": 64, "queue_wait_ms": 0.01,
    "ttft_ms": 1.23, "duration_ms": 2.34, "retries": 0, "error": None,
    "client_disconnected": None, "error_origin": None, "prefix_match_tokens": None,
    "continuations": None,
}  # fmt: skip


def _old_line(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":"))


# The relay's id stripping before this benchmark was written, kept here as the "before" figure.
_OLD_IDS = re.compile(rb'("(?:prompt_)?token_ids":\s*)\[[0-9,\s]*\]')


def _old_parse(event: bytes) -> Any:
    lines = [ln[5:].lstrip(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")]
    return json.loads(b"\n".join(lines))


def per_event_path(
    parse: Callable[[bytes], Any], strip: Callable[[bytes], bytes], target_s: float
) -> float:
    """µs per event of the continuable relay's work on one event."""
    splice = cont.Splice("chat", {"messages": [], "stream": True}, False)
    splice.observe({"id": "c", "prompt_token_ids": [1, 2], "choices": [{"token_ids": []}]})
    events = sse.EventBuffer()
    data = CHUNK + b"\n\n"

    def one() -> None:
        for ev in events.feed(data):
            obj = parse(ev)
            splice.observe(obj)
            strip(ev)
            sse.carries_content(obj)
        del splice.lists[:]  # keep the list from growing over millions of calls

    return per_call_us(one, target_s)


def per_token_chunk(target_s: float) -> float:
    """µs per event of the unparsed path: an ordinary token chunk of the stream's learned
    template (``Splice.take_token``, as the relay's handler takes each token: its ids noted,
    then nulled)."""
    splice = cont.Splice("chat", {"messages": [], "stream": True}, False)
    splice.learn_template(CHUNK, json.loads(CHUNK[6:]))
    events = sse.EventBuffer()
    data = CHUNK + b"\n\n"

    def one() -> None:
        token = splice.take_token(data, True) if events.empty else None
        assert token is not None
        del splice.lists[:]

    return per_call_us(one, target_s)


def per_event_in_a_read(runs: bool, target_s: float, n: int = 64) -> float:
    """µs per event of a read of ``n`` ordinary token chunks, as ``Resumer.relay``'s loop takes
    them: each with ``take_event``, or the first so and the others as one run."""
    splice = cont.Splice("chat", {"messages": [], "stream": True}, False)
    splice.learn_template(CHUNK, json.loads(CHUNK[6:]))
    read = (CHUNK + b"\n\n") * n

    def one() -> None:
        events = sse.EventBuffer()
        out = []
        for ev in events.feed(read):
            token = splice.take_event(ev, True)
            assert token is not None
            out.append(token[0])
            if runs and (run := splice.take_run(*events.pending(), True)) is not None:
                out.append(run[0])
                events.advance(run[1])
        b"".join(out)
        del splice.lists[:]

    return per_call_us(one, target_s) / n


def per_request_steps(target_s: float) -> list[tuple[str, float]]:
    """µs per request of the continuable relay's steps over one burst, each as the relay's loop
    takes it once a stream of the same model taught the templates (``Shapes``), and of the
    plain relay's parse of the same stream up to its first content."""
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                            "stream": True, "max_tokens": 64}  # fmt: skip
    raw = json.dumps(body).encode()
    events = stream_events(64, token_ids=True)
    role, token, finish = (ev[:-2] for ev in (events[0], events[1], events[-2]))
    shapes = cont.Shapes()
    teacher = cont.Splice("chat", body, False, shapes)  # the first stream: parsed, learned
    for ev, learn in ((role, teacher.learn_role), (token, teacher.learn_template),
                      (finish, teacher.learn_finish)):  # fmt: skip
        obj, _ = teacher.parse(ev)
        teacher.observe(obj)
        learn(ev, obj)
    policy = ContinuationConfig()
    burst = b"".join(events)
    run_at = len(events[0]) + len(events[1])
    taken = cont.Splice("chat", body, False, shapes)
    assert taken.take_role(role, True) is not None, "the first chunk is not taken unparsed"
    assert taken.take_run(burst, run_at, True) is not None, "the tokens are not a run"
    assert taken.take_finish(finish + b"\n\n", True) is not None, "the finish is parsed"

    def mark() -> None:
        cont.refusal_under(policy, True, "chat", body)
        cont.Splice("chat", body, False, shapes)
        cont.forward_body(raw, body)

    def first_chunk() -> None:
        cont.Splice("chat", body, False, shapes).take_role(role, True)

    def token_run() -> None:
        taken.take_run(burst, run_at, True)
        del taken.lists[:]

    plain = b"".join(stream_events(64))

    def plain_parse() -> None:
        buffer = sse.EventBuffer()
        for ev in buffer.feed(plain):
            if sse.carries_content(sse.parse_event(ev)):
                break

    return [
        ("per request, mark (eligibility, Splice, body)", per_call_us(mark, target_s)),
        ("per request, a Splice and its first chunk", per_call_us(first_chunk, target_s)),
        ("per request, 63 token chunks as one run", per_call_us(token_run, target_s)),
        ("per request, the finish (take_finish)",
         per_call_us(lambda: taken.take_finish(finish + b"\n\n", True), target_s)),
        ("per request, plain relay: parse to the content", per_call_us(plain_parse, target_s)),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target-s", type=float, default=0.1, help="seconds per timed batch")
    t = parser.parse_args(argv).target_s
    payload = CHUNK[6:]
    record = ACCESS_RECORD
    assert encode_line(record) == _old_line(record)
    assert cont.strip_ids(CHUNK) == _OLD_IDS.sub(rb"\1null", CHUNK)
    rows = [
        ("decode: json.loads", per_call_us(lambda: json.loads(payload), t)),
        ("decode: sse.decode_json (msgspec)", per_call_us(lambda: sse.decode_json(payload), t)),
        ("strip ids: regex (before)", per_call_us(lambda: _OLD_IDS.sub(rb"\1null", CHUNK), t)),
        ("strip ids: strip_ids (find)", per_call_us(lambda: cont.strip_ids(CHUNK), t)),
        (
            "per event, before (json, regex)",
            per_event_path(_old_parse, lambda ev: _OLD_IDS.sub(rb"\1null", ev), t),
        ),
        ("per event, parsed (msgspec, find)", per_event_path(sse.parse_event, cont.strip_ids, t)),
        ("per event, a token chunk unparsed (template)", per_token_chunk(t)),
        ("per event, 64 in a read, one by one (take_event)", per_event_in_a_read(False, t)),
        ("per event, 64 in a read, as a run (take_run)", per_event_in_a_read(True, t)),
        *per_request_steps(t),
        ("per access line, json.dumps (before)", per_call_us(lambda: _old_line(record), t)),
        ("per access line, encode_line (msgspec)", per_call_us(lambda: encode_line(record), t)),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{'what':<{width}}  µs (median)")
    for name, us in rows:
        print(f"{name:<{width}}  {us:8.2f}")


if __name__ == "__main__":
    main()
