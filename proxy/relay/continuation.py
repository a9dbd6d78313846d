"""Token-exact continuation of a stream whose replica fails mid-answer: the pure parts.

An eligible stream is forwarded with ``return_token_ids``: its first chunk carries the prompt's
token ids and every chunk the ids it generated. When its replica fails after content reached
the client, the generation goes on elsewhere with ``/v1/completions``, prompt = prompt ids +
generated ids (a token prompt is used verbatim, no template), and the continuation's chunks are
rewritten into the client's one stream. This module decides who is eligible, keeps the ids and
the stream's identity (``Splice``), builds the continuation request and rewrites its chunks;
the relay does the I/O.

Exactness holds only where nothing but the token context decides the next token, hence the
refusals: stop strings are matched on output text (a match across the seam would be missed and
vLLM holds text back while sending its ids), a grammar restarts from its root on replayed ids,
logprobs and ``n`` > 1 have no place in the splice, and a tool call would come back as raw text.

Length: one job, continuation's pure parts, kept together so the eligibility rules and the
rewriting they protect read side by side.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import StrEnum
from typing import Any, Final

from proxy.config import ContinuationConfig
from proxy.errors import FailureKind
from proxy.relay import sse
from proxy.relay.sse import FIND, RFIND

_COMPACT: Final = (",", ":")


class Refusal(StrEnum):
    """Why a stream is not continued (``tokenlane_continuation_refusals_total{reason}``)."""

    DISABLED = "disabled"  # continuation.enabled is off, or the lane's switch
    N = "n"  # n or best_of above 1
    TOOLS = "tools"  # tools offered (tool_choice other than "none"), or a tool call seen
    STRUCTURED = "structured"  # response_format / structured outputs / guided decoding
    LOGPROBS = "logprobs"
    STOP = "stop"  # stop strings
    CONTENT = "content"  # a non-text message part, a batch prompt, echo
    SEEDED = "seeded"  # seed with temperature > 0 under refuse_when_seeded
    USAGE_STATS = "usage_stats"  # continuous_usage_stats
    REASONING = "reasoning"  # the seam falls inside reasoning
    SEQ_LEN = "seq_len"  # prompt ids above continuation.max_seq_len
    NO_IDS = "no_ids"  # the replica sent no token ids
    LIMIT = "limit"  # continuation.max_attempts spent
    NO_TARGET = "no_target"  # no other replica could take it
    BUSY = "busy"  # no re-prefill slot freed within continuation.start_timeout_s
    CLIENT_ERROR = "client_error"  # an in-band error below 500: the request's fault
    MALFORMED = "malformed"  # a chunk that is not JSON: the ids can no longer be trusted
    API = "api"  # a Messages or Responses stream: only chat and completions are spliced


class Trigger(StrEnum):
    """What ended the upstream (``tokenlane_continuations_total{trigger}``)."""

    EOF = "eof"  # closed early: no finish chunk, no [DONE]
    RESET = "reset"  # the connection was reset
    ERROR_EVENT = "error_event"  # an in-band error event with code >= 500
    ABORT = "abort"  # finish_reason "abort" (the engine aborted it)
    STALL = "stall"  # silent for the lane's stream_idle_timeout_s, or the replica ejected


# Fields that end eligibility when present and meaningful; each maps to its refusal.
_STRUCTURED_KEYS: Final = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding",
)
# Copied verbatim into the continuation: they shape sampling, not the prompt.
SAMPLING_KEYS: Final = (
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "bad_words",
    "allowed_token_ids", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "cache_salt", "priority", "length_penalty",
)  # fmt: skip


# The other fields a refusal reads, named once for ``eligibility``'s checks and for
# ``_REFUSING_KEYS``.
_N_KEYS: Final = ("n", "best_of")
_LOGPROBS_KEYS: Final = ("logprobs", "top_logprobs", "prompt_logprobs")
# Every field whose presence can refuse a stream before its messages or prompt are read
# (``tool_choice`` and ``temperature`` only qualify ``tools`` and ``seed``): a body with none of
# them (most requests: model, messages, stream, max_tokens) is judged on its content alone,
# without a lookup per field.
_REFUSING_KEYS: Final = frozenset(
    (*_N_KEYS, "tools", "functions", "response_format", *_STRUCTURED_KEYS, *_LOGPROBS_KEYS,
     "stop", "echo", "kv_transfer_params", "stream_options", "seed")
)  # fmt: skip


def _truthy_list(value: Any) -> bool:
    return bool(value) if isinstance(value, (list, str, dict)) else value is not None


def eligibility(
    kind: str,
    body: dict[str, Any],
    *,
    enabled: bool,
    refuse_when_seeded: bool,
) -> Refusal | None:
    """None when a streamed request can be continued token-exact, else why not."""
    if not enabled:
        return Refusal.DISABLED
    if kind != "chat" and kind != "completion":
        return Refusal.API
    # A loop, not ``_REFUSING_KEYS.isdisjoint(body)``: compiled, that is a method call by name
    # (about 2,900 instructions more a request, callgrind); this is a set lookup a key.
    for key in body:
        if key in _REFUSING_KEYS:
            break
    else:
        return _content_refusal(kind, body)
    for key in _N_KEYS:
        v = body.get(key)
        if v is not None and v != 1:
            return Refusal.N
    tools = body.get("tools") or body.get("functions")
    if tools and body.get("tool_choice") != "none":
        return Refusal.TOOLS
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return Refusal.STRUCTURED
    if any(body.get(k) is not None for k in _STRUCTURED_KEYS):
        return Refusal.STRUCTURED
    if any(body.get(k) for k in _LOGPROBS_KEYS):
        return Refusal.LOGPROBS
    if _truthy_list(body.get("stop")):
        return Refusal.STOP
    if body.get("echo") or body.get("kv_transfer_params") is not None:
        return Refusal.CONTENT
    refusal = _content_refusal(kind, body)
    if refusal is not None:
        return refusal
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return Refusal.USAGE_STATS
    if refuse_when_seeded and body.get("seed") is not None:
        temperature = body.get("temperature")
        # Unset means the model's default, which is sampling for most models.
        if temperature is None or temperature > 0:
            return Refusal.SEEDED
    return None


def _content_refusal(kind: str, body: dict[str, Any]) -> Refusal | None:
    """``Refusal.CONTENT`` for a message part that is not text, or a prompt that is a batch
    or missing; else None."""
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return Refusal.CONTENT
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list) and any(
                not isinstance(p, dict) or p.get("type") != "text" for p in content
            ):
                return Refusal.CONTENT
        return None
    prompt = body.get("prompt")
    token_prompt = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
    if not (isinstance(prompt, str) or (token_prompt and prompt)):
        return Refusal.CONTENT  # a batch of prompts, or none
    return None


def continues(cfg: ContinuationConfig, lane_switch: bool) -> bool:
    """Whether a lane's streams can be continued at all under the policy in force."""
    return cfg.enabled and lane_switch and cfg.max_attempts > 0


def refusal_under(
    cfg: ContinuationConfig, lane_switch: bool, kind: str, body: dict[str, Any]
) -> Refusal | None:
    """``eligibility`` under the policy in force: its ``continuation`` section and the lane's
    own ``continuation`` switch."""
    return eligibility(
        kind,
        body,
        enabled=continues(cfg, lane_switch),
        refuse_when_seeded=cfg.refuse_when_seeded,
    )


