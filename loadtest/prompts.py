"""Prompts of a chosen length that share a chosen prefix, so a trace's numbers mean something.

A trace says ``prompt_tokens: 2048, prefix_tokens: 32``; the server must then see about 2048
prompt tokens of which the first 32 are the same in every request, so prefix caching (and the
gateway's prefix affinity) have something real to hit. Tokenizers differ (the simulator has
its own, real models have BPE), so the prompt is made of short, common English words: each is
one token in any English tokenizer worth the name, and with the space the text averages about
four characters per token, which is also what a characters/4 estimator assumes. The counts
are therefore approximate, within a few percent, not exact; the chat template adds its own
handful of tokens on top.

Deterministic: the same (prompt_tokens, prefix_tokens, seed, prefix_seed) always gives the
same text. The prefix depends only on ``prefix_seed`` (shared by a whole trace), the rest on
``seed`` (one per request). Past the prefix, two prompts share nothing but chance: matching
the next 16 words (one KV block) by chance has odds of one in 10^32.
"""

from __future__ import annotations

import random

# Common words of 2-4 letters; each is a single token in BPE vocabularies and in word-level
# tokenizers alike. Mostly 2-3 letters so that, with the space, the text averages close to
# four characters per token (the tests hold it to 3.5-4.5).
WORDS: tuple[str, ...] = tuple(
    """
    all an and any are as ask at be big boy but by can car cut day did do dog eat end eye far
    few for get go got had has he her him his how if in is it its let man may me men my new no
    not now of oil old on one or our out put red run saw say sea see set she so sun the to too
    try two up us use was way we who why you that with they this have from word what were when
    your said each will many then them some make like into time look more than been call find
    long down
    """.split()
)

DEFAULT_PREFIX_SEED = 37308


def words(n: int, rng: random.Random) -> list[str]:
    return rng.choices(WORDS, k=n)


def build_prompt(
    prompt_tokens: int,
    prefix_tokens: int = 0,
    *,
    seed: int | str = 0,
    prefix_seed: int = DEFAULT_PREFIX_SEED,
) -> str:
    """A prompt of about ``prompt_tokens`` tokens whose first ``prefix_tokens`` are shared.

    The shared part is the same for every call with the same ``prefix_seed``; the rest is
    drawn from ``seed``.
    """
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be at least 1, got {prompt_tokens}")
    if not 0 <= prefix_tokens <= prompt_tokens:
        raise ValueError(
            f"prefix_tokens must be between 0 and prompt_tokens ({prompt_tokens}), "
            f"got {prefix_tokens}"
        )
    prefix = words(prefix_tokens, random.Random(prefix_seed))
    rest = words(prompt_tokens - prefix_tokens, random.Random(seed))
    return " ".join(prefix + rest)


def shared_prefix_text(prefix_tokens: int, prefix_seed: int = DEFAULT_PREFIX_SEED) -> str:
    """The text every prompt of a trace begins with (for tests and reports)."""
    return " ".join(words(prefix_tokens, random.Random(prefix_seed)))
