"""The simulator's deterministic output: what each generated token is, and stop strings.

The next token is a function of the token context (prompt and output so far) and the seed, never
of where the prompt ended: a request continued elsewhere with ``prompt = prompt ids + generated
ids`` yields exactly the tokens the first replica would have produced, as a real model at
temperature 0 does. The state the rule needs (the last token's kind, words in the sentence, a
character half-way through its byte tokens) is read back from the context's last tokens; the
draws come from a hash of the context's head, its length and its last few tokens.

Text is sentences of common words; a word, a punctuation mark or a paragraph break is one token,
and an emoji at a sentence end is four byte tokens (no text until the last), so re-tokenizing an
answer gives its ids back. With ``max_tokens`` the output is exactly that long unless a stop
string ends it first; without one (a chat request with no ``max_tokens``) it ends with the
end-of-sequence token after a deterministic "natural" length counted from the assistant header.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import tokenizer

_COMMON_WORDS = (
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
WORDS = tuple(w for w in _COMMON_WORDS if len(w) + 1 <= tokenizer.WHOLE_WORD_MAX)

SENTENCE_MIN, SENTENCE_MAX = 5, 14
END_P, COMMA_P, QUESTION_P, PARAGRAPH_P, EMOJI_P = 0.2, 0.12, 0.1, 0.2, 0.15
HEAD = 64  # context tokens whose hash tells prompts apart
TAIL = 8  # last context tokens that feed each draw
# The emoji a sentence may end with: U+1F600-U+1F63F, UTF-8 F0 9F 98 80-BF.
EMOJI_LEAD = (0xF0, 0x9F, 0x98)
_M64 = (1 << 64) - 1

# The kind of every token the generator emits, to read its state back from a context.
WORD, COMMA, END, PARA, BYTE, EMOJI_END = range(6)
_WORD_IDS = {
    i: t
    for w in WORDS
    for t in (" " + w, " " + w.capitalize(), w.capitalize())
    for i in tokenizer.encode(t, special=False)
}
_KIND: dict[int, int] = {i: WORD for i in _WORD_IDS}
_KIND.update({tokenizer.token_id(","): COMMA, tokenizer.token_id("."): END})
_KIND.update({tokenizer.token_id("?"): END, tokenizer.token_id("\n\n"): PARA})
_KIND.update({b: BYTE for b in range(tokenizer.NUM_BYTE_IDS)})
ASSISTANT_HEADER = tuple(tokenizer.encode("<|im_start|>assistant\n"))


def _mix(x: int) -> int:
    """splitmix64's finaliser: spreads a hash over all 64 bits."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def generation_start(context: Sequence[int]) -> int:
    """Where the model's answer begins: after the last assistant header, else the context end."""
    h = ASSISTANT_HEADER
    n = len(h)
    for j in range(len(context) - n, -1, -1):
        if context[j] == h[0] and tuple(context[j : j + n]) == h:
            return j + n
    return len(context)


