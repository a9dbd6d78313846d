"""The load-test runner end to end, over a real socket, against a tiny fake vLLM.

The fake streams the vLLM fixture chunk by chunk: the role-only chunk, then a pause, then
content. TTFT must be measured at the first content chunk, so it is at least that pause.
Special ``max_tokens`` values make it misbehave: 503 answers HTTP 503, 500 streams vLLM's
in-stream error, 499 ends the stream without ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loadtest.prompts import shared_prefix_text
from loadtest.runner import STOPPED_EARLY, LoadTestError, main, parse_trace, run_trace
from loadtest.stats import CONNECT_ERROR, HTTP_ERROR, INCOMPLETE, OK, PENDING, STREAM_ERROR
from tests.servers import free_port, serve_app
from tests.waiting import wait_until

FIXTURES = Path(__file__).parent / "fixtures"
ROLE_WAIT_S = 0.15  # between the role chunk and the first content chunk
TOKEN_GAP_S = 0.005
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


def events(name: str) -> list[str]:
    text = (FIXTURES / name).read_text()
    return [e + "\n\n" for e in text.split("\n\n") if e.strip()]


class FakeVLLM:
    """Streams fixtures like vLLM; records the bodies it got and the peak concurrency."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.peak = 0
        self.stream = events("vllm_chat_stream.txt")
        self.stream_error = events("vllm_chat_stream_error.txt")
        self.plain = (FIXTURES / "vllm_chat_nonstream.json").read_bytes()
        self.models = (FIXTURES / "vllm_models.json").read_bytes()
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/models", self.list_models),
            ]
        )

    async def list_models(self, request: Request) -> Response:
        return Response(self.models, media_type="application/json")

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        max_tokens = body.get("max_tokens")
        if max_tokens == 503:
            err = {"error": {"message": "overloaded", "type": "x", "param": None, "code": 503}}
            return JSONResponse(err, status_code=503)
        if not body.get("stream"):
            await asyncio.sleep(ROLE_WAIT_S)
            return Response(self.plain, media_type="application/json")
        chunks = self.stream_error if max_tokens == 500 else self.stream
        if max_tokens == 499:
            chunks = chunks[:4]

        async def gen():
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            try:
                yield chunks[0]
                await asyncio.sleep(ROLE_WAIT_S)
                for chunk in chunks[1:]:
                    yield chunk
                    await asyncio.sleep(TOKEN_GAP_S)
            finally:
                self.in_flight -= 1

        return StreamingResponse(
            gen(),
            media_type="text/event-stream",
            headers={"x-tokenlane-lane": "short", "x-tokenlane-replica": "fake-0"},
        )


def trace(*rows: dict[str, Any]):
    base = {"at_ms": 0, "class": "light", "prompt_tokens": 64, "prefix_tokens": 16, "max_tokens": 8}
    return parse_trace([{**base, **r} for r in rows])


async def test_run_trace_measures_ttft_at_first_content_and_records_everything():
    fake = FakeVLLM()
    reqs = trace(
        {"at_ms": 0},
        {"at_ms": 30, "ttft_slo_ms": 10_000},
        {"at_ms": 10, "class": "heavy", "stream": False},
        {"at_ms": 20, "class": "broken", "max_tokens": 500},
        {"at_ms": 20, "class": "broken", "max_tokens": 503},
        {"at_ms": 20, "class": "broken", "max_tokens": 499},
    )
    async with serve_app(fake.app) as url:
        results = await run_trace(url, reqs)

    assert [r.index for r in results] == list(range(6))
    light = [r for r in results if r.cls == "light"]
    for r in light:
        assert r.outcome == OK and r.status == 200
        # The role chunk arrives at once; TTFT waits for the content after the pause.
        assert r.ttft_s is not None and r.ttft_s >= ROLE_WAIT_S
        assert r.content_chunks == 7 and len(r.itl_s) == 6
        assert r.usage_completion_tokens == 8 and r.output_tokens == 8
        assert r.e2e_s is not None and r.e2e_s >= r.ttft_s
        assert r.headers == {"x-tokenlane-lane": "short", "x-tokenlane-replica": "fake-0"}
        assert r.start_s >= r.scheduled_s
    assert light[1].ttft_slo_s == 10.0 and light[1].met_slo

    (plain,) = [r for r in results if r.cls == "heavy"]
    assert plain.outcome == OK and plain.ttft_s == plain.e2e_s and plain.ttft_s >= ROLE_WAIT_S
    assert plain.usage_completion_tokens == 30

    by_max = {r.max_tokens: r for r in results if r.cls == "broken"}
    assert by_max[500].outcome == STREAM_ERROR and by_max[500].status == 200
    assert "EngineCore" in (by_max[500].error or "") and by_max[500].content_chunks == 3
    assert by_max[503].outcome == HTTP_ERROR and by_max[503].error == "503: overloaded"
    assert by_max[499].outcome == INCOMPLETE and "[DONE]" in (by_max[499].error or "")

    # What was sent: the server's model, usage asked on streams, one shared prefix.
    assert {b["model"] for b in fake.bodies} == {MODEL}
    streams = [b for b in fake.bodies if b["stream"]]
    assert all(b["stream_options"] == {"include_usage": True} for b in streams)
    prefix = shared_prefix_text(16)
    assert all(b["messages"][0]["content"].startswith(prefix + " ") for b in fake.bodies)
    assert len({b["messages"][0]["content"] for b in fake.bodies}) == 6


