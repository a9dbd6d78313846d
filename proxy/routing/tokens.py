"""Exact prompt token counts from a Hugging Face ``tokenizer.json`` (``estimate.tokenizer_file``).

Without one, prompt tokens are estimated from characters (``estimate.Estimator``). With one, the
text of a request is tokenized as the replica's model will tokenize it: the chat template's
framing, images and audio are still estimated, but the text, which is most of a long prompt, is
counted exactly. The tokenizer is the ``tokenizers`` library (Rust), the one vLLM's own
tokenizers are built on: about a microsecond per token, paid on every request that has text.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from proxy.errors import TokenizerError


class TokenCounter:
    """Counts the tokens of texts, without special tokens (the template adds those)."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError(
                "exact token counts need the tokenizers library: pip install 'tokenlane[tokenizer]'"
            ) from None
        try:
            self._tokenizer: Any = Tokenizer.from_file(path)
        except Exception as exc:  # the library raises plain Exceptions for bad files
            raise TokenizerError(f"cannot load {path}: {exc}") from None
        self.path = path

    def count(self, texts: Sequence[str]) -> int:
        encode = self._tokenizer.encode
        return sum(len(encode(text, add_special_tokens=False).ids) for text in texts if text)


@functools.lru_cache(maxsize=8)
def load_counter(path: str) -> TokenCounter:
    """One counter per file: validating a policy and serving it load the file once."""
    return TokenCounter(path)


__all__ = ["TokenCounter", "TokenizerError", "load_counter"]