class Output:
    """One choice's output. The engine calls :meth:`advance` once per generated token."""

    __slots__ = (
        "_already", "_emoji", "_head", "_head_hash", "_held", "_include_stop", "_kind", "_limit",
        "_n", "_natural_len", "_pending", "_seed", "_stops", "_tail", "_words", "deltas",
        "finish_reason", "ids", "stop_reason",
    )  # fmt: skip

    def __init__(
        self,
        seed: int,
        *,
        max_tokens: int,
        prompt: Sequence[int] = (),
        natural_len: int | None = None,
        natural_range: tuple[int, int] | None = None,
        stop: Sequence[str] = (),
        include_stop: bool = False,
    ) -> None:
        self._seed = seed & _M64
        self._limit = max_tokens
        self._stops = tuple(s for s in stop if s)
        self._include_stop = include_stop
        self._held = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""  # generated text held back from the deltas (stop strings only)
        self._n = len(prompt)
        self._head = list(prompt[:HEAD])
        self._head_hash = hash(tuple(self._head))
        self._tail = list(prompt[-TAIL:])
        self._read_state(prompt)
        # The answer may have begun in the prompt (a continued request): count from its start.
        start = generation_start(prompt) if natural_range is not None else len(prompt)
        self._already = len(prompt) - start
        if natural_range is not None:
            low, high = natural_range
            span = _mix(hash((self._seed, hash(tuple(prompt[:start]))))) % (high - low + 1)
            natural_len = low + span
        self._natural_len = natural_len
        self.ids: list[int] = []
        self.deltas: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None

    def _read_state(self, context: Sequence[int]) -> None:
        """The rule's state at the end of ``context``, read back from its last tokens."""
        self._kind: int | None = _KIND.get(context[-1]) if context else None
        self._emoji = 0  # byte tokens of an emoji emitted so far (0: not inside one)
        if self._kind == BYTE:
            k = 0
            while k < 3 and k < len(context) and context[-1 - k] < tokenizer.NUM_BYTE_IDS:
                k += 1
            run = tuple(context[len(context) - k :])
            # The emoji's leading bytes end the context: the rest follow. A complete one (or
            # bytes of anything else) ends a sentence.
            for size in (3, 2, 1):
                if run[-size:] == EMOJI_LEAD[:size]:
                    self._emoji = size
                    break
            else:
                self._kind = EMOJI_END
        words = 0
        i = len(context) - 1
        while i >= 0 and words < SENTENCE_MAX:
            kind = _KIND.get(context[i])
            if kind == WORD:
                words += 1
            elif kind != COMMA:
                break
            i -= 1
        self._words = words

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
        if self._natural_len is not None and self._already + k >= self._natural_len:
            self.ids.append(tokenizer.EOS_ID)
            return self._finish("stop", self._pending)
        token, piece = self._next()
        self.ids.append(token)
        self._push(token)
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

    def _push(self, token: int) -> None:
        """Extend the context by ``token`` and update the rule's state as a re-read would."""
        self._n += 1
        if len(self._head) < HEAD:
            self._head.append(token)
            self._head_hash = hash(tuple(self._head))
        self._tail.append(token)
        if len(self._tail) > TAIL:
            del self._tail[0]
        if self._emoji:
            self._emoji = self._emoji + 1 if self._emoji < 3 else 0
            self._kind = BYTE if self._emoji else EMOJI_END
            self._words = 0
            return
        kind = _KIND.get(token)
        if kind == BYTE:  # the emoji's first byte
            self._emoji, self._kind, self._words = 1, BYTE, 0
            return
        self._kind = kind
        if kind == WORD:
            self._words = min(self._words + 1, SENTENCE_MAX)
        elif kind != COMMA:
            self._words = 0

    def _next(self) -> tuple[int, str]:
        """The next token and its text, from the context alone."""
        x = _mix(hash((self._seed, self._head_hash, self._n, tuple(self._tail))))
        u1 = (x & 0xFFFF) / 65536.0
        u2 = ((x >> 16) & 0xFFFF) / 65536.0
        u3 = ((x >> 32) & 0xFFFF) / 65536.0
        word = WORDS[(x >> 48) % len(WORDS)]
        if self._emoji == 3:
            last = 0x80 + int(u1 * 64)
            return last, bytes((*EMOJI_LEAD, last)).decode("utf-8")
        if self._emoji:
            return EMOJI_LEAD[self._emoji], ""
        kind = self._kind
        if kind == END and u1 < EMOJI_P:
            return EMOJI_LEAD[0], ""
        if kind in (END, EMOJI_END):
            if u2 < PARAGRAPH_P:
                return self._piece("\n\n")
            return self._piece(" " + word.capitalize())
        if kind == WORD:
            words = self._words
            if words >= SENTENCE_MAX or (words >= SENTENCE_MIN and u1 < END_P):
                return self._piece("?" if u2 < QUESTION_P else ".")
            if words >= 2 and u3 < COMMA_P:
                return self._piece(",")
            return self._piece(" " + word)
        if kind == COMMA:
            return self._piece(" " + word)
        return self._piece(word.capitalize())  # the answer's or a paragraph's start

    @staticmethod
    def _piece(text: str) -> tuple[int, str]:
        return tokenizer.token_id(text), text
