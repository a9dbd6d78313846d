"""``loadtest.profile_perf --stacks``: a ``perf script`` text read into stacks, and each
compiled function's inclusive share of them; ``--syscalls``: ``perf trace -s``'s summary read
into calls by name (the benchmark itself needs ``perf`` and prints
figures; these are its pure parts)."""

from __future__ import annotations

import pytest

from loadtest.profile_perf import inclusive_shares, main, stack_samples, trace_counts

SCRIPT = """\
1234
\t  aa memcpy
\t  bb CPyDef_relay___run_Relay_gen_____mypyc_generator_helper__
\t  cc CPyDef_endpoint___call (inlined)

1234
\t  dd CPyDef_relay___run_Relay_gen_____mypyc_generator_helper__
\t  ee CPyDef_relay___run_Relay_gen_____mypyc_generator_helper__
\t  ff CPyDef_endpoint___call

1234
\t  11 _raw_spin_unlock
\t  12 CPyDef_call___Call_clear

1234
\t  13 epoll_wait
"""


def test_a_perf_script_reads_as_stacks_leaf_first() -> None:
    samples = stack_samples(SCRIPT)
    assert len(samples) == 4
    assert samples[0] == [
        "memcpy",
        "CPyDef_relay___run_Relay_gen_____mypyc_generator_helper__",
        "CPyDef_endpoint___call",  # an inlined frame by its own name
    ]
    assert samples[3] == ["epoll_wait"]
    assert stack_samples("") == []


def test_a_function_counts_once_a_sample_whatever_it_called_and_clears_are_left_out() -> None:
    shares = inclusive_shares(stack_samples(SCRIPT))
    # Recursion (two frames of one function) counts once; a dealloc's _clear is no function
    # of the request path's; samples without a compiled frame still count in the whole.
    assert shares == [(50.0, "endpoint___call"), (50.0, "relay___run_Relay")]
    assert inclusive_shares([]) == []


# ``perf trace -s``'s summary as perf 6.1 prints it: a table per thread.
SUMMARY = """\

 Summary of events:

 python (4242), 40128 events, 61.0%

   syscall            calls  errors  total       min       avg       max       stddev
                                     (msec)    (msec)    (msec)    (msec)        (%)
   --------------- --------  ------ -------- --------- --------- ---------     ------
   writev              8040      0   412.113     0.006     0.051     2.018      0.62%
   read                8031     12    61.350     0.002     0.008     0.190      0.55%
   epoll_pwait          211      0   803.224     0.001     3.807    40.117      9.10%

 tokio-runtime-w (4250), 2000 events, 3.0%

   syscall            calls  errors  total       min       avg       max       stddev
                                     (msec)    (msec)    (msec)    (msec)        (%)
   --------------- --------  ------ -------- --------- --------- ---------     ------
   writev               600      0    30.000     0.006     0.050     1.000      1.00%
   futex                400    100     9.000     0.001     0.022     0.500      2.00%
"""


def test_a_trace_summary_reads_as_calls_by_name_summed_over_threads() -> None:
    counts = trace_counts(SUMMARY)
    assert counts == {"writev": 8640, "read": 8031, "epoll_pwait": 211, "futex": 400}
    # Headings, the units row, rules and thread lines are no rows.
    assert trace_counts("   syscall   calls  errors  total\n   ----- ---\n") == {}


@pytest.mark.parametrize("argv", [["--workers", "2"], ["--continuation", "off"]])
def test_the_peer_runs_as_it_is(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["--gateway", "vllm-router", *argv])
    assert refused.value.code == 2
    assert "a peer runs as it is" in capsys.readouterr().err
