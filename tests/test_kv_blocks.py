"""A replica's block set from its KV events (``proxy.routing.kv_blocks``): pure, table tests."""

from __future__ import annotations

import msgspec
import pytest

from proxy.routing.kv_blocks import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvBlockSet,
    decode_batch,
    token_block_keys,
)

BS = 4
PROMPT = list(range(100, 118))  # 18 tokens: 4 full blocks of 4


def test_keys_are_chained_over_full_blocks_only() -> None:
    keys = token_block_keys(PROMPT, BS)
    assert len(keys) == 4 and len(set(keys)) == 4
    assert token_block_keys(PROMPT[:8], BS) == keys[:2]  # a prefix has the same first keys
    other = token_block_keys([0, *PROMPT[1:]], BS)  # first block differs: every key differs
    assert not set(other) & set(keys)
    assert token_block_keys(PROMPT, BS, max_blocks=2) == keys[:2]
    with pytest.raises(ValueError):
        token_block_keys(PROMPT, 0)


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(hashes, parent, tokens, BS)


def test_stored_blocks_match_a_prompt_by_its_token_ids_whatever_the_engine_hashes() -> None:
    s = KvBlockSet()
    # Engine hashes are arbitrary (random seed per replica): only the token ids key the set.
    s.apply(stored([901, 902], None, PROMPT[:8]))
    s.apply(stored([903], 902, PROMPT[8:12]))  # a later step extends the chain
    keys = token_block_keys(PROMPT, BS)
    assert (s.match(keys, now=0.0), len(s), s.block_size) == (3, 3, BS)
    s.apply(BlockRemoved([903]))
    assert s.match(keys, 0.0) == 2
    s.apply(BlockRemoved([901]))  # the head evicted: nothing matches from the start
    assert s.match(keys, 0.0) == 0
    s.apply(AllBlocksCleared())
    assert len(s) == 0


def test_blocks_whose_parent_was_never_seen_are_not_guessed() -> None:
    s = KvBlockSet()
    s.apply(stored([5, 6], 4, PROMPT[4:12]))  # joined after block 4 was stored
    assert (len(s), s.orphans) == (0, 2)


def test_a_key_held_by_two_engine_blocks_stays_until_both_go() -> None:
    s = KvBlockSet()
    s.apply(stored([1], None, PROMPT[:4]))
    s.apply(stored([2], None, PROMPT[:4]))  # same tokens, another engine hash
    keys = token_block_keys(PROMPT, BS)
    s.apply(BlockRemoved([1]))
    assert s.match(keys, 0.0) == 1
    s.apply(BlockRemoved([2, 77]))  # an unknown hash is ignored
    assert s.match(keys, 0.0) == 0


def test_copies_of_one_hash_are_removed_one_by_one() -> None:
    """Two requests computing the same block at once: one hash, two physical copies, two
    BlockRemoved events (one per copy)."""
    s = KvBlockSet()
    s.apply(stored([1], None, PROMPT[:4]))
    s.apply(stored([1], None, PROMPT[:4]))
    keys = token_block_keys(PROMPT, BS)
    s.apply(BlockRemoved([1]))
    assert s.match(keys, 0.0) == 1
    s.apply(BlockRemoved([1]))
    assert s.match(keys, 0.0) == 0


def test_only_the_gpu_cache_of_the_base_model_counts() -> None:
    s = KvBlockSet()
    s.apply(BlockStored([1], None, PROMPT[:4], BS, None, "CPU"))  # an offload tier
    s.apply(BlockStored([2], None, PROMPT[:4], BS, 3, "GPU"))  # a LoRA adapter's block
    assert len(s) == 0
    s.apply(BlockStored([3], None, PROMPT[:4], BS, None, "GPU"))
    s.apply(BlockRemoved([3], "CPU"))  # the offload tier dropped its copy: the GPU keeps it
    assert len(s) == 1
    with pytest.raises(ValueError):
        s.apply(BlockStored([4], None, PROMPT[:4], 0))


def test_speculative_blocks_count_until_they_expire() -> None:
    s = KvBlockSet()
    keys = token_block_keys(PROMPT, BS)
    s.apply(stored([1], None, PROMPT[:4]))
    s.speculate(keys, now=10.0, ttl_s=2.0)
    assert s.match(keys, 11.0) == 4
    assert s.match(keys, 12.5) == 1  # expired: only what the events said


# Each event in vLLM's two encodings: the map (``type`` tag, vLLM >= 0.26) and the tagged
# positional array with trailing defaults omitted (earlier), inside ``[ts, events, dp_rank]``.
CASES = [
    (
        {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
         "token_ids": PROMPT[:8], "block_size": 4, "lora_id": None, "medium": "GPU"},
        ["BlockStored", [11, 12], None, PROMPT[:8], 4, None, "GPU"],
        BlockStored([11, 12], None, PROMPT[:8], 4, None, "GPU"),
    ),
    (
        {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": b"\x02" * 32,
         "token_ids": PROMPT[:4], "block_size": 4},
        ["BlockStored", [b"\x01" * 32], b"\x02" * 32, PROMPT[:4], 4],
        BlockStored([b"\x01" * 32], b"\x02" * 32, PROMPT[:4], 4),
    ),
    (
        {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"},
        ["BlockRemoved", [11], "GPU"],
        BlockRemoved([11], "GPU"),
    ),
    ({"type": "AllBlocksCleared"}, ["AllBlocksCleared"], AllBlocksCleared()),
]  # fmt: skip


@pytest.mark.parametrize("as_map, as_array, want", CASES)
def test_both_encodings_decode_alike(as_map: dict, as_array: list, want: object) -> None:
    for event in (as_map, as_array):
        payload = msgspec.msgpack.encode([1700000000.5, [event], 0])
        assert decode_batch(msgspec.msgpack.decode(payload)) == [want]


def test_unknown_event_kinds_are_skipped_and_junk_is_an_error() -> None:
    batch = [0.0, [{"type": "SomeConnectorEvent", "x": 1}, ["AllBlocksCleared"]], 0]
    assert decode_batch(batch) == [AllBlocksCleared()]
    for junk in ([], [0.0], [0.0, [42]], "x"):
        with pytest.raises((ValueError, KeyError, TypeError)):
            decode_batch(junk)