def explain(
    cfg: ContinuationConfig, lane_switch: bool, kind: str, body: dict[str, Any]
) -> dict[str, Any]:
    """What ``tokenlane explain`` says of continuation: would this request's stream be
    continued on another replica if its own failed mid-answer, and if not, why not."""
    if not body.get("stream"):
        return {"eligible": False, "refusal": None, "why": "not a stream: only streams continue"}
    refusal = refusal_under(cfg, lane_switch, kind, body)
    if refusal is None:
        return {"eligible": True, "refusal": None, "why": "forwarded with return_token_ids"}
    return {"eligible": False, "refusal": refusal.value, "why": _REFUSAL_WHY[refusal]}


_REFUSAL_WHY: Final = {
    Refusal.DISABLED: "continuation.enabled, the lane's switch or max_attempts turns it off",
    Refusal.N: "n or best_of above 1",
    Refusal.TOOLS: "tools offered (tool_choice is not none)",
    Refusal.STRUCTURED: "structured output or guided decoding",
    Refusal.LOGPROBS: "logprobs asked",
    Refusal.STOP: "stop strings (matched on text, which a seam could split)",
    Refusal.CONTENT: "a non-text message part, a batch prompt or echo",
    Refusal.API: "a Messages or Responses stream (their typed events are not spliced yet)",
    Refusal.SEEDED: "seeded with temperature > 0 under continuation.refuse_when_seeded",
    Refusal.USAGE_STATS: "stream_options.continuous_usage_stats",
    Refusal.REASONING: "the seam falls inside reasoning",
    Refusal.SEQ_LEN: "prompt and generated tokens above continuation.max_seq_len",
    Refusal.NO_IDS: "the replica sent no token ids",
    Refusal.LIMIT: "continuation.max_attempts spent",
    Refusal.NO_TARGET: "no other replica could take it",
    Refusal.BUSY: "no re-prefill slot freed within continuation.start_timeout_s",
    Refusal.CLIENT_ERROR: "the replica's in-band error was below 500: the request's fault",
    Refusal.MALFORMED: "a chunk that is not JSON: the ids can no longer be trusted",
}


_JSON_SPACE: Final = b" \t\r\n"
_ASK_IDS: Final = b',"return_token_ids":true}'


def forward_body(raw: bytes, body: dict[str, Any]) -> bytes:
    """The eligible request as sent upstream, asking for token ids: the client's bytes
    (``raw``, parsed as ``body``) with the flag added before the object's closing brace, every
    other byte as the client sent it, and no re-encoding of a long prompt. Encoded afresh only
    when the client named the flag itself (as false: true is a client that sees the ids)."""
    if body and "return_token_ids" not in body:
        text = raw.rstrip(_JSON_SPACE)  # the edge parsed ``raw`` as an object: it ends in "}"
        if text.endswith(b"}"):
            return text[:-1] + _ASK_IDS + raw[len(text) :]
    return json.dumps({**body, "return_token_ids": True}, separators=_COMPACT).encode()


# vLLM writes chunks as compact JSON; ids are integers. Nulled, not removed, so a client that
# did not ask sees exactly what vLLM sends without the flag. Found with ``bytes.find``, not a
# regular expression: a regex scan costs ~12 µs a chunk here, as much as parsing it with json.
# Final: compiled code reads a final module constant as a C static, another through the
# module's dict, on every use (a lookup an event in ``strip_ids``, compiled).
_IDS_KEY: Final = b'token_ids":'
_ID_BYTES: Final = b"0123456789, \t\r\n"


# An ordinary token chunk is read without parsing it. vLLM writes every token chunk of a
# stream alike: the same head (id, object, created, model, the choice's index), the text as a
# JSON string, the same tail (logprobs, finish_reason, ... up to token_ids), then the ids. The
# first such chunk, parsed and checked, gives the head and tail (``Splice.learn_template``);
# a later chunk with that head and tail and a text holding no quote is one (``take_event``).
# Anything else (the role chunk, a finish, an error, tool calls, reasoning, usage, a text
# with a quote, two events in one read) is parsed.
_TEMPLATE_MARK: Final = {"chat": b'"delta":{"content":"', "completion": b'"text":"'}
_TOKEN_IDS: Final = b'"token_ids":['
_TOKEN_END: Final = b"]}]}"  # the ids' list, the choice, the choices, the chunk
_TOKEN_CHUNK_END: Final = _TOKEN_END + b"\n\n"
_NULLED: Final = b"null}]}"  # the same end, the ids nulled
_NULLED_END: Final = _NULLED + b"\n\n"  # and the event ended
_TOP_KEYS: Final = frozenset(("id", "object", "created", "model", "choices"))
_CHOICE_KEYS: Final = frozenset(("index", "delta", "text", "logprobs", "finish_reason",
                                 "stop_reason", "prompt_token_ids", "token_ids"))  # fmt: skip
_NULL_KEYS: Final = ("logprobs", "finish_reason", "stop_reason", "prompt_token_ids")


# A stream's template differs from the last stream's of its model only in the chunk's id and
# created: the template learned once is kept with those two cut out (``Shapes``), and a new
# stream's is made from its role chunk's id and created, so that its first token goes
# unparsed too. Whatever matches a made template is a chunk of a checked shape with this
# stream's id and created; one that does not is parsed, and the stream learns its own.
_ID_AT: Final = b'data: {"id":"'
_ID_NAME: Final = b'"id"'
_CREATED_NAME: Final = b'"created"'
_CREATED_KEY: Final = _CREATED_NAME + b":"
_SHAPES_KEPT: Final = 256  # models x kinds a gateway serves; past it the memory starts over
_SHAPE_BYTES: Final = 4096  # a template's head and tail (vLLM's: about 150 bytes)


def _plain_id(value: object) -> bytes | None:
    """``value`` as the bytes inside its JSON string as vLLM writes it (UTF-8, unescaped),
    when it holds no quote, backslash or control character (which a writer escapes: held raw
    in a made head, it would let a chunk a parse splits or refuses match); else None."""
    if not isinstance(value, str):
        return None
    try:
        b = value.encode()
    except UnicodeEncodeError:
        return None  # a lone surrogate: no writer writes it raw
    n = len(b)
    if FIND(b, b'"', 0, n) >= 0 or FIND(b, b"\\", 0, n) >= 0:
        return None
    for c in b:
        if c < 0x20:
            return None
    return b


def _plain_created(value: object) -> bytes | None:
    """``value`` as JSON writes an int; None for anything else (a bool included)."""
    if type(value) is not int:
        return None
    return str(value).encode()


# A finish is an ordinary token chunk but for its tail: ``"finish_reason":"stop"`` (and what
# a replica adds beside it, such as ``"stop_reason":null``) where a token chunk has null. The
# tails a stream's template has finished with, kept with that template, and the reason each
# gives; a few (stop, length and their stop reasons), past which a finish is parsed.
FinishTails = list[tuple[bytes, str]]
_FINISH_TAILS_KEPT: Final = 4


