"""Prompts of a given length sharing a given prefix, for traces' token counts to mean something."""

from __future__ import annotations

import pytest

from loadtest.prompts import build_prompt, shared_prefix_text


def test_shared_prefix_is_identical_across_requests_and_the_rest_differs():
    prompts = [build_prompt(300, 32, seed=s) for s in range(5)]
    prefix = shared_prefix_text(32)
    assert all(p.startswith(prefix + " ") for p in prompts)
    tails = {p[len(prefix) :] for p in prompts}
    assert len(tails) == 5
    # Nothing beyond the prefix is shared: the first word after it already differs.
    assert len({" ".join(p.split()[32:34]) for p in prompts}) == 5


def test_prompt_length_is_close_to_the_asked_tokens():
    for n in (8, 128, 2048):
        p = build_prompt(n, min(32, n), seed=3)
        assert len(p.split()) == n  # one short common word per token
        # ~4 characters per token, as an English tokenizer (and a chars/4 estimate) sees it.
        assert 3.5 <= len(p) / n <= 4.6


def test_prompt_is_deterministic_by_seed():
    assert build_prompt(100, 10, seed=1) == build_prompt(100, 10, seed=1)
    assert build_prompt(100, 10, seed=1) != build_prompt(100, 10, seed=2)
    assert build_prompt(100, 10, seed=1, prefix_seed=5)[:20] != build_prompt(100, 10, seed=1)[:20]


def test_prompt_without_prefix_and_whole_prompt_prefix():
    assert build_prompt(50, 0, seed=1) != build_prompt(50, 0, seed=2)
    assert build_prompt(40, 40, seed=1) == build_prompt(40, 40, seed=2) == shared_prefix_text(40)


def test_impossible_lengths_are_refused():
    with pytest.raises(ValueError, match="prompt_tokens"):
        build_prompt(0)
    with pytest.raises(ValueError, match="prefix_tokens"):
        build_prompt(10, 11)
