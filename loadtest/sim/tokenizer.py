"""The simulator's own tokenizer and chat template.

Deliberately not "characters / 4": the gateway estimates prompt sizes from characters and learns
its ratio from the ``usage`` replicas report, so the simulator must count tokens by a different
rule for that learning to be tested. The rule imitates a byte-level BPE at the level that matters
for cost: text is split GPT-2-style into words (with their leading space), digits, punctuation
runs and whitespace runs; a short word is one token, a long word is cut into pieces, a digit is
one token (as Qwen2.5 does). Plain English prose comes out near 4.3 characters per token,
technical Markdown near 3.2.

Ids are stable across processes (crc32 of the piece, folded into Qwen2.5's regular ids above
the 256 byte tokens), so the prefix cache sees the same blocks for the same text in every
replica. A character outside the Basic Multilingual Plane (an emoji) has no token of its own: it
is one byte token per UTF-8 byte (ids 0-255, as a byte-level BPE's fallback), so one character
spans several ids and a decoder emits no text until its last byte arrives.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

VOCAB_SIZE = 151_643  # Qwen2.5's regular (non-special) vocabulary
# Qwen2.5's special tokens, with their real ids.
SPECIAL_TOKENS = {"<|endoftext|>": 151_643, "<|im_start|>": 151_644, "<|im_end|>": 151_645}
SPECIAL_IDS = {v: k for k, v in SPECIAL_TOKENS.items()}
EOS_ID = SPECIAL_TOKENS["<|im_end|>"]
# Qwen2.5-Instruct's template inserts this system prompt when the conversation has none.
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# A non-text content part (an image) costs a fixed number of placeholder tokens.
MEDIA_PART_TOKENS = 576
MEDIA_PLACEHOLDER_ID = 151_655  # Qwen's <|image_pad|>

# A word up to this many characters (leading space included) is one token; a longer one is
# cut into pieces of LONG_PIECE characters. Non-Latin letters are far denser in real
# vocabularies, so they get short pieces.
WHOLE_WORD_MAX = 7
LONG_PIECE = 5
NON_ASCII_PIECE = 2

_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
_PIECE_RE = re.compile(
    r"'(?:s|t|re|ve|m|ll|d)(?![^\W\d_])"  # English contractions
    r"| ?[^\W\d_]+"  # a word with its leading space
    r"|\d"  # one digit
    r"| ?(?:[^\s\w]|_)+"  # a punctuation run with its leading space
    r"|\s*[\r\n]+"  # a run of newlines (with the spaces before it)
    r"|\s+(?!\S)|\s+"  # other whitespace; the last space stays with the next word
)


@lru_cache(maxsize=1 << 16)
def _piece_ids(piece: str) -> tuple[int, ...]:
    if len(piece) == 1 and ord(piece) >= ASTRAL:
        return tuple(piece.encode("utf-8"))
    if not piece.isascii() and _ASTRAL_RE.search(piece):
        return tuple(i for part in _split_astral(piece) for i in _piece_ids(part))
    if len(piece) <= WHOLE_WORD_MAX and (piece.isascii() or len(piece) <= NON_ASCII_PIECE):
        return (_id(piece),)
    size = LONG_PIECE if piece.isascii() else NON_ASCII_PIECE
    # The first piece keeps the leading space, as BPE merges do.
    return tuple(_id(piece[i : i + size]) for i in range(0, len(piece), size))


@lru_cache(maxsize=1 << 16)
def _piece_texts(piece: str) -> tuple[str, ...]:
    if len(piece) == 1 and ord(piece) >= ASTRAL:
        return ("",) * (len(piece.encode("utf-8")) - 1) + (piece,)
    if not piece.isascii() and _ASTRAL_RE.search(piece):
        return tuple(t for part in _split_astral(piece) for t in _piece_texts(part))
    if len(piece) <= WHOLE_WORD_MAX and (piece.isascii() or len(piece) <= NON_ASCII_PIECE):
        return (piece,)
    size = LONG_PIECE if piece.isascii() else NON_ASCII_PIECE
    return tuple(piece[i : i + size] for i in range(0, len(piece), size))


ASTRAL = 0x10000  # characters from here on are byte tokens
NUM_BYTE_IDS = 256
_ASTRAL_RE = re.compile("[\U00010000-\U0010ffff]")


def _split_astral(piece: str) -> list[str]:
    """``piece`` cut so that each astral character stands alone (it becomes byte tokens)."""
    if len(piece) == 1:
        return [piece]
    parts: list[str] = []
    start = 0
    for m in _ASTRAL_RE.finditer(piece):
        if m.start() > start:
            parts.append(piece[start : m.start()])
        parts.append(m.group())
        start = m.end()
    if start < len(piece):
        parts.append(piece[start:])
    return parts


_ID_TEXT: dict[int, str] = {}  # reverse map for /detokenize, filled as ids are minted
_ID_TEXT_MAX = 500_000


def _id(text: str) -> int:
    # Byte tokens own ids 0-255; every other piece lands above them.
    span = VOCAB_SIZE - NUM_BYTE_IDS
    token_id = NUM_BYTE_IDS + zlib.crc32(text.encode("utf-8")) % span
    if len(_ID_TEXT) < _ID_TEXT_MAX:
        _ID_TEXT.setdefault(token_id, text)
    return token_id


def encode(text: str, *, special: bool = True) -> list[int]:
    """Token ids of ``text``; with ``special``, Qwen's control tokens are single tokens."""
    ids: list[int] = []
    parts = _SPECIAL_RE.split(text) if special and "<|" in text else [text]
    for part in parts:
        if not part:
            continue
        special_id = SPECIAL_TOKENS.get(part) if special else None
        if special_id is not None:
            ids.append(special_id)
            continue
        for piece in _PIECE_RE.findall(part):
            ids.extend(_piece_ids(piece))
    return ids