class RoleShape:
    """A stream's first chunk (the role, and the prompt's ids) as bytes around the three things
    that differ from one stream to the next: the chunk's id, its created and the prompt's ids.
    What parsing it noted (the model, the fingerprint) and what the client gets of it (its
    ids null) come with it: a chunk of these bytes parses to the same but for those three."""

    __slots__ = ("after", "before_created", "between", "fingerprint", "model", "null_after")

    def __init__(
        self, before_created: bytes, between: bytes, after: bytes, null_after: bytes,
        model: str, fingerprint: Any,
    ) -> None:  # fmt: skip
        self.before_created = before_created  # from the id's closing quote to created's digits
        self.between = between  # from created's digits to the prompt ids' "["
        self.after = after  # from their "]" to the event's end
        self.null_after = null_after  # the client's bytes from the prompt's null on, ended
        self.model = model
        self.fingerprint = fingerprint


class Shapes:
    """The token-chunk templates learned by earlier streams, by kind and model, each with its
    chunk's id and created cut out: ``made`` puts a new stream's in. Beside them, the first
    chunks (``RoleShape``) by kind and the model a request names. One per relay (a process's
    streams); passed to each ``Splice``."""

    __slots__ = ("_kept", "_roles")

    def __init__(self) -> None:
        # (kind, model) -> (the head between id and created, the head after created, tail,
        # the finish tails learned with it)
        self._kept: dict[tuple[str, str], tuple[bytes, bytes, bytes, FinishTails]] = {}
        self._roles: dict[tuple[str, str], RoleShape] = {}

    def learn(
        self, kind: str, model: object, chunk_id: object, created: object, head: bytes,
        tail: bytes, finishes: FinishTails,
    ) -> None:  # fmt: skip
        """Keep a template learned from a chunk with this id and created, when its head is
        ``data: {"id":"<id>"`` and holds the one ``"created":<created>``; ``finishes`` (the
        stream's, filled as it meets finishes) go with it."""
        if not isinstance(model, str):
            return
        at = _identity(head, chunk_id, created)
        if at is None or not _names_absent(tail, 0, len(tail)):
            return
        if len(head) + len(tail) > _SHAPE_BYTES:
            return  # a replica's model name of any size is not kept
        if len(self._kept) >= _SHAPES_KEPT:
            self._kept.clear()
        self._kept[(kind, model)] = (head[at[0] : at[1]], head[at[2] :], tail, finishes)

    def made(
        self, kind: str, model: object, chunk_id: object, created: object
    ) -> tuple[bytes, bytes, FinishTails] | None:
        """The head, tail and finish tails of a stream of ``kind`` whose chunks carry this
        model, id and created, made from the template kept for them; None when there is none."""
        ib = _plain_id(chunk_id)
        cb = _plain_created(created)
        if ib is None or cb is None:
            return None
        return self.made_of(kind, model, ib, cb)

    def made_of(
        self, kind: str, model: object, ib: bytes, cb: bytes
    ) -> tuple[bytes, bytes, FinishTails] | None:
        """``made`` of an id and a created already as a template holds them (``_plain_id``,
        ``_plain_created``): a first chunk's own bytes, as ``Splice.take_role`` checked them."""
        if not isinstance(model, str):
            return None
        kept = self._kept.get((kind, model))
        if kept is None:
            return None
        return b"".join((_ID_AT, ib, kept[0], cb, kept[1])), kept[2], kept[3]

    def learn_role(self, kind: str, asked: str, role: RoleShape) -> None:
        """Keep the first chunk of a stream whose request named model ``asked``."""
        if len(self._roles) >= _SHAPES_KEPT:
            self._roles.clear()
        self._roles[(kind, asked)] = role

    def role(self, kind: str, asked: str) -> RoleShape | None:
        return self._roles.get((kind, asked))


def _identity(event: bytes, chunk_id: object, created: object) -> tuple[int, int, int] | None:
    """Where a chunk parsed with this id and created has them, when it starts
    ``data: {"id":"<id>"``, holds one ``"created":<created>`` after the id and neither name
    anywhere else, in any spelling (no backslash, so no escaped key; a name spaced from its
    colon is still found): (the id's closing quote, the created's digits, their end); else
    None. Only then can a template hold everything but those two as bytes that parse the
    same for any: JSON's decoder keeps a key's last value."""
    ib = _plain_id(chunk_id)
    cb = _plain_created(created)
    if ib is None or cb is None:
        return None
    q = len(_ID_AT) + len(ib)
    if not event.startswith(_ID_AT) or not event.startswith(ib, len(_ID_AT)):
        return None
    n = len(event)
    if not event.startswith(b'"', q) or not _names_absent(event, len(_ID_AT), n, True):
        return None
    at = FIND(event, _CREATED_KEY, q, n)
    if at < 0 or FIND(event, _CREATED_NAME, 0, n) != at or RFIND(event, _CREATED_NAME, 0, n) != at:
        return None
    at += len(_CREATED_KEY)
    end = at + len(cb)
    if not event.startswith(cb, at) or end >= n or event[end] not in b",}":
        return None
    return q, at, end


def _names_absent(data: bytes, i: int, n: int, created_allowed: bool = False) -> bool:
    """Whether ``data[i:n]`` holds no backslash and no ``"id"`` (nor ``"created"`` unless
    ``created_allowed``): a part of a kept template that cannot name either again."""
    if FIND(data, b"\\", i, n) >= 0 or FIND(data, _ID_NAME, i, n) >= 0:
        return False
    return created_allowed or FIND(data, _CREATED_NAME, i, n) < 0


def _id_of(raw: bytes) -> str | None:
    """The id a JSON string's inside ``raw`` decodes to, when it holds no backslash or
    control character (``_plain_id``'s converse); None when it holds one or is not UTF-8."""
    if FIND(raw, b"\\", 0, len(raw)) >= 0:
        return None
    for c in raw:
        if c < 0x20:
            return None
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


def _int_end(data: bytes, i: int, n: int) -> int:
    """Where an int as JSON writes a created (1 to 18 digits, no leading zero) from
    ``data[i]`` ends; -1 when there is none."""
    j = i
    while j < n and 0x30 <= data[j] <= 0x39:
        j += 1
    if j == i or j - i > 18 or (j - i > 1 and data[i] == 0x30):
        return -1
    return j


def match_role(
    event: bytes, before_created: bytes, between: bytes, after: bytes
) -> tuple[str, int, int, int, int] | None:
    """Where a stream's first chunk has what differs from one stream to the next, when it is
    the bytes of a kept one (``RoleShape``) around them: ``data: {"id":"``, the id (no
    backslash or control byte, UTF-8) up to its first quote, ``before_created``, the created
    (``_int_end``), ``between``, the prompt's ids as ``parse`` cuts them (no ``]``, ``[``,
    quote or line end inside), ``after`` to the end. (The id, the created, the id's closing
    quote, the created's end, the ids' start); None when it is not one.

    The contract ``proxy/relay/_tokenscan.c``'s ``role`` implements in C (``ROLE``): a
    first chunk's checks were a dozen calls of bytes methods and loops over its bytes
    (callgrind: 12,800 instructions a stream). ``tests/test_token_event.py`` holds the two to
    the same results."""
    n = len(event)
    if not event.startswith(_ID_AT):
        return None
    q = FIND(event, b'"', len(_ID_AT), n)
    if q < 0 or not event.startswith(before_created, q):
        return None
    digits = q + len(before_created)
    digits_end = _int_end(event, digits, n)
    if digits_end < 0 or not event.startswith(between, digits_end):
        return None
    start = digits_end + len(between)
    end = n - len(after)
    if end < start or not event.endswith(after):
        return None
    if (
        FIND(event, b"]", start, end) >= 0
        or FIND(event, b"[", start, end) >= 0
        or FIND(event, b'"', start, end) >= 0
        or FIND(event, b"\n", start, end) >= 0
    ):
        return None
    chunk_id = _id_of(event[len(_ID_AT) : q])
    if chunk_id is None:
        return None
    return chunk_id, int(event[digits:digits_end]), q, digits_end, start


