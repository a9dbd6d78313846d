"""``loadtest.profile_perf --stacks``: a ``perf script`` text read into stacks, and each
compiled function's inclusive share of them (the benchmark itself needs ``perf`` and prints
figures; these are its pure parts)."""

from __future__ import annotations

from loadtest.profile_perf import inclusive_shares, stack_samples

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
