"""Deterministic model output: plausible English, one token per piece, produced lazily.

The same prompt, seed and choice index always give the same text, so tests can compare answers
across replicas and retries. Every piece is exactly one token of :mod:`.tokenizer` (short words
with their leading space, punctuation, paragraph breaks), so re-tokenizing an answer gives its
reported ``completion_tokens`` back (minus the end-of-sequence token, which has no text).

Stop conditions follow vLLM: a stop string ends the output at the token that completes it and is
cut from the text (kept with ``include_stop_str_in_output``); while stop strings are set, the last
``len(longest stop) - 1`` characters are held back from streamed deltas so that a stop string is
never half-sent (vLLM's detokenizer does the same). With a token limit the output is exactly that
long unless a stop string ends it first; without one (a chat request with no ``max_tokens``) it
ends with the end-of-sequence token after a deterministic "natural" length.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from . import tokenizer

WORDS = (
    "the of and to in is it that for you was with on as have but be they at one this from "
    "or had by hot word what some we can out other were all there when up use your how said "
    "an each she which do their time if will way about many then them write would like so "
    "these her long make thing see him two has look more day could go come did number sound "
    "no most people my over know water than call first who may down side been now find any "
    "new work part take get place made live where after back little only round man year came "
    "show every good me give our under name very through just form great think say help low "
    "line before turn cause same mean differ move right boy old too does tell set three want "
    "air well also play small end put home read hand port large spell add even land here must "
    "big high such follow act why ask men change went light kind off need house picture try "
    "us again animal point mother world near build self earth father head stand own page "
    "should country found answer school grow study still learn plant cover food sun four "
    "thought let keep eye never last door between city tree cross since hard start might story "
    "saw far sea draw left late run while press close night real life few stop open seem "
    "together next white begin got walk example ease paper often always music those both mark "
    "book letter until mile river car feet care second group carry took rain eat room friend "
    "began idea fish north once base hear horse cut sure watch color face wood main enough "
    "plain girl usual young ready above ever red list though feel talk bird soon body dog "
    "family direct pose leave song measure state product black short class wind question "
    "happen ship area half rock order fire south problem piece told knew pass farm top whole "
    "king size heard best hour better true during hundred am remember step early hold west "
    "ground interest reach fast five sing listen six table travel less morning ten simple "
    "several toward war lay against pattern slow center love person money serve appear road "
    "map science rule govern pull cold notice voice fall power town fine certain fly unit lead "
    "cry dark machine note wait plan figure star box noun field rest correct able pound done "
    "beauty drive stood contain front teach week final gave green oh quick develop sleep warm "
    "free minute strong special mind behind clear tail produce fact street inch lot nothing "
    "course stay wheel full force blue object decide surface deep moon island foot yet busy "
    "test record boat common gold possible plane age dry wonder laugh thousand ago ran check "
    "game shape yes cool miss brought heat snow bed bring sit perhaps fill east weight "
    "language among"
).split()
# Only words that stay one token with their leading space and capitalised.
WORDS = tuple(w for w in WORDS if len(w) + 1 <= tokenizer.WHOLE_WORD_MAX)

SENTENCE_MIN, SENTENCE_MAX = 5, 14
COMMA_P, QUESTION_P, PARAGRAPH_P = 0.12, 0.1, 0.2


class Output:
    """One choice's output. The engine calls :meth:`advance` once per generated token."""

    __slots__ = (
        "_held", "_include_stop", "_limit", "_line_start", "_natural_len", "_pending", "_queue",
        "_rng", "_stops", "deltas", "finish_reason", "ids", "stop_reason",
    )  # fmt: skip

    def __init__(
        self,
        seed: int,
        *,
        max_tokens: int,
        natural_len: int | None = None,
        stop: Sequence[str] = (),
        include_stop: bool = False,
    ) -> None:
        self._rng = random.Random(seed)
        self._limit = max_tokens
        self._natural_len = natural_len
        self._stops = tuple(s for s in stop if s)
        self._include_stop = include_stop
        self._held = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""  # generated text held back from the deltas (stop strings only)
        self._queue: list[str] = []
        self._line_start = True
        self.ids: list[int] = []
        self.deltas: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    def advance(self) -> bool:
        """Produce the next token; return True when it is the last one."""
        if self.finish_reason is not None:
            raise RuntimeError("advance() after the output finished")
        k = len(self.ids) + 1
        if self._natural_len is not None and k >= self._natural_len:
            self.ids.append(tokenizer.EOS_ID)
            return self._finish("stop", self._pending)
        piece = self._next_piece()
        self.ids.append(tokenizer.token_id(piece))
        if not self._stops:
            if k >= self._limit:
                return self._finish("length", piece)
            self.deltas.append(piece)
            return False
        # Only the held-back text and the new piece can hold a stop string not seen before.
        pending = self._pending + piece
        hits = [(j, s) for s in self._stops if (j := pending.find(s)) >= 0]
        if hits:
            j, stop = min(hits)
            self.stop_reason = stop
            return self._finish("stop", pending[: j + len(stop) if self._include_stop else j])
        if k >= self._limit:
            return self._finish("length", pending)
        cut = max(0, len(pending) - self._held)
        self.deltas.append(pending[:cut])
        self._pending = pending[cut:]
        return False

    def _finish(self, reason: str, delta: str) -> bool:
        self.deltas.append(delta)
        self._pending = ""
        self.finish_reason = reason
        return True

    def _next_piece(self) -> str:
        if not self._queue:
            self._queue = self._sentence()
            self._queue.reverse()
        return self._queue.pop()

    def _sentence(self) -> list[str]:
        rng = self._rng
        n = rng.randint(SENTENCE_MIN, SENTENCE_MAX)
        out: list[str] = []
        for i in range(n):
            word = WORDS[rng.randrange(len(WORDS))]
            if i == 0:
                out.append(word.capitalize() if self._line_start else " " + word.capitalize())
            else:
                out.append(" " + word)
            if 0 < i < n - 1 and rng.random() < COMMA_P:
                out.append(",")
        out.append("?" if rng.random() < QUESTION_P else ".")
        self._line_start = rng.random() < PARAGRAPH_P
        if self._line_start:
            out.append("\n\n")
        return out