def ids_end(data: bytes, i: int, n: int) -> int:
    """Where the ids from ``data[i]`` (before ``n``) end, as vLLM writes a ``token_ids`` list:
    each id 1 to 18 digits (a hostile upstream's 5,000-digit "id" is parsed, and refused there,
    not read), no leading zero, one comma between two. The index of the first other byte, or
    -1 where the ids are not plain, found at the first bad byte. Indexing and comparisons,
    which compiled code does itself (``strip_ids``; ``_tokenscan.c`` has it in C)."""
    digits = 0  # of the id being scanned
    j = i
    while j < n:
        c = data[j]
        if 0x30 <= c <= 0x39:
            if digits == 18 or (digits == 1 and data[j - 1] == 0x30):
                return -1
            digits += 1
        elif c != 0x2C:
            break
        elif digits:
            digits = 0
        else:
            return -1  # a comma first, or after another
        j += 1
    return -1 if j > i and not digits else j


def plain_ids(ids: bytes) -> bool:
    """Whether the bytes inside a ``token_ids`` list are ids and commas, as vLLM writes."""
    return ids_end(ids, 0, len(ids)) == len(ids)


# The prompt's ids come once, on the first chunk (chat: at the top; completions: on the
# choice; a continuation's: the whole replayed prompt), and are read only at a seam. Parsed
# with the chunk, they would hold back its first token by about 30 µs per 1,000 prompt tokens
# (the decoder makes an int of each: 64 µs for 2,048 here, against 1 µs for the rest of the
# chunk), so ``Splice.parse`` cuts the list out as bytes, parses the rest, and the ids wait
# until a seam reads them.
_DONE_EVENT: Final = b"data: " + sse.DONE
_PROMPT_KEY: Final = b'"prompt_token_ids"'
_PROMPT_IDS: Final = _PROMPT_KEY + b":["
_PROMPT_NULL: Final = _PROMPT_KEY + b":null"


def _cut_where_vllm_puts_them(obj: Any) -> bool:
    """Whether ``obj`` (a chunk parsed with its prompt ids nulled) has them null where vLLM
    puts them: at its top, or on its one choice."""
    if not isinstance(obj, dict):
        return False
    if "prompt_token_ids" in obj:
        return obj["prompt_token_ids"] is None
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        choice = choices[0]
        return "prompt_token_ids" in choice and choice["prompt_token_ids"] is None
    return False


def _keys_within(obj: dict[str, Any], allowed: frozenset[str]) -> bool:
    """``allowed.issuperset(obj)``: compiled, a loop and a set lookup per key, not the
    method's call by name."""
    for key in obj:
        if key not in allowed:
            return False
    return True


def _ids_or_none(ids: list[Any]) -> list[int] | None:
    return ids if all(type(i) is int for i in ids) else None


def decode_ids(ids: bytes) -> list[int] | None:
    """The ids of a ``token_ids`` list's inside (digits, commas, JSON space); None when they
    are not ids."""
    try:
        out = json.loads(b"[" + ids + b"]")
    except ValueError:
        return None
    return _ids_or_none(out) if isinstance(out, list) else None


def strip_ids(event: bytes) -> bytes:
    """An event with its ``prompt_token_ids`` / ``token_ids`` lists replaced by null."""
    n = len(event)
    i = FIND(event, _IDS_KEY, 0, n)
    # Past keys whose value is no list (vLLM's ``"prompt_token_ids":null``, or the prompt's ids
    # ``Splice.parse`` nulled): the first chunk's own ids then take the common path below.
    while i >= 0 and i + len(_IDS_KEY) < n and event[i + len(_IDS_KEY)] == 0x6E:  # "n"
        i = FIND(event, _IDS_KEY, i + len(_IDS_KEY), n)
    if i < 0:
        return event
    # The common event: one key, its plain ids the event's last value (a finish chunk, a first
    # token chunk). Nulled as the scan below nulls it, without its calls with a position (each
    # a format string parsed): 10,000 instructions an event to 1,500 (callgrind). The first
    # key's list running to the event's end, no other key follows it.
    value = i + len(_IDS_KEY)
    end = len(event) - len(_TOKEN_END)
    if (
        event.endswith(_TOKEN_END)
        and i > 0
        and event[i - 1] == 0x22  # '"': the key's start
        and value < end
        and event[value] == 0x5B  # "["
        and ids_end(event, value + 1, end) == end
    ):
        return event[:value] + _NULLED
    return _strip_every_list(event, i)


def _strip_every_list(event: bytes, i: int) -> bytes:
    """``strip_ids`` of any event, from its first key at ``i``."""
    parts: list[bytes] = []
    done = 0  # event[:done] is in parts
    while i >= 0:
        value = i + len(_IDS_KEY)
        # Inside a JSON string a quote is escaped, so this is a key's end; only these two keys.
        is_key = event.endswith(b'"', 0, i) or event.endswith(b'"prompt_', 0, i)
        at = value
        while event[at : at + 1] in (b" ", b"\t", b"\r", b"\n"):
            at += 1
        if is_key and event[at : at + 1] == b"[":
            end = FIND(event, b"]", at, len(event))
            if end > 0 and not event[at + 1 : end].translate(None, _ID_BYTES):
                parts += (event[done:at], b"null")
                done = end + 1
        i = FIND(event, _IDS_KEY, value, len(event))
    if not parts:
        return event
    parts.append(event[done:])
    return b"".join(parts)


Scanned = tuple[bytes, bytes, int, bool]  # (out, ids, stop, text): ``scan_events``