def pieces(text: str) -> list[str]:
    """The text of each token of ``text`` (no special tokens); ``"".join`` gives ``text`` back."""
    out: list[str] = []
    for piece in _PIECE_RE.findall(text):
        out.extend(_piece_texts(piece))
    return out


def count(text: str) -> int:
    return len(encode(text))


def decode(ids: Iterable[int], *, skip_special: bool = True) -> str:
    """Best-effort inverse of :func:`encode` for ids this process has minted."""
    out: list[str] = []
    pending = bytearray()  # byte tokens decode together: one character spans several ids
    for token_id in ids:
        if 0 <= token_id < NUM_BYTE_IDS:
            pending.append(token_id)
            continue
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
        special = SPECIAL_IDS.get(token_id)
        if special is not None:
            if not skip_special:
                out.append(special)
            continue
        out.append(_ID_TEXT.get(token_id, ""))
    if pending:
        out.append(pending.decode("utf-8", errors="replace"))
    return "".join(out)


def token_id(piece: str) -> int:
    """The id of one piece that is known to be a single token (the output generator's)."""
    return SPECIAL_TOKENS.get(piece) or _id(piece)


class TemplateError(ValueError):
    """A message the chat template cannot render; the server answers 400."""


def _content_text(content: Any, where: str) -> tuple[str, int]:
    """(text, number of media parts) of a message's ``content``."""
    if content is None:
        return "", 0
    if isinstance(content, str):
        return content, 0
    if isinstance(content, list):
        texts: list[str] = []
        media = 0
        for i, part in enumerate(content):
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise TemplateError(f"{where}.content[{i}] must be an object with a 'type'")
            if part["type"] == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise TemplateError(f"{where}.content[{i}].text must be a string")
                texts.append(text)
            else:
                media += 1
        return "\n".join(texts), media
    raise TemplateError(f"{where}.content must be a string or a list of parts")


def render_chat(
    messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
) -> tuple[str, int]:
    """Qwen2.5's ChatML rendering: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message.

    Returns the prompt text and the number of media parts (each costs
    :data:`MEDIA_PART_TOKENS`). Tool definitions and tool calls are rendered as JSON text, which
    is what they cost in Qwen's real template, give or take its fixed instructions.
    """
    out: list[str] = []
    media = 0
    if not messages or messages[0].get("role") != "system":
        out.append(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n")
    for i, message in enumerate(messages):
        role = message.get("role")
        text, n_media = _content_text(message.get("content"), f"messages[{i}]")
        media += n_media
        tool_calls = message.get("tool_calls")
        if tool_calls:
            text += "".join(
                "\n<tool_call>\n" + json.dumps(call, separators=(",", ":")) + "\n</tool_call>"
                for call in tool_calls
            )
        out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out), media


def chat_prompt_ids(
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Any] | None = None,
) -> list[int]:
    """Token ids of a chat request as the model sees them (template applied)."""
    text, media = render_chat(messages, add_generation_prompt=add_generation_prompt)
    ids = encode(text)
    if tools:
        ids = encode(json.dumps(list(tools), separators=(",", ":")), special=False) + ids
    if media:
        ids = ids + [MEDIA_PLACEHOLDER_ID] * (media * MEDIA_PART_TOKENS)
    return ids
