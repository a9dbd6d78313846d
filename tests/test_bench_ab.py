"""``loadtest/bench_ab.py`` runs two gateways from source trees side by side and prints a row
for each with its paired differences (the figures are for people; no timing is asserted)."""

from __future__ import annotations

import asyncio
import heapq
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loadtest import bench_ab, procs
from loadtest.bench_overhead import LONG_PROMPT_TOKENS, stream_request
from loadtest.fake_upstream import (
    HIGH_WATER,
    LOW_WATER,
    FakeStats,
    PacedWrites,
    count_prompt_tokens,
    events_for,
    stream_events,
)

ROOT = Path(__file__).resolve().parent.parent


def test_bench_ab_prints_a_row_per_tree(capsys: pytest.CaptureFixture[str]) -> None:
    # The same tree twice is an A/A control: a row for each, told apart by position.
    trees = [str(ROOT), f"{ROOT}:1", f"{ROOT}:1"]
    assert bench_ab.main([a for t in trees for a in ("--tree", t)] + ["--rounds", "2",
                         "--slice-s", "0.3"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("ratios"))
    rows = [line for line in lines[:at] if line.startswith(str(ROOT))]
    assert [row.split(" | ")[0].strip() for row in rows] == [
        str(ROOT),
        f"{ROOT}:1 (2)",
        f"{ROOT}:1 (3)",
    ]
    # The first tree's paired differences are from itself.
    diffs = [cell.split()[1].strip("()") for cell in rows[0].split(" | ")[1:]]
    assert len(diffs) == len(bench_ab.FIGURES["burst"]) and all(float(d) == 0 for d in diffs)
    # Every figure measured: the gateway's CPU, req/s, TTFT, the mocks' and the generator's
    # CPU; its threads' wait for a core may be none at all.
    cells = [float(cell.split()[0]) for cell in rows[1].split(" | ")[1:]]
    keys = [key for _, key, _ in bench_ab.FIGURES["burst"]]
    assert keys[-1] == "wait_per_s" and cells[-1] >= 0, rows[1]
    assert all(figure > 0 for figure in cells[:-1]), rows[1]
    # Each later tree's ratios to the first, round by round, then the middle half of them,
    # then the interval of their median (two rounds: their range, and so headed).
    spread = next(i for i, line in enumerate(lines) if line.startswith("middle half"))
    interval = next(i for i, line in enumerate(lines) if line.startswith("range (under 6"))
    ratios, spans = lines[at + 1 : spread], lines[spread + 1 : interval]
    intervals = lines[interval + 1 :]
    named = [f"{ROOT}:1 (2) / {ROOT}", f"{ROOT}:1 (3) / {ROOT}"]
    assert [row.split(" | ")[0].strip() for row in ratios] == named
    assert [row.split(" | ")[0].strip() for row in spans] == named
    assert [row.split(" | ")[0].strip() for row in intervals] == named
    # (The wait's ratio is nan in a round where the first tree's threads never waited.)
    assert all(float(c.strip().rstrip("x")) > 0 for r in ratios for c in r.split(" | ")[1:-1])
    for table in (spans, intervals):
        for row, ratio_row in zip(table, ratios, strict=True):
            cells = zip(row.split(" | ")[1:-1], ratio_row.split(" | ")[1:-1], strict=True)
            for cell, ratio in cells:
                lo, hi = (float(x) for x in cell.strip().rstrip("x").split("-"))
                assert lo <= float(ratio.strip().rstrip("x")) <= hi, (cell, ratio)


def test_the_middle_half_of_the_rounds_ratios_is_their_quartiles() -> None:
    assert bench_ab.ratio_quartiles([1.0, 2.0, 3.0, 4.0, 5.0], [1.0] * 5) == (2.0, 4.0)
    assert bench_ab.ratio_quartiles([3.0], [2.0]) == (1.5, 1.5)


def test_a_paired_ratio_is_the_median_of_the_rounds_ratios() -> None:
    # Round by round, not the ratio of medians: a slow round slows both of its halves.
    assert bench_ab.paired_ratio([2.0, 10.0, 3.0], [1.0, 10.0, 1.0]) == 2.0


def test_a_tree_named_for_a_peer_runs_that_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[str] = []

    def run(specs: list[bench_ab.Spec], *_: object) -> dict[str, dict[str, list[float]]]:
        started.extend(str(tree) for _, tree, _, _ in specs)
        return {s[0]: {k: [1.0] for _, k, _ in bench_ab.FIGURES["burst"]} for s in specs}

    monkeypatch.setattr(bench_ab, "run", run)
    assert bench_ab.main(["--tree", "vllm-router", "--tree", str(ROOT), "--rounds", "1"]) == 0
    assert started == ["vllm-router", str(ROOT)]  # the peer by name, the tree by its path
    assert set(bench_ab.PEERS) == {"vllm-router", "nginx"}


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


def _shape(event: bytes) -> list[Any]:
    """A chunk's keys in order, its choice's after them, and which ids it carries (null or a list)."""
    obj = json.loads(event[6:])
    choice = obj["choices"][0] if obj["choices"] else {}
    ids = [type(obj.get("prompt_token_ids")).__name__, type(choice.get("token_ids")).__name__]
    return [list(obj), list(choice), ids]


def test_the_mocks_chunks_have_vllms_keys_in_vllms_order() -> None:
    # As vLLM writes them (the fixture): the choice's token ids null on every chunk but the
    # first, the prompt's ids and text null after the first chunk's choices, unless the request
    # asked for return_token_ids; then the same keys carry the lists. The benchmarks relay these
    # bytes, so a gateway that asks for ids relays no more than one that does not, bar the ids.
    fixture = (ROOT / "tests/fixtures/vllm_chat_stream.txt").read_bytes().split(b"\n\n")
    role, content, finish, usage = fixture[0], fixture[1], fixture[-4], fixture[-3]
    plain = stream_events(2, usage=True)
    assert [_shape(e) for e in (plain[0], plain[1], plain[-3], plain[-2])] == [
        _shape(e) for e in (role, content, finish, usage)
    ]
    assert list(json.loads(plain[-2][6:])["usage"]) == list(json.loads(usage[6:])["usage"])
    asked = stream_events(2, token_ids=True)
    lists = [_shape(e)[2] for e in (asked[0], asked[1], asked[-2])]
    assert lists == [["list", "NoneType"], ["NoneType", "list"], ["NoneType", "list"]]
    assert [_shape(e)[:2] for e in (asked[0], asked[1], asked[-2])] == [
        _shape(e)[:2] for e in (role, content, finish)
    ]


def test_the_mock_makes_a_streams_events_once_per_shape() -> None:
    # Made per request, they cost the mock ~0.8 ms each, which the benchmarks would count as
    # the gateway's.
    first = events_for(64, False, 0, True, 10)
    assert first is events_for(64, False, 0, True, 10)
    assert first == stream_events(64, False, 0, token_ids=True, prompt_tokens=10)
    assert events_for(64, False, 0, True, 11) != first
    # Without ids or usage the prompt's length changes nothing: one shape.
    assert events_for(64, False, 0, False, 11) is events_for(64, False, 0, False, 500)


class _Clock:
    """The loop a ``PacedWrites`` schedules on, run by hand: callbacks in time order."""

    def __init__(self) -> None:
        self.t = 0.0
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._n = 0

    def create_future(self) -> asyncio.Future[None]:
        return asyncio.Future(loop=asyncio.new_event_loop())

    def call_soon(self, cb: Callable[[], None]) -> None:
        self.call_later(0.0, cb)

    def call_later(self, delay: float, cb: Callable[[], None]) -> None:
        self._n += 1
        heapq.heappush(self._due, (self.t + delay, self._n, cb))

    def run(self, until: float = float("inf")) -> None:
        while self._due and self._due[0][0] <= until:
            self.t, _, cb = heapq.heappop(self._due)
            cb()


class _Transport:
    """A write transport that records each write and the clock's time; its buffer holds what
    ``buffered`` says."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.writes: list[tuple[float, bytes]] = []
        self.buffered = 0
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes.append((self.clock.t, data))

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return self.closing


EVENTS = [b"data: %d\n\n" % i for i in range(6)] + [b"data: [DONE]\n\n"]


def test_the_mocks_paced_writes_are_the_coroutines_writes_at_the_same_pauses() -> None:
    """``PacedWrites`` (the mock's paced streams without a fault) writes one HTTP chunk per
    event as ``_paced`` does: the role and first chunks at once, a pause before each later one
    but the last, then the body's end."""
    clock = _Clock()
    t = _Transport(clock)
    stats = FakeStats()
    paced = PacedWrites(t, EVENTS, 0.05, stats, loop=clock)  # type: ignore[arg-type]
    clock.run()
    assert [data for _, data in t.writes] == [b"%x\r\n%b\r\n" % (len(e), e) for e in EVENTS] + [
        b"0\r\n\r\n"
    ]
    assert [round(at, 3) for at, _ in t.writes] == [0, 0, 0.05, 0.1, 0.15, 0.2, 0.2, 0.2]
    assert paced.done.result() is None
    assert stats.bytes_written == sum(map(len, EVENTS)) and stats.drain_waits == 0


def test_the_mocks_paced_writes_wait_for_a_full_buffer_and_end_when_the_reader_is_gone() -> None:
    """A write that leaves the buffer full holds the next back until it drains to the low
    mark, as ``drain()`` did; a reader found gone after a write, or before the next, ends the
    stream as a reset and nothing more is written."""
    clock = _Clock()
    held = _Transport(clock)
    held.buffered = HIGH_WATER + 1  # a reader that does not read
    stats = FakeStats()
    paced = PacedWrites(held, EVENTS, 0.01, stats, loop=clock)  # type: ignore[arg-type]
    clock.run(until=1.0)
    assert stats.drain_waits == 1 and len(held.writes) == 1  # a second, still held back
    held.buffered = LOW_WATER
    clock.run()
    assert len(held.writes) == len(EVENTS) + 1 and paced.done.result() is None
    assert held.writes[1][0] >= 1.0  # written once the buffer drained

    # Gone: at once (the role chunk written), after the third write, and while a full buffer
    # holds the fourth back.
    for run_until, full, written in ((None, False, 1), (0.01, False, 3), (0.02, True, 4)):
        clock = _Clock()
        gone = _Transport(clock)
        paced = PacedWrites(gone, EVENTS, 0.01, FakeStats(), loop=clock)  # type: ignore[arg-type]
        if run_until is not None:
            clock.run(until=run_until - 0.001)
            gone.buffered = HIGH_WATER + 1 if full else 0
            clock.run(until=run_until + 0.005)
        gone.closing = True
        clock.run()
        assert isinstance(paced.done.exception(), ConnectionResetError)
        assert len(gone.writes) == written


@pytest.mark.parametrize(
    ("dump", "total"),
    [
        # As callgrind writes a dump: the summary in the header, the totals as its last line.
        ("version: 1\nevents: Ir\nsummary: 123456\n\nfl=(1)\n0 5\n\ntotals: 123456\n", 123456),
        ("events: Ir Bc\nsummary: 987 65\n\nfl=(1)\n0 5 1\n\ntotals: 987 65\n", 987),
        ("version: 1\nevents: Ir\nsummary: 123456\n\nfl=(1)\n0 5\n", None),  # being written
        ("events: Ir\nsummary: 0\n\ntotals: 0\n", 0),
        ("", None),
    ],
)
def test_callgrind_total_reads_a_dumps_count(dump: str, total: int | None) -> None:
    assert bench_ab.callgrind_total(dump) == total


def test_a_rounds_count_is_the_dump_after_its_opening_dump() -> None:
    # Callgrind numbers a run's dumps 1, 2, ...: each round opens with one (the counters
    # reset) and ends with the one it reads.
    assert [bench_ab.round_dumps(r) for r in range(3)] == [(1, 2), (3, 4), (5, 6)]


@pytest.mark.parametrize("mode", ["instructions", "paced-instructions"])
@pytest.mark.parametrize(
    ("argv", "refusal"),
    [
        (["--tree", f"{ROOT}:2"], "one worker a tree"),
        (["--tree", str(ROOT), "--requests", "0"], "--requests must be at least 1"),
        (["--tree", str(ROOT), "--keep", str(ROOT)], "not empty"),
        (["--tree", "vllm-router", "--tree", str(ROOT)], "not a peer"),
    ],
)
def test_bench_ab_refuses_what_it_cannot_count(
    mode: str,
    argv: list[str],
    refusal: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def never(*_: object) -> None:
        raise AssertionError("gateways started")

    monkeypatch.setattr(bench_ab, "run_counted", never)
    monkeypatch.setattr(bench_ab.shutil, "which", lambda name: f"/usr/bin/{name}")
    with pytest.raises(SystemExit) as refused:
        bench_ab.main(["--mode", mode, *argv])
    assert refused.value.code == 2
    assert refusal in capsys.readouterr().err


def test_bench_ab_keeps_dumps_only_of_a_counted_mode(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as refused:
        bench_ab.main(["--mode", "burst", "--tree", str(ROOT), "--keep", str(tmp_path)])
    assert refused.value.code == 2
    assert "--keep applies to the counted modes" in capsys.readouterr().err


def test_a_peer_takes_no_workers_or_continuation(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        bench_ab.main(["--tree", "vllm-router:2", "--tree", str(ROOT)])
    assert refused.value.code == 2
    assert "a peer runs as it is" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("n", "low", "high"),
    [
        # The order statistics (1-based) of the 95 % interval of a median, as tables of it
        # give them: 6 values, the least and the greatest; 10, the 2nd and 9th; 24, the 7th
        # and 18th; 100, the 40th and 61st.
        (6, 1, 6),
        (10, 2, 9),
        (24, 7, 18),
        (60, 22, 39),
        (100, 40, 61),
        # Fewer than six cannot reach 95 %: their least and greatest, one value itself.
        (5, 1, 5),
        (2, 1, 2),
        (1, 1, 1),
    ],
)
def test_the_median_interval_is_the_order_statistics_tables_give(
    n: int, low: int, high: int
) -> None:
    values = [float(v) for v in range(n, 0, -1)]  # unsorted: n down to 1
    assert bench_ab.median_interval(values) == (float(low), float(high))


def test_the_median_interval_leaves_out_rounds_without_a_ratio() -> None:
    nan = float("nan")
    assert bench_ab.median_interval([nan, 3.0, nan, 1.0, 2.0, 5.0, 4.0, 6.0]) == (1.0, 6.0)
    lo, hi = bench_ab.median_interval([nan])
    assert lo != lo and hi != hi  # nan: no round had one


@pytest.mark.parametrize(
    ("cpuinfo", "model"),
    [
        # x86: a block a core; the first block's name and numbers ("model" is the number).
        ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 167\n"
         "model name\t: Intel(R) Xeon(R) Processor\nstepping\t: 1\n\nprocessor\t: 1\n"
         "model name\t: Another\n",
         "Intel(R) Xeon(R) Processor (family 6, model 167, stepping 1)"),
        # Runs of spaces inside the name are one (as some AMD parts pad it); no numbers, none said.
        ("model name\t: AMD EPYC 7B13   64-Core Processor  \n", "AMD EPYC 7B13 64-Core Processor"),
        # A value is read from the key's first colon on: a colon inside it is kept.
        ("model\t\t: 85\nmodel name\t: Xeon: Gold 6148\n", "Xeon: Gold 6148 (model 85)"),
        # arm64 names no model: its implementer and part tell the core (0xd0c: Neoverse N1).
        ("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n",
         "ARM (implementer 0x41, part 0xd0c)"),
        # A virtual machine's "unknown" is said as nothing.
        ("model name\t: Common KVM processor\ncpu family\t: 15\nstepping\t: unknown\n",
         "Common KVM processor (family 15)"),
        # No name and no part, or an empty name: unknown.
        ("processor\t: 0\nBogoMIPS\t: 50.00\n", "unknown"),
        ("model name\t:   \ncpu family\t: 6\n", "unknown"),
        ("", "unknown"),
    ],
)  # fmt: skip
def test_the_machine_line_names_the_processor(cpuinfo: str, model: str) -> None:
    assert procs.cpu_model(cpuinfo) == model


def test_the_machine_line_says_cores_and_kernel() -> None:
    line = procs.machine()
    name, cores, kernel = line.rsplit(", ", 2)
    assert name and cores == f"{len(os.sched_getaffinity(0))} cores", line
    assert kernel == f"Linux {os.uname().release}", line