def scan_events(
    data: bytes, start: int, head: bytes, tail: bytes, strip: bool, single: bool
) -> Scanned | None:
    """The ordinary token chunks of a template (``Splice.learn_template``: its ``head`` and
    ``tail``, which ends in the ids' ``[``) from ``data[start]``: each the head, a text holding
    no quote and not ending in a backslash (its closing quote could be an escaped one), the
    tail, plain ids (``ids_end``), ``]}]}\\n\\n``. ``single``: ``data`` is one such event and
    nothing else, its text maybe empty (``take_chunk``); else the run of such events with
    text from ``start`` (``take_run``). (The events as they go to the client, their ids
    nulled when ``strip``; their ids joined with commas; where they end; whether any has
    text.) None when there is none.

    The contract ``proxy/relay/_tokenscan.c`` implements in C, used when the compiled build
    is (``SCAN``): every token of an eligible stream goes through it. This is its reference
    (``tests/test_token_event.py`` holds the two to the same results) and the interpreted
    gateway's scan."""
    n = len(data)
    if start < 0 or start > n or not tail.endswith(b"["):
        return None
    h = len(head)
    a = len(tail)
    kept: list[bytes] = []  # each event up to its ids' list, "[" excluded
    lists: list[bytes] = []  # the ids inside each list, when there are any
    stop = start
    text = False
    while data.startswith(head, stop):
        k0 = stop + h
        k = data.find(b'"', k0)  # the text's end
        if k < 0 or (k > k0 and data[k - 1] == 0x5C) or not data.startswith(tail, k):
            break
        i0 = k + a
        j = ids_end(data, i0, n)
        if j < 0 or not data.startswith(_TOKEN_CHUNK_END, j):
            break
        if single:
            if stop != 0 or j + len(_TOKEN_CHUNK_END) != n:
                return None  # a read of more than the one event
        elif k == k0:
            break  # a run holds texts: an empty one is parsed
        if j > i0:
            lists.append(data[i0:j])
        kept.append(data[stop : i0 - 1])
        text = text or k > k0
        stop = j + len(_TOKEN_CHUNK_END)
        if single:
            break
    if not kept:
        return None
    out = _NULLED_END.join([*kept, b""]) if strip else data[start:stop]
    return out, b",".join(lists), stop, text


def take_token(
    data: bytes, head: bytes, tail: bytes, strip: bool, lists: list[Any]
) -> bytes | None:
    """``scan_events(data, 0, head, tail, strip, True)`` of a read that is one token chunk
    with text, as the relay meets one for every token: its ids (when there are any) added to
    ``lists``, to the bytearray that ends it (comma-joined, as ``scan_events`` joins a run's)
    or in a new one, and the event as the client gets it returned. None when the read is not
    such a chunk (a chunk without text included: ``scan_events`` takes that one).

    The contract of ``_tokenscan.take`` (``TAKE``), which makes nothing but the event: no
    tuple, no int (``tests/test_token_event.py`` holds the two to the same results)."""
    got = scan_events(data, 0, head, tail, strip, True)
    if got is None or not got[3]:
        return None
    ids = got[1]
    if ids:
        # Token after token, one growing bytearray: a list entry per token was an object
        # made and freed per token (callgrind: about a sixth of the eligible stream's extra).
        last = lists[-1] if lists else None
        if type(last) is bytearray:
            last += b"," + ids
        else:
            lists.append(bytearray(ids))
    return got[0]


def _native_scan() -> Callable[[bytes, int, bytes, bytes, bool, bool], Scanned | None]:
    """``scan_events`` in C when the compiled build is in use (``proxy/compiled.py`` finds
    ``proxy.relay._tokenscan`` in it), else in Python."""
    try:
        from proxy.relay._tokenscan import scan
    except ImportError:
        return scan_events
    return scan


def _native_take() -> Callable[[bytes, bytes, bytes, bool, list[Any]], bytes | None]:
    """``take_token`` in C with the compiled build, as ``_native_scan``."""
    try:
        from proxy.relay._tokenscan import take
    except ImportError:
        return take_token
    return take


def _native_role() -> Callable[[bytes, bytes, bytes, bytes], tuple[str, int, int, int, int] | None]:
    """``match_role`` in C with the compiled build, as ``_native_scan``."""
    try:
        from proxy.relay._tokenscan import role
    except ImportError:
        return match_role
    return role


SCAN: Final = _native_scan()
TAKE: Final = _native_take()
ROLE: Final = _native_role()