async def test_repeated_runs_send_fresh_prompts_unless_seeded():
    fake = FakeVLLM()
    reqs = trace({"max_tokens": 1, "stream": False}, {"at_ms": 1, "max_tokens": 1, "stream": False})

    def prompts(bodies):
        return [b["messages"][0]["content"] for b in bodies]

    async with serve_app(fake.app) as url:
        for seed in (None, None, 7, 7):
            results = await run_trace(url, reqs, model="m", prompt_seed=seed)
            assert [r.model for r in results] == ["m", "m"]
    runs = [prompts(fake.bodies[i : i + 2]) for i in range(0, 8, 2)]
    # A server with prefix caching must not get a repeated run's prompts from its cache.
    assert runs[0] != runs[1]
    assert runs[2] == runs[3]
    prefix = shared_prefix_text(16)
    assert all(p.startswith(prefix + " ") for run in runs for p in run)


async def test_concurrency_limit_caps_requests_in_flight():
    fake = FakeVLLM()
    async with serve_app(fake.app) as url:
        results = await run_trace(url, trace({}, {}, {}), model="m", concurrency_limit=1)
    assert all(r.ok for r in results)
    assert fake.peak == 1
    # Arrivals beyond the limit waited: the third started after two whole streams.
    assert max(r.start_s for r in results) >= 2 * ROLE_WAIT_S


async def test_stop_when_cuts_requests_in_flight_and_leaves_later_ones_unsent():
    fake = FakeVLLM()
    # A slow stream, a quick 503 that ends the run, and an arrival the run never reaches.
    reqs = trace({}, {"at_ms": 5, "max_tokens": 503}, {"at_ms": 5_000})
    async with serve_app(fake.app) as url:
        started = asyncio.get_running_loop().time()
        results = await run_trace(
            url, reqs, model="m", stop_when=lambda rs: rs[1].outcome != PENDING
        )
        elapsed = asyncio.get_running_loop().time() - started
        # the cut stream's connection closes, its generator ends
        await wait_until(lambda: fake.in_flight == 0, what="the fake's streams end")
    assert elapsed < 4.5  # before the third arrival (5 s), wide for a paused VM
    assert results[1].outcome == HTTP_ERROR
    assert results[0].outcome == INCOMPLETE and results[0].error == STOPPED_EARLY
    assert results[2].outcome == PENDING
    assert fake.in_flight == 0


async def test_unreachable_server_is_a_connect_error_per_request():
    url = f"http://127.0.0.1:{free_port()}"
    results = await run_trace(url, trace({}, {"at_ms": 5}), model="m")
    assert [r.outcome for r in results] == [CONNECT_ERROR, CONNECT_ERROR]
    assert all(r.status == 0 and r.error for r in results)


async def test_no_model_and_no_models_endpoint_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(LoadTestError, match="no --model given"):
        await run_trace(url, trace({}))


@contextlib.contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """``serve_app`` on its own loop in a thread, for code that runs its own loop (main)."""
    started = threading.Event()
    state: dict[str, Any] = {}

    async def serve() -> None:
        state["loop"] = asyncio.get_running_loop()
        state["stop"] = asyncio.Event()
        async with serve_app(app) as url:
            state["url"] = url
            started.set()
            await state["stop"].wait()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert started.wait(20), "fake server did not start"
    try:
        yield state["url"]
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(20)


def test_cli_writes_result_json_and_plots(tmp_path, capsys):
    rows = [
        {"at_ms": 0, "class": "heavy", "prompt_tokens": 256, "prefix_tokens": 32, "max_tokens": 8},
        {
            "at_ms": 5,
            "class": "light",
            "prompt_tokens": 64,
            "prefix_tokens": 32,
            "max_tokens": 8,
            "ttft_slo_ms": 60_000,
        },
        {
            "at_ms": 10,
            "class": "light",
            "prompt_tokens": 64,
            "prefix_tokens": 32,
            "max_tokens": 503,
            "ttft_slo_ms": 60_000,
        },
    ]
    trace_file = tmp_path / "t.jsonl"
    trace_file.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    with serve_in_thread(FakeVLLM().app) as url:
        code = main(["--base-url", url, "--trace", str(trace_file), "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr()
    assert "\r[" in printed.err  # the progress line
    table = printed.out.splitlines()
    assert table[0].startswith("class")
    assert [ln.split()[0] for ln in table[1:4]] == ["heavy", "light", "all"]
    assert "status: 200 x2, 503 x1" in printed.out

    doc = json.loads((out / "result.json").read_text())
    assert doc["base_url"] == url and doc["source"] == {"trace": str(trace_file)}
    assert len(doc["requests"]) == 3
    assert doc["summary"]["classes"]["light"]["goodput"] == 0.5
    first = doc["requests"][0]
    assert first["class"] == "heavy" and first["ttft_s"] >= ROLE_WAIT_S
    for png in ("ttft_cdf.png", "ttft_over_time.png"):
        data = (out / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5_000


def test_matplotlib_is_imported_only_when_plotting():
    code = (
        "import sys, loadtest.runner, loadtest.plots; "
        "assert 'matplotlib' not in sys.modules, 'imported early'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def test_cli_bad_trace_exits_1_with_the_problem(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- {at_ms: 0, class: a, prompt_tokens: 10}\n")
    assert main(["--base-url", "http://127.0.0.1:1", "--trace", str(bad), "--no-plots"]) == 1
    assert "[0].max_tokens: required" in capsys.readouterr().err
