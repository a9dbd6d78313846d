"""``loadtest/bench_ab.py`` runs two gateways from source trees side by side and prints a row
for each with its paired differences (the figures are for people; no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import bench_ab
from loadtest.bench_overhead import LONG_PROMPT_TOKENS, stream_request
from loadtest.fake_upstream import count_prompt_tokens, events_for, stream_events

ROOT = Path(__file__).resolve().parent.parent


def test_bench_ab_prints_a_row_per_tree(capsys: pytest.CaptureFixture[str]) -> None:
    # The same tree twice is an A/A control: a row for each, told apart by position.
    trees = [str(ROOT), f"{ROOT}:1", f"{ROOT}:1"]
    assert bench_ab.main([a for t in trees for a in ("--tree", t)] + ["--rounds", "2",
                         "--slice-s", "0.3"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith(str(ROOT))]
    assert [row.split(" | ")[0].strip() for row in rows] == [
        str(ROOT),
        f"{ROOT}:1 (2)",
        f"{ROOT}:1 (3)",
    ]
    # The first tree's paired differences are from itself.
    assert rows[0].count("(+0.000)") == 1 and rows[0].count("(+0)") == 1
    cells = [float(cell.split()[0]) for cell in rows[1].split(" | ")[1:]]
    assert len(cells) == 3 and all(figure > 0 for figure in cells), rows[1]


def test_the_long_prompt_run_sends_a_prompt_whose_ids_the_mock_sends_back() -> None:
    raw = stream_request(1, LONG_PROMPT_TOKENS)
    body = json.loads(raw.split(b"\r\n\r\n", 1)[1])
    assert count_prompt_tokens(body) == LONG_PROMPT_TOKENS
    assert count_prompt_tokens(json.loads(stream_request(1).split(b"\r\n\r\n", 1)[1])) == 10
    assert count_prompt_tokens({"prompt": "x" * 400}) == 100
    role = stream_events(2, token_ids=True, prompt_tokens=LONG_PROMPT_TOKENS)[0]
    ids = json.loads(role[6:])["prompt_token_ids"]
    assert len(ids) == LONG_PROMPT_TOKENS and all(100_000 <= i < 150_000 for i in ids)
    assert len(role) > 14_000  # as long as vLLM's for such a prompt (6-digit ids)
    usage = stream_events(2, usage=True, prompt_tokens=300)[-2]
    assert json.loads(usage[6:])["usage"]["prompt_tokens"] == 300


def test_the_mock_makes_a_streams_events_once_per_shape() -> None:
    # Made per request, they cost the mock ~0.8 ms each, which the benchmarks would count as
    # the gateway's.
    first = events_for(64, False, 0, True, 10)
    assert first is events_for(64, False, 0, True, 10)
    assert first == stream_events(64, False, 0, token_ids=True, prompt_tokens=10)
    assert events_for(64, False, 0, True, 11) != first
    # Without ids or usage the prompt's length changes nothing: one shape.
    assert events_for(64, False, 0, False, 11) is events_for(64, False, 0, False, 500)


class _Transport:
    """A write transport that records each write; its buffer is what ``buffered`` says."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.buffered = 0
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return self.closing


async def test_the_mocks_paced_writes_are_the_coroutines_writes_at_the_same_pauses() -> None:
    """``PacedWrites`` (the mock's paced streams without a fault) writes one HTTP chunk per
    event, the role and first chunks at once, a pause before each later one but the last, then
    the body's end; a full buffer holds the next write back until it drains, as ``drain()``
    did; a reader gone ends the stream as a reset."""
    import asyncio

    from loadtest.fake_upstream import LOW_WATER, FakeStats, PacedWrites

    events = [b"data: %d\n\n" % i for i in range(6)] + [b"data: [DONE]\n\n"]
    loop = asyncio.get_running_loop()
    t = _Transport()
    stats = FakeStats()
    start = loop.time()
    paced = PacedWrites(t, events, 0.02, stats)  # type: ignore[arg-type]
    await paced.done
    assert t.writes == [b"%x\r\n%b\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"]
    # Pauses before events 2, 3, 4 and 5: four intervals at least.
    assert loop.time() - start >= 4 * 0.02 * 0.9  # (a timer may fire a clock tick early)
    assert stats.bytes_written == sum(map(len, events)) and stats.drain_waits == 0

    held = _Transport()
    held.buffered = 70_000  # a reader that does not read
    paced = PacedWrites(held, events, 0.001, stats)  # type: ignore[arg-type]
    assert stats.drain_waits == 1 and len(held.writes) == 1
    await asyncio.sleep(0.02)
    assert len(held.writes) == 1  # held back while the buffer stays full
    held.buffered = LOW_WATER
    await paced.done
    assert len(held.writes) == len(events) + 1

    gone = _Transport()
    paced = PacedWrites(gone, events, 0.001, FakeStats())  # type: ignore[arg-type]
    gone.closing = True
    with pytest.raises(ConnectionResetError):
        await paced.done
    assert len(gone.writes) == 1  # the role chunk went before it left