class Splice:
    """One continuable stream: its identity, the ids so far and the seams made.

    ``ids`` are every generated id; ``text_ids`` how many of them ended in a chunk that
    carried text (or finished): a trailing id without text (the first bytes of a character
    spanning several ids) was never shown, so it is regenerated rather than replayed.

    Both are read only at a seam or the end, so each chunk's ids are kept as they came
    (``lists``) and decoded when read: a token chunk then costs a slice and an append, not
    an ``int`` (about 0.6 µs a chunk in the gateway under 256 paced streams); tokens with
    text taken one after another (``take_token``) share one bytearray."""

    __slots__ = (
        "_cut",
        "_decoded",
        "_prompt",
        "body",
        "client_wants_ids",
        "created",
        "deadline",
        "failure",
        "finish_reason",
        "finishes",
        "guessed",
        "head",
        "id",
        "kind",
        "lists",
        "malformed",
        "max_tokens",
        "model",
        "reasoning_open",
        "relayed",
        "seams",
        "shapes",
        "shown",
        "system_fingerprint",
        "tail",
        "tool_call",
        "wants_usage",
    )

    def __init__(
        self, kind: str, body: dict[str, Any], wants_usage: bool, shapes: Shapes | None = None
    ) -> None:
        self.kind = kind
        self.shapes = shapes  # the relay's templates: this stream's made from them, and kept
        self.body = body
        self.wants_usage = wants_usage
        self.client_wants_ids = body.get("return_token_ids") is True
        mt = body.get("max_completion_tokens")
        if mt is None:
            mt = body.get("max_tokens")
        if mt is None and kind == "completion":
            mt = 16  # vLLM's default on /v1/completions
        self.max_tokens: int | None = mt if isinstance(mt, int) else None
        # The prompt's ids: the bytes inside their list as ``parse`` cut them, decoded when
        # first read (``prompt_ids``), or the list of a chunk parsed whole.
        self._prompt: bytes | list[int] | None = None
        # Where ``parse`` cut the prompt's ids out of the event it last parsed (their list's
        # inside), until ``learn_role`` reads it: None when it cut none.
        self._cut: tuple[int, int] | None = None
        # Each chunk's ids as noted: the bytes inside its list ("12" or "12,13", checked as
        # vLLM writes ids) for a chunk read unparsed, the list itself for a parsed one.
        self.lists: list[bytes | bytearray | list[Any]] = []
        self.shown = 0  # how many of ``lists`` came in a chunk with text, or the finish
        # (how many lists, shown, the last bytearray's size, ids, text ids) when last decoded:
        # a seam reads them often
        self._decoded: tuple[int, int, int, list[int], int] | None = None
        self.id: Any = None
        self.created: Any = None
        self.model: Any = None
        self.system_fingerprint: Any = None
        self.finish_reason: str | None = None
        self.reasoning_open = False
        self.tool_call = False
        self.malformed = False  # a chunk of another shape was seen: no continuation
        self.seams: list[dict[str, Any]] = []
        self.deadline: float | None = None  # the request's, event loop time
        self.failure: FailureKind | None = None  # the first replica's, told to the fleet
        self.head: bytes | None = None  # the stream's token-chunk template (learn_template)
        self.tail = b""
        self.guessed = False  # ``head`` made from ``shapes``, no chunk taken with it yet
        self.finishes: FinishTails = []  # the finish tails of ``head`` (``learn_finish``)
        # An attempt's relay took it: a retry before anything was sent starts from a new one.
        self.relayed = False

    # -- the first segment -----------------------------------------------------------------

    def parse(self, event: bytes) -> tuple[Any, bytes]:
        """``sse.parse_event`` of one of this stream's events, the prompt ids it carries cut
        out unparsed (noted while none are, else dropped) and null in what it returns; and
        the event as the client gets it (its prompt ids null unless the client asked)."""
        # An earlier event's cut, never noted (an error relayed after the start), is not this
        # one's: ``learn_role`` reads the cut of the event it is given.
        self._cut = None
        if event == _DONE_EVENT:
            return sse.DONE, event  # as vLLM ends every stream: told without a parse
        n = len(event)
        at = FIND(event, _PROMPT_IDS, 0, n)
        if at >= 0:
            start = at + len(_PROMPT_IDS)
            end = FIND(event, b"]", start, n)
            # On the event's first line (vLLM writes an event as one), with no "[" or quote
            # inside, the first "]" ends the list; with the key nowhere else, the null in the
            # parsed object is this list's. Whether what is inside is ids (or even JSON) is
            # judged when a seam decodes it: if not, the seam is refused (``no_ids``).
            if (
                end > 0
                and FIND(event, b"\n", 0, end) < 0
                and FIND(event, b"[", start, end) < 0
                and FIND(event, b'"', start, end) < 0
                and FIND(event, _PROMPT_KEY, 0, at) < 0
                and FIND(event, _PROMPT_KEY, end, n) < 0
            ):
                nulled = event[:at] + _PROMPT_NULL + event[end + 1 :]
                obj = sse.parse_event(nulled)
                if _cut_where_vllm_puts_them(obj):
                    if self._prompt is None:
                        self._prompt = event[start:end]
                        self._cut = (start, end)
                    return obj, event if self.client_wants_ids else nulled
        return sse.parse_event(event), event

    def _made(self, made: tuple[bytes, bytes, FinishTails] | None) -> None:
        """Take the template ``Shapes`` made for this stream, if any, until a chunk confirms it."""
        if made is not None:
            self.head, self.tail, self.finishes = made
            self.guessed = True

    @property
    def prompt_ids(self) -> list[int] | None:
        """The prompt's ids (None until a chunk brought them, or when they were not ids)."""
        p = self._prompt
        if isinstance(p, bytes):
            p = self._prompt = decode_ids(p)
        return p

    def observe(self, obj: dict[str, Any]) -> Trigger | None:
        """Note one chunk of the stream (first segment or continuation); ``ABORT`` when it
        is the engine's abort ending, which is not relayed and of whose choice nothing is
        noted (so a reader that hands such a chunk on may let the next observe it again)."""
        if self.id is None:
            self.id = obj.get("id")
            self.created = obj.get("created")
            self.model = obj.get("model")
            shapes = self.shapes
            if shapes is not None and self.head is None:
                self._made(shapes.made(self.kind, self.model, self.id, self.created))
        fp = obj.get("system_fingerprint")
        if fp is not None and self.system_fingerprint is None:
            self.system_fingerprint = fp
        top = obj.get("prompt_token_ids")
        if isinstance(top, list) and self._prompt is None:
            self._prompt = _ids_or_none(top)
        choices = obj.get("choices")
        if not choices:
            return None
        choice = choices[0]
        if not isinstance(choice, dict):
            # Not vLLM's shape: relayed, but its ids can no longer be trusted (and, narrowed
            # below, ``get`` compiles to the dict's own).
            self.malformed = True
            return None
        if self._prompt is None:
            p = choice.get("prompt_token_ids")  # completions put them on the choice
            if isinstance(p, list):
                self._prompt = _ids_or_none(p)
        finish = choice.get("finish_reason")
        if finish == "abort":
            return Trigger.ABORT
        ids = choice.get("token_ids")
        if isinstance(ids, list) and ids:
            self.lists.append(list(ids))  # a copy: the parsed chunk is the caller's
        text = choice.get("text")
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if delta.get("tool_calls"):
                self.tool_call = True
            if delta.get("reasoning_content") or delta.get("reasoning"):
                self.reasoning_open = True
            text = delta.get("content")
        if text:
            self.reasoning_open = False
            self.shown = len(self.lists)
        if finish is not None:
            self.finish_reason = finish
            self.shown = len(self.lists)
        return None

    @property
    def ids(self) -> list[int]:
        """Every generated id so far."""
        return list(self._decode()[0])

    @property
    def text_ids(self) -> int:
        """How many of ``ids`` ended in a chunk with text (or the finish)."""
        return self._decode()[1]

    def _decode(self) -> tuple[list[int], int]:
        # A seam reads ``text_ids`` several times with nothing noted in between: decoded once.
        lists = self.lists
        n, shown = len(lists), self.shown
        # A bytearray at the end grows as tokens are taken (``take_token``): its size is
        # part of what was decoded.
        grown = len(lists[-1]) if n and isinstance(lists[-1], bytearray) else -1
        memo = self._decoded
        if memo is not None and memo[0] == n and memo[1] == shown and memo[2] == grown:
            return memo[3], memo[4]
        ids: list[int] = []
        text = 0
        for i, one in enumerate(lists):
            if i == shown:
                text = len(ids)
            if isinstance(one, (bytes, bytearray)):
                ids.extend(map(int, one.split(b",")))
            else:
                ids.extend(one)
        if shown >= n:
            text = len(ids)
        self._decoded = (n, shown, grown, ids, text)
        return ids, text

    def learn_template(self, event: bytes, obj: dict[str, Any]) -> None:
        """Take this stream's token-chunk head and tail from ``event`` (parsed as ``obj``)
        when it is an ordinary token chunk whose text holds no quote or backslash."""
        at = self._token_shape(event, obj, None)
        if at is None:
            return
        start, end, ids_at = at
        self.head = event[:start]
        self.tail = event[end : ids_at + len(_TOKEN_IDS)]
        self.guessed = False
        self.finishes = []  # a new template's: none learned with it yet
        if self.shapes is not None:
            self.shapes.learn(
                self.kind, obj.get("model"), obj.get("id"), obj.get("created"), self.head,
                self.tail, self.finishes,
            )  # fmt: skip

    def learn_finish(self, event: bytes, obj: dict[str, Any]) -> None:
        """Keep the tail of ``event``, this stream's finish (parsed as ``obj`` and observed),
        when it is its template's head, a text and a tail as a token chunk's but for the
        finish: the next finish of these bytes is taken unparsed (``take_finish``)."""
        reason = self.finish_reason
        head = self.head
        if head is None or self.guessed or reason is None:
            return
        if len(self.finishes) >= _FINISH_TAILS_KEPT:
            return
        if not event.startswith(head):
            return
        at = self._token_shape(event, obj, reason)
        if at is None or at[0] != len(head):
            return
        tail = event[at[1] : at[2] + len(_TOKEN_IDS)]
        if len(head) + len(tail) > _SHAPE_BYTES or not _names_absent(tail, 0, len(tail)):
            return
        for kept, _ in self.finishes:
            if kept == tail:
                return
        self.finishes.append((tail, reason))

    def _token_shape(
        self, event: bytes, obj: dict[str, Any], finish: str | None
    ) -> tuple[int, int, int] | None:
        """Where ``event`` (parsed as ``obj``) has its text (start, end) and its last
        ``"token_ids":[``, when it is an ordinary token chunk (``finish`` None) or a finish for
        that reason, one choice, its text holding no quote or backslash; else None."""
        # The bytes first: the role chunk, met by every stream, leaves at its prompt ids.
        if not event.endswith(_TOKEN_END):
            return None
        n = len(event)
        if FIND(event, _PROMPT_IDS, 0, n) >= 0:
            return None  # the first chunk, its ids nulled by ``parse``: no later chunk has them
        if not _keys_within(obj, _TOP_KEYS):
            return None
        choices = obj.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return None
        choice = choices[0]
        if not isinstance(choice, dict):  # checked above: narrowed here, for the dict's ``get``
            return None
        if not _keys_within(choice, _CHOICE_KEYS) or not isinstance(choice.get("token_ids"), list):
            return None
        if finish is None:
            if any(choice.get(k) is not None for k in _NULL_KEYS):
                return None
        elif finish == "abort" or choice.get("finish_reason") != finish:
            return None  # an abort is decided on, never relayed unparsed
        elif choice.get("logprobs") is not None or choice.get("prompt_token_ids") is not None:
            return None
        elif not isinstance(choice.get("stop_reason"), (str, int, type(None))):
            return None  # a scalar stop_reason stays in the tail's bytes; a list or object
            # could hold ids the scan would not null
        delta = choice.get("delta")
        if self.kind == "chat":
            if not isinstance(delta, dict) or len(delta) != 1 or "content" not in delta:
                return None
        elif "delta" in choice:
            return None  # a completion's delta is read by ``observe`` (its content, reasoning)
        mark = _TEMPLATE_MARK[self.kind]
        start = FIND(event, mark, 0, n)
        if start < 0:
            return None
        start += len(mark)
        end = FIND(event, b'"', start, n)
        ids_at = RFIND(event, _TOKEN_IDS, 0, n)
        if end < 0 or FIND(event, b"\\", start, end) >= 0 or ids_at < end:
            return None
        return start, end, ids_at

    def learn_role(self, event: bytes, obj: dict[str, Any]) -> None:
        """Keep ``event``, this stream's first chunk (parsed as ``obj``, its prompt ids cut out
        by ``parse``, observed), as the first chunk of the next stream whose request names
        this model (``take_role``), when it notes nothing but the stream's identity and the
        prompt: no text, ids, finish, usage or tool call, and its id and created where
        ``_identity`` finds them, before the prompt's ids."""
        cut = self._cut
        if cut is None:
            return  # the event cut no prompt ids: not a first chunk
        self._cut = None
        shapes = self.shapes
        asked = self.body.get("model")
        if shapes is None or not isinstance(asked, str):
            return
        if isinstance(obj.get("usage"), dict) or sse.carries_content(obj):
            return
        choices = obj.get("choices")
        if not isinstance(choices, list) or len(choices) != 1:
            return
        choice = choices[0]
        if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
            return
        ids = choice.get("token_ids")
        if (ids is not None and ids != []) or choice.get("text"):
            return
        model = obj.get("model")
        at = _identity(event, obj.get("id"), created := obj.get("created"))
        if at is None or not isinstance(model, str) or type(created) is not int:
            return
        q, digits, digits_end = at
        start, end = cut
        key = start - len(_PROMPT_IDS)
        if key < digits_end:
            return  # the prompt's ids before the created: not a shape vLLM writes
        nulled = event[:key] + _PROMPT_NULL + event[end + 1 :]
        shown = strip_ids(nulled)
        if not shown.startswith(nulled[: key + len(_PROMPT_NULL)]):
            return
        role = RoleShape(event[q:digits], event[digits_end:start], event[end:],
                         shown[key:] + b"\n\n", model, obj.get("system_fingerprint"))  # fmt: skip
        size = len(role.before_created) + len(role.between) + len(role.after)
        if size + len(role.null_after) <= _SHAPE_BYTES:
            shapes.learn_role(self.kind, asked, role)

    def take_known(self, event: bytes, strip: bool) -> tuple[bytes, bool] | None:
        """An event split from a read that is the first chunk (``take_role``) or a finish
        (``take_finish``) of bytes met before: (the event as the client gets it, whether it
        carries content). None when it is to be parsed."""
        if self.id is None:
            role = self.take_role(event, strip)
            return None if role is None else (role, False)
        head = self.head
        if head is None or not self.finishes or not event.startswith(head):
            return None  # not even the event's copy with its end
        return self.take_finish(event + b"\n\n", strip)

    def take_role(self, event: bytes, strip: bool) -> bytes | None:
        """Note ``event`` when it is this stream's first chunk and has the bytes of the last
        first chunk kept for its model (``learn_role``) around its own id, created and prompt
        ids, as ``parse``, ``observe`` and the relay note it, without parsing it: the event as
        the client gets it (``\\n\\n`` ended, its ids null when ``strip``). None when it is
        not one: it is parsed."""
        shapes = self.shapes
        if shapes is None or self.id is not None or self._prompt is not None:
            return None
        if strip is self.client_wants_ids:
            return None  # the relay strips what the client did not ask for: the other ways, parsed
        asked = self.body.get("model")
        if not isinstance(asked, str):
            return None
        role = shapes.role(self.kind, asked)
        if role is None:
            return None
        got = ROLE(event, role.before_created, role.between, role.after)
        if got is None:
            return None
        chunk_id, created, q, digits_end, start = got
        self.id = chunk_id
        self.created = created
        self.model = role.model
        if self.head is None:
            # The id's bytes hold no quote (``q`` is the first), backslash or control byte
            # and the created's are an int as JSON writes it (``match_role``): both as
            # ``_plain_id`` and ``_plain_created`` would make them again.
            digits = q + len(role.before_created)
            raw_id = event[len(_ID_AT) : q]
            self._made(shapes.made_of(self.kind, role.model, raw_id, event[digits:digits_end]))
        if role.fingerprint is not None and self.system_fingerprint is None:
            self.system_fingerprint = role.fingerprint
        self._prompt = event[start : len(event) - len(role.after)]
        if self.client_wants_ids:
            return event + b"\n\n"
        return event[: start - len(_PROMPT_IDS)] + role.null_after

    def take_finish(self, chunk: bytes, strip: bool) -> tuple[bytes, bool] | None:
        """``take_chunk`` of a finish of one of the tails kept with this stream's template
        (``learn_finish``): noted as ``observe`` notes it, without parsing it (its ids, its
        text shown, the reason). None when it is not one."""
        head = self.head
        finishes = self.finishes
        if not finishes or head is None or self.guessed or not chunk.startswith(head):
            return None
        for tail, reason in finishes:
            got = SCAN(chunk, 0, head, tail, strip, True)
            if got is not None:
                out, ids, _, text = got
                self._note_scanned(ids, text)
                self.finish_reason = reason
                self.shown = len(self.lists)  # as ``observe`` notes a finish, text or none
                return out, text
        return None

    def take_chunk(self, chunk: bytes, strip: bool) -> tuple[bytes, bool] | None:
        """Note a read that is one whole event, its ``\\n\\n`` included, when it is an
        ordinary token chunk of the learned template, as ``observe`` would note it without
        parsing it: (the event as it goes to the client, its ids nulled when ``strip``;
        whether it holds text). None when it is not one (a read that stops short of its
        ``\\n\\n`` is not: its end may still come): it is to be parsed. It runs for every
        token, in the upstream connection's callback: ``scan_events``, in C when built."""
        head = self.head
        if head is None:
            return None
        got = SCAN(chunk, 0, head, self.tail, strip, True)
        if got is None:
            return None
        out, ids, _, text = got
        self._note_scanned(ids, text)
        return out, text

    def take_token(self, chunk: bytes, strip: bool) -> bytes | None:
        """``take_chunk`` of a read that is one token chunk with text, the relay's every
        token: the event as it goes to the client, or None (then ``take_chunk`` or a parse
        decides). Only the event is made (``TAKE``)."""
        head = self.head
        if head is None:
            return None
        out = TAKE(chunk, head, self.tail, strip, self.lists)
        if out is not None:
            self.reasoning_open = False
            self.shown = len(self.lists)
            self.guessed = False
        return out

    def take_event(self, event: bytes, strip: bool) -> tuple[bytes, bool] | None:
        """``take_chunk`` of an event split from a read, without its ``\\n\\n``."""
        if self.head is None:
            return None  # no template yet: not even the event's copy with its end
        return self.take_chunk(event + b"\n\n", strip)

    def take_run(self, data: bytes, start: int, strip: bool) -> tuple[bytes, int] | None:
        """The ordinary token chunks with text that follow one another in ``data`` from
        ``start`` (an event's start), noted as ``take_event`` notes each: (the events as they
        go to the client, ``\\n\\n`` ended and ids nulled when ``strip``; where they end). None
        when the event at ``start`` is not one. Their ids are one noted list."""
        head = self.head
        if head is None:
            return None
        got = SCAN(data, start, head, self.tail, strip, False)
        if got is None:
            return None
        out, ids, stop, _ = got
        self._note_scanned(ids, True)  # a run is of chunks with text
        return out, stop

    def _note_scanned(self, ids: bytes, text: bool) -> None:
        """What ``observe`` notes of an ordinary token chunk: its ids, and, when it shows
        text, that the client has seen them (and that no reasoning is open)."""
        if ids:
            self.lists.append(ids)
        if text:
            self.reasoning_open = False
            self.shown = len(self.lists)
        self.guessed = False

    # -- the seam --------------------------------------------------------------------------

    def refusal(self, max_attempts: int, max_seq_len: int) -> Refusal | None:
        """Why the stream, failed now, cannot be continued; None when it can."""
        if self.malformed:
            return Refusal.MALFORMED
        if self.tool_call:
            return Refusal.TOOLS
        if self.reasoning_open:
            return Refusal.REASONING
        if self.prompt_ids is None:
            return Refusal.NO_IDS
        if len(self.prompt_ids) + self.text_ids > max_seq_len:
            return Refusal.SEQ_LEN
        if len(self.seams) >= max_attempts:
            return Refusal.LIMIT
        return None

    def exhausted(self) -> bool:
        """Every allowed token was generated: the gateway finishes with ``length`` itself."""
        return self.max_tokens is not None and self.text_ids >= self.max_tokens

    @property
    def replay_tokens(self) -> int:
        """Tokens a continuation now would prefill: the prompt and the ids the client saw."""
        return len(self.prompt_ids or ()) + self.text_ids

    def continuation_body(self, model: str | None) -> dict[str, Any]:
        """The ``/v1/completions`` request that goes on from the last id the client saw."""
        assert self.prompt_ids is not None
        del self.lists[self.shown :]  # ids that produced no text yet are regenerated
        self._decoded = None  # the memo's key (lengths) cannot tell a list cut and refilled
        remaining = None if self.max_tokens is None else self.max_tokens - self.text_ids
        out: dict[str, Any] = {
            "model": model if model is not None else self.model,
            "prompt": self.prompt_ids + self.ids,
            "max_tokens": remaining,  # null lifts the completions default of 16
            "stream": True,
            "return_token_ids": True,
        }
        if self.wants_usage:
            out["stream_options"] = {"include_usage": True}
        for key in SAMPLING_KEYS:
            if key in self.body:
                out[key] = self.body[key]
        mn = self.body.get("min_tokens")
        if isinstance(mn, int) and mn > 0:
            out["min_tokens"] = max(0, mn - self.text_ids)
        return out

    def splice(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """A continuation chunk as the client's stream carries it; None to drop it."""
        out: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
        }
        choices = obj.get("choices")
        usage = obj.get("usage")
        if not choices:
            if not isinstance(usage, dict) or not self.wants_usage:
                return None
            out["choices"] = []
            out["usage"] = self.usage()
            if self.system_fingerprint is not None:
                out["system_fingerprint"] = self.system_fingerprint
            return out
        c = choices[0]
        ids = c.get("token_ids") if self.client_wants_ids else None
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["delta"] = {"content": c.get("text") or ""}
            choice["logprobs"] = None
        else:
            choice["text"] = c.get("text") or ""
            choice["logprobs"] = None
        choice["finish_reason"] = c.get("finish_reason")
        choice["stop_reason"] = c.get("stop_reason")
        choice["token_ids"] = ids
        out["choices"] = [choice]
        return out

    def take(self, ev: bytes) -> tuple[bytes, Trigger | None, bool, bool, str]:
        """One event of a continuation: (bytes for the client, the trigger when it failed,
        whether it was ``[DONE]``, whether it carried content, the words for a failure)."""
        obj = self.parse(ev)[0]
        if obj is sse.DONE:
            return b"data: [DONE]\n\n", None, True, False, ""
        if not isinstance(obj, dict):
            if sse.event_data(ev) is None:
                return b"", None, False, False, ""  # a comment
            return b"", Trigger.ERROR_EVENT, False, False, "a chunk that is not JSON"
        if sse.is_error(obj):
            err = obj.get("error")
            msg = err.get("message", "") if isinstance(err, dict) else err
            return b"", Trigger.ERROR_EVENT, False, False, f"error event: {str(msg)[:200]}"
        if self.observe(obj) is Trigger.ABORT:
            return b"", Trigger.ABORT, False, False, "the engine aborted it"
        out = self.splice(obj)
        if out is None:
            return b"", None, False, False, ""
        return event(out), None, False, sse.carries_content(out), ""

    def usage(self) -> dict[str, int]:
        """The whole answer's usage: the original prompt, every generated token."""
        p = len(self.prompt_ids or ())
        g = len(self.ids)
        return {"prompt_tokens": p, "total_tokens": p + g, "completion_tokens": g}

    def length_ending(self) -> list[dict[str, Any]]:
        """The chunks that finish an answer whose max tokens were all generated."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "stop_reason": None}
        if self.kind == "chat":
            choice["delta"] = {"content": ""}
        else:
            choice["text"] = ""
        choice["logprobs"] = None
        head = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
        }
        out = [{**head, "choices": [choice]}]
        if self.wants_usage:
            out.append({**head, "choices": [], "usage": self.usage()})
        return out


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=_COMPACT).encode() + b"\n\n"


def error_code(obj: dict[str, Any]) -> int:
    """The code of an in-band error event (500 when it names none)."""
    err = obj.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    try:
        return int(code) if code is not None else 500
    except (TypeError, ValueError):
        return 500


KEEPALIVE = b": keep-alive\n\n"
