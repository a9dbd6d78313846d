"""Header names and values as HTTP compares them: ASCII case folded.

``bytes.lower`` folds A-Z only, as HTTP's case-insensitive tokens need; compiled by mypyc it is
a method call by name (the method looked up on the type, its call built), some hundreds of
instructions for a header name of a dozen bytes, and a request lowers a few dozen names on its
way through (its own headers, the replica's, the answer's). ``translate`` with a table is the
same mapping and one of mypyc's own operations (``tests/test_bytesearch.py`` holds the two
equal for every byte).
"""

from __future__ import annotations

from typing import Final

# Every byte to itself, A-Z to a-z: ``bytes.lower``'s mapping.
LOWER: Final = bytes.maketrans(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ", b"abcdefghijklmnopqrstuvwxyz")


def lower(value: bytes) -> bytes:
    """``value.lower()``."""
    return value.translate(LOWER)


__all__ = ["LOWER", "lower"]
