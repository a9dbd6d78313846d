"""What a request costs: its profile, from one walk over the parsed body.

Pure functions over the parsed body; no I/O. This runs for every request, so it walks the body
once, counts characters with ``len`` (O(1) on ``str``), and never serialises the body: only
``tools`` are dumped to JSON, because that is how a chat template renders them.

Estimate of prompt tokens::

    ceil(text_chars / chars_per_token)            # message text, tool calls, tool definitions
    + 4 per message + 3                           # chat template framing and the reply primer
    + image_tokens per image part                 # estimate.image_tokens
    + VIDEO_IMAGES * image_tokens per video part
    + audio tokens per audio part                 # see _audio_tokens
    + exact count of token-id prompts             # completions with ids need no estimate

``chars_per_token`` starts at ``estimate.chars_per_token`` and is learned per model from the
``usage.prompt_tokens`` that replicas report (``proxy.routing.estimate.Estimator``); which lane
the profile takes is ``proxy.routing.lanes``.

Length: one job, the one walk over the body shapes of every classified API (chat, completions,
Messages, Responses, ...), a short function per shape.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol, cast

from proxy.config import LaneConfig, Policy
from proxy.routing.tokens import TokenCounter

Kind = Literal["chat", "completion", "messages", "responses"]


# Chat templates wrap each message in a few special tokens (ChatML: "<|im_start|>role\n...
# <|im_end|>\n" is 4-5) and end with the assistant's opening; OpenAI's cookbook counts 3 + 3.
MESSAGE_OVERHEAD_TOKENS: Final = 4
CHAT_OVERHEAD_TOKENS: Final = 3
# A text prompt to /v1/completions gets a BOS token from most tokenizers.
COMPLETION_PROMPT_OVERHEAD_TOKENS: Final = 1

# Audio: encoders behind vLLM's audio models emit ~25 tokens per second (Whisper's 50 frames/s
# pooled by 2, as in Qwen2-Audio). Duration is guessed from the encoded size at 16 kB/s
# (128 kbit/s MP3, or 8 kHz 16-bit WAV): 16 kHz WAV is over-counted 2x, which errs towards the
# "long" lanes, the safe side. A base64 character carries 3/4 of a byte, so one token per
# ~853 base64 characters. An audio part given only by URL counts as Whisper's 30 s window.
AUDIO_TOKENS_PER_S: Final = 25
AUDIO_BYTES_PER_S: Final = 16_000
AUDIO_URL_TOKENS: Final = 30 * AUDIO_TOKENS_PER_S
# A video part counts as this many images (a few sampled frames); its real cost is unknowable
# without decoding it, and a low guess would put it on a latency lane.
VIDEO_IMAGES: Final = 8

_CHAT_LIKE: Final = frozenset({"chat", "messages", "responses"})
_IMAGE_PARTS: Final = frozenset({"image_url", "input_image", "image", "image_pil", "image_embeds"})
_AUDIO_PARTS: Final = frozenset({"input_audio", "audio_url", "audio"})
_VIDEO_PARTS: Final = frozenset({"video_url", "video"})


@dataclass(frozen=True, slots=True)
class Profile:
    """What the router knows about a request before choosing where it goes."""

    kind: Kind
    model: str | None
    stream: bool
    prompt_chars: int  # text characters counted for the estimate (tool definitions included)
    prompt_tokens_est: int
    output_tokens: int | None  # request's max x n x batch; None when it names no max
    n: int
    images: int
    prompt_head: str  # start of the rendered prompt: the prefix-affinity key (see affinity_key)
    batch: int = 1  # prompts in a /v1/completions batch; each generates n sequences
    audios: int = 0
    videos: int = 0
    # The part of prompt_tokens_est not derived from characters (template framing, media,
    # token-id prompts): what the learner subtracts from reported usage.
    fixed_tokens: int = 0

    # Written out rather than generated: compiled, the dataclass's generated (frozen)
    # ``__init__`` stays interpreted, 1 µs and more a request against tens of nanoseconds
    # here (``docs/benchmarks.md``, "Per request, what stayed interpreted").
    def __init__(
        self,
        kind: Kind,
        model: str | None,
        stream: bool,
        prompt_chars: int,
        prompt_tokens_est: int,
        output_tokens: int | None,
        n: int,
        images: int,
        prompt_head: str,
        batch: int = 1,
        audios: int = 0,
        videos: int = 0,
        fixed_tokens: int = 0,
    ) -> None:
        # Frozen: past its __setattr__ as the generated one goes.
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "stream", stream)
        object.__setattr__(self, "prompt_chars", prompt_chars)
        object.__setattr__(self, "prompt_tokens_est", prompt_tokens_est)
        object.__setattr__(self, "output_tokens", output_tokens)
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "images", images)
        object.__setattr__(self, "prompt_head", prompt_head)
        object.__setattr__(self, "batch", batch)
        object.__setattr__(self, "audios", audios)
        object.__setattr__(self, "videos", videos)
        object.__setattr__(self, "fixed_tokens", fixed_tokens)


class Rates(Protocol):
    """What profiling needs from the learner (``proxy.routing.estimate.Estimator``): a protocol,
    so that the profile does not depend on how the ratios are learned."""

    image_tokens: int
    counter: TokenCounter | None

    def ratio(self, model: str | None) -> float:
        """Characters per token for ``model``."""
        ...


def _audio_tokens(part: dict[str, Any]) -> int:
    """Tokens of one audio part from its encoded size (see AUDIO_* above)."""
    data: Any = None
    inner = part.get("input_audio")
    if isinstance(inner, dict):
        data = inner.get("data")
    else:
        inner = part.get("audio_url")
        if isinstance(inner, dict):
            url = inner.get("url")
            if type(url) is str and url.startswith("data:"):
                data = url
    if type(data) is not str:
        return AUDIO_URL_TOKENS
    seconds = len(data) * 0.75 / AUDIO_BYTES_PER_S
    return max(1, math.ceil(seconds * AUDIO_TOKENS_PER_S))


def _tool_calls_chars(tool_calls: list[Any], texts: list[str] | None) -> int:
    """Characters of an assistant message's tool calls (function names and JSON arguments);
    the texts themselves go to ``texts`` when a tokenizer counts them."""
    chars = 0
    for call in tool_calls:
        if type(call) is not dict:
            continue
        fn = call.get("function")
        if type(fn) is dict:
            for text in (fn.get("name"), fn.get("arguments")):
                if type(text) is str:
                    chars += len(text)
                    if texts is not None:
                        texts.append(text)
    return chars


def _json_chars(value: Any, texts: list[str] | None) -> int:
    text = _dump(value)
    if texts is not None:
        texts.append(text)
    return len(text)


def _profile_chat(
    body: dict[str, Any], max_prefix_chars: int, texts: list[str] | None = None
) -> tuple[int, int, int, int, int, int, str]:
    """(chars, messages, images, audio parts, audio tokens, videos, head) of a chat body; each
    text counted is also added to ``texts`` when it is given (for a tokenizer).

    The head renders messages in order as ``role\\ncontent\\n`` (text parts only), so requests
    that share a system prompt share a head whatever follows it.
    """
    chars = nmsg = images = audios = audio_tokens = videos = 0
    head: list[str] = []
    room = max_prefix_chars  # characters of head still wanted; pieces are cut to fit
    messages = body.get("messages")
    if type(messages) is not list:
        messages = []
    for msg in messages:
        if type(msg) is not dict:
            continue
        nmsg += 1
        if room > 0:
            role = msg.get("role")
            piece = f"{role}\n" if type(role) is str else "\n"
            head.append(piece[:room])
            room -= len(piece)
        content = msg.get("content")
        if type(content) is str:
            chars += len(content)
            if texts is not None:
                texts.append(content)
            if room > 0:
                head.append(content[:room])
                room -= len(content)
        elif type(content) is list:
            for part in content:
                if type(part) is dict:
                    text = part.get("text")
                    if type(text) is str:
                        chars += len(text)
                        if texts is not None:
                            texts.append(text)
                        if room > 0:
                            head.append(text[:room])
                            room -= len(text)
                        continue
                    ptype = part.get("type")
                    if ptype in _IMAGE_PARTS:
                        images += 1
                    elif ptype in _AUDIO_PARTS:
                        audios += 1
                        audio_tokens += _audio_tokens(part)
                    elif ptype in _VIDEO_PARTS:
                        videos += 1
                elif type(part) is str:
                    chars += len(part)
                    if texts is not None:
                        texts.append(part)
                    if room > 0:
                        head.append(part[:room])
                        room -= len(part)
        tool_calls = msg.get("tool_calls")
        if type(tool_calls) is list:
            chars += _tool_calls_chars(tool_calls, texts)
        if room > 0:
            head.append("\n")
            room -= 1
    tools = body.get("tools")
    if tools:
        chars += _json_chars(tools, texts)
    functions = body.get("functions")  # the deprecated spelling of tools
    if functions:
        chars += _json_chars(functions, texts)
    return chars, nmsg, images, audios, audio_tokens, videos, "".join(head)


def _ids_head(ids: list[Any], max_prefix_chars: int) -> str:
    # About the token span of a text head (~4 characters a token), written as decimal text.
    # repr of the slice is the cheapest rendering (C); joining str()s costs twice as much.
    return repr(ids[: max_prefix_chars // 4 + 1])[1:-1][:max_prefix_chars]


def _profile_completion(
    body: dict[str, Any], max_prefix_chars: int, texts: list[str] | None = None
) -> tuple[int, int, int, str]:
    """(chars, exact tokens, batch, head) of a completions body; text prompts also go to
    ``texts`` when it is given.

    ``prompt`` is a string, a list of strings (a batch), a list of token ids, or a list of
    id lists (a batch); the head is taken from the first prompt.
    """
    prompt = body.get("prompt")
    if type(prompt) is str:
        if texts is not None:
            texts.append(prompt)
        return len(prompt), 0, 1, prompt[:max_prefix_chars]
    if type(prompt) is not list or not prompt:
        return 0, 0, 1, ""
    if type(prompt[0]) is int:  # one prompt as token ids: its length is exact
        return 0, len(prompt), 1, _ids_head(prompt, max_prefix_chars)
    chars = exact = batch = 0
    head = ""
    for item in prompt:
        if type(item) is str:
            if not batch:
                head = item[:max_prefix_chars]
            chars += len(item)
            if texts is not None:
                texts.append(item)
        elif type(item) is list:
            if not batch:
                head = _ids_head(item, max_prefix_chars)
            exact += len(item)
        else:
            continue
        batch += 1
    return chars, exact, max(batch, 1), head


def _max_tokens(body: dict[str, Any]) -> int | None:
    # max_completion_tokens supersedes max_tokens (OpenAI deprecated the latter for chat).
    # ``type(x) is int`` keeps booleans out.
    value = body.get("max_completion_tokens")
    if type(value) is int and value >= 0:
        return value
    value = body.get("max_tokens")
    if type(value) is int and value >= 0:
        return value
    return None


def _block_parts(content: Any) -> Any:
    """Anthropic content blocks / Responses content parts as chat parts: what carries text
    becomes a text part (tool inputs as their JSON, as a chat template renders them), images
    stay images, anything else is kept for the chat walk to skip."""
    if type(content) is not list:
        return content
    parts: list[Any] = []
    for block in content:
        if type(block) is not dict:
            parts.append(block)
            continue
        btype = block.get("type")
        if btype == "tool_use" or btype == "server_tool_use":
            parts.append({"type": "text", "text": _dump(block.get("input"))})
        elif btype == "tool_result":
            inner = _block_parts(block.get("content"))
            if type(inner) is str:
                parts.append({"type": "text", "text": inner})
            elif type(inner) is list:
                parts.extend(inner)
        elif btype == "thinking":
            parts.append({"type": "text", "text": block.get("thinking")})
        else:
            parts.append(block)  # text, input_text, output_text carry "text"; images counted
    return parts


def _dump(value: Any) -> str:
    """``value`` as the JSON a chat template renders; a value not from JSON (a caller's own
    object) as its repr."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def messages_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages body as the chat body vLLM renders it into: ``system`` first,
    content blocks as parts; output is ``max_tokens`` plus any thinking budget."""
    messages: list[Any] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _block_parts(system)})
    for msg in body.get("messages") or ():
        if type(msg) is dict:
            messages.append({"role": msg.get("role"), "content": _block_parts(msg.get("content"))})
    view: dict[str, Any] = {"messages": messages, "tools": body.get("tools")}
    max_tokens = body.get("max_tokens")
    thinking = body.get("thinking")
    if type(max_tokens) is int and type(thinking) is dict:
        budget = thinking.get("budget_tokens")
        if type(budget) is int and budget > 0:
            max_tokens += budget
    view["max_tokens"] = max_tokens
    return view


def _responses_item(item: Any) -> dict[str, Any] | None:
    """One Responses input item as a chat message (None: nothing to count)."""
    if type(item) is str:
        return {"role": "user", "content": item}
    if type(item) is not dict:
        return None
    itype = item.get("type")
    if itype is None or itype == "message":
        return {"role": item.get("role"), "content": _block_parts(item.get("content"))}
    if itype == "function_call_output":
        output = item.get("output")
        return {"role": "tool", "content": output if type(output) is str else _dump(output)}
    if itype == "function_call":
        return {"role": "assistant", "content": f"{item.get('name')}({item.get('arguments')})"}
    if itype == "reasoning":
        summary = item.get("summary")
        return {"role": "assistant", "content": _block_parts(summary)}
    return None


def responses_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses body as the chat body it renders into: ``instructions`` as the system
    message, then ``input`` (a string, or items: messages, tool calls and outputs). The
    conversation a ``previous_response_id`` names lives on its replica and is not counted."""
    messages: list[Any] = []
    instructions = body.get("instructions")
    if type(instructions) is str:
        messages.append({"role": "system", "content": instructions})
    value = body.get("input")
    items = [value] if type(value) is str else value if type(value) is list else []
    for item in items:
        msg = _responses_item(item)
        if msg is not None:
            messages.append(msg)
    return {
        "messages": messages,
        "tools": body.get("tools"),
        "max_tokens": body.get("max_output_tokens"),
    }


