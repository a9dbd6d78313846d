"""The TTFT split's pure parts: perf's lines paired into calls, and calls into segments."""

from __future__ import annotations

import pytest

from loadtest.bench_segments import Syscall, parse_calls, segments

REQ = 236  # the client's request, read in one read


def enter(tid: int, t: float, nr: int, fd: int) -> str:
    return f"  {tid} {t:.6f}: raw_syscalls:sys_enter: NR {nr} ({fd:x}, 7ffe, 400, 0, 0, 8)"


def leave(tid: int, t: float, nr: int, ret: int) -> str:
    return f"  {tid} {t:.6f}:  raw_syscalls:sys_exit: NR {nr} = {ret}"


def test_calls_are_paired_per_thread_and_ordered_by_entry() -> None:
    lines = [
        enter(2, 1.000010, 45, 12),
        enter(1, 1.000020, 20, 14),  # another thread's call inside the first
        leave(1, 1.000030, 20, 458),
        leave(2, 1.000040, 45, REQ),
        "not a perf line",
    ]
    assert parse_calls(lines) == [
        Syscall(1.000010, 1.000040, 45, 12, REQ),
        Syscall(1.000020, 1.000030, 20, 14, 458),
    ]


def test_a_call_cut_by_the_recording_is_left_out() -> None:
    lines = [
        leave(1, 1.0, 0, 100),  # entered before the recording
        enter(1, 1.1, 232, 3),
        leave(1, 1.2, 232, 1),
        enter(1, 1.3, 0, 5),  # never returned within it
    ]
    assert [c.nr for c in parse_calls(lines)] == [232]


def test_an_error_return_is_kept_negative() -> None:
    calls = parse_calls([enter(1, 1.0, 0, 7), leave(1, 1.1, 0, -11)])
    assert calls == [Syscall(1.0, 1.1, 0, 7, -11)]


def call(entered: float, nr: int, fd: int, ret: int, took: float = 1e-6) -> Syscall:
    return Syscall(entered, entered + took, nr, fd, ret)


def shifted(calls: list[Syscall], by: float) -> list[Syscall]:
    return [Syscall(c.entered + by, c.returned + by, c.nr, c.fd, c.ret) for c in calls]


# One request through a single-threaded gateway: read (client fd 18), writev upstream (fd 21),
# read the answer, writev to the client.
ONE_LOOP = [
    call(0.000100, 0, 18, REQ),
    call(0.000150, 39, -1, 4242),  # getpid: not a socket call
    call(0.000281, 20, 21, 458),
    call(0.000300, 281, 3, 1),  # epoll
    call(0.000500, 0, 21, 14049),
    call(0.000579, 20, 18, 14200),
]
# The same through threads that wake each other: an 8-byte eventfd write between, the answer
# read with recvfrom, written in three writevs (the first counts).
THREADS = [
    call(0.000100, 45, 12, REQ),
    call(0.000150, 1, 4, 8),
    call(0.000203, 20, 14, 309),
    call(0.000400, 45, 14, 14049),
    call(0.000460, 1, 4, 8),
    call(0.000464, 20, 12, 17),
    call(0.000470, 20, 12, 13949),
]


@pytest.mark.parametrize(
    ("calls", "ingress_us", "egress_us"),
    [
        (ONE_LOOP, [180], [78]),
        (THREADS, [102], [63]),
        (ONE_LOOP + shifted(ONE_LOOP, 0.001), [180, 180], [78, 78]),
        # the recording began after the client's read: nothing until the next request
        (ONE_LOOP[1:], [], []),
        # it ended before the answer came: the request is left out
        (ONE_LOOP[:4], [], []),
        # an answer read on a connection the request was not written to is not its answer
        ([*ONE_LOOP[:4], call(0.0005, 0, 30, 14049), ONE_LOOP[5]], [], []),
        # an access-log line flushed to stdout before the write upstream is not that write
        ([ONE_LOOP[0], call(0.000120, 1, 1, 400), *ONE_LOOP[1:]], [180], [78]),
    ],
)
def test_segments(calls: list[Syscall], ingress_us: list[int], egress_us: list[int]) -> None:
    split = segments(calls, REQ)
    assert [round(s * 1e6) for s in split["ingress"]] == ingress_us
    assert [round(s * 1e6) for s in split["egress"]] == egress_us