_ANTHROPIC_BLOCKS: Final = frozenset({"tool_use", "tool_result", "thinking", "document"})


def guess_kind(body: dict[str, Any]) -> Kind:
    """Which API a body was written for, from its fields (``tokenlane explain`` without
    ``--kind``): Responses by ``input`` / ``instructions`` / ``previous_response_id``,
    completions by ``prompt``, Anthropic Messages by a top-level ``system`` or its own block
    types, else chat."""
    if "input" in body or "instructions" in body or "previous_response_id" in body:
        return "responses"
    if "prompt" in body and "messages" not in body:
        return "completion"
    if "system" in body:
        return "messages"
    for msg in body.get("messages") or ():
        content = msg.get("content") if type(msg) is dict else None
        if type(content) is list and any(
            type(b) is dict and (b.get("type") in _ANTHROPIC_BLOCKS or "source" in b)
            for b in content
        ):
            return "messages"
    return "chat"


def profile_request(
    body: dict[str, Any], kind: str, estimator: Rates, max_prefix_chars: int
) -> Profile:
    """Profile a validated chat (``kind="chat"``), completions (``"completion"``), Anthropic
    Messages (``"messages"``) or Responses (``"responses"``) body; the last two are profiled
    as the chat body vLLM renders them into (``messages_as_chat``, ``responses_as_chat``).

    Odd values the validator let through (non-string parts, unknown part types) are skipped:
    what is countable is counted, nothing raises. ``max_prefix_chars`` bounds the head; give
    the largest ``prefix_chars`` of any pool (``max_prefix_chars(policy)``), since the lane and
    so the pool are not known yet.
    """
    model = body.get("model")
    if type(model) is not str:
        model = None
    n = body.get("n")
    if type(n) is not int or n < 1:
        n = 1
    counter = estimator.counter
    texts: list[str] | None = [] if counter is not None else None
    images = audios = videos = 0
    batch = 1
    view = body
    if kind == "messages":
        view = messages_as_chat(body)
    elif kind == "responses":
        view = responses_as_chat(body)
    if kind in _CHAT_LIKE:
        chars, nmsg, images, audios, audio_tokens, videos, head = _profile_chat(
            view, max_prefix_chars, texts
        )
        fixed = (
            MESSAGE_OVERHEAD_TOKENS * nmsg
            + CHAT_OVERHEAD_TOKENS
            + estimator.image_tokens * (images + VIDEO_IMAGES * videos)
            + audio_tokens
        )
    elif kind == "completion":
        chars, exact, batch, head = _profile_completion(body, max_prefix_chars, texts)
        text_prompts = batch if chars else 0
        fixed = exact + COMPLETION_PROMPT_OVERHEAD_TOKENS * text_prompts
    else:
        raise ValueError(
            f"unknown request kind {kind!r}; expected 'chat', 'completion', 'messages' or"
            " 'responses'"
        )
    if counter is not None and texts is not None:
        text_tokens = counter.count(texts)
    else:
        text_tokens = math.ceil(chars / estimator.ratio(model))
    max_tokens = _max_tokens(view)
    return Profile(
        kind=cast(Kind, kind),  # any other kind raised above
        model=model,
        stream=body.get("stream") is True,
        prompt_chars=chars,
        prompt_tokens_est=text_tokens + fixed,
        output_tokens=None if max_tokens is None else max_tokens * n * batch,
        n=n,
        images=images,
        prompt_head=head,
        batch=batch,
        audios=audios,
        videos=videos,
        fixed_tokens=fixed,
    )


def output_tokens_for(profile: Profile, lane: LaneConfig) -> int | None:
    """The request's output tokens, else the lane's ``default_output_tokens`` x n x batch."""
    if profile.output_tokens is not None:
        return profile.output_tokens
    default = lane.default_output_tokens
    if default is None:
        return None
    return default * profile.n * profile.batch


def max_prefix_chars(policy: Policy) -> int:
    """How much head to render: enough for the pool with the longest ``prefix_chars``."""
    return max(pool.prefix_chars for pool in policy.pools.values())


def affinity_key(profile: Profile, prefix_chars: int) -> str | None:
    """The pool's prefix-affinity key: the first ``prefix_chars`` of the head; None if empty."""
    head = profile.prompt_head
    if not head:
        return None
    return head if len(head) <= prefix_chars else head[:prefix_chars]
