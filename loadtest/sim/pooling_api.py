"""vLLM's remaining routes: the pooling family (``/v1/embeddings``, ``/v2/embed``, ``/pooling``,
``/classify``, ``/score``, ``/v1/score``, ``/rerank``, ``/v1/rerank``, ``/v2/rerank``), SageMaker's
``/invocations``, ``/tokenizer_info`` and ``/v1/chat/completions/batch``, in vLLM's shapes.

vLLM serves the pooling routes only for a pooling model (``vllm/entrypoints/pooling/factories.py``)
and ``/tokenizer_info`` only with ``--enable-tokenizer-info-endpoint``; the simulator serves them
for every model, so one replica can stand in for any deployment. Pooling answers are made up but
deterministic: vectors come from a keyed hash of the input's token ids (:data:`DIM` floats,
L2-normalised as vLLM normalises embeddings), so every replica and run agrees. They do not run
through the engine (the simulator models generation only): faults, metrics and the scheduler do
not see them. ``/v1/chat/completions/batch`` does: it is N chat requests in one.

Length: nine small routes of one family, a few dozen lines each, sharing the input handling (texts,
token ids, the hashed vectors); one module per route would scatter that.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from . import formats, protocol, tokenizer
from .generate import Output
from .generation import Generation
from .replica import Sim
from .scheduler import EngineRequest

DIM = 16  # the simulated embedding size: small, and a multiple of 8 for Cohere's binary types
LABELS = ("LABEL_0", "LABEL_1")  # transformers' default id2label, which Qwen2.5's config keeps
SCORE_KEYS = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)  # vLLM's ScoreRequest variants, in its order
COHERE_TYPES = ("float", "binary", "ubinary", "base64")
# Qwen2.5-0.5B-Instruct's tokenizer_config.json as vLLM reports it: init kwargs without file
# paths, and the class name of vLLM's cached wrapper around the HF tokenizer.
TOKENIZER_INFO: dict[str, Any] = {
    "add_bos_token": False,
    "add_prefix_space": False,
    "additional_special_tokens": [
        "<|im_start|>",
        "<|im_end|>",
        "<|object_ref_start|>",
        "<|object_ref_end|>",
        "<|box_start|>",
        "<|box_end|>",
        "<|quad_start|>",
        "<|quad_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|vision_pad|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ],
    "bos_token": None,
    "clean_up_tokenization_spaces": False,
    "eos_token": "<|im_end|>",
    "errors": "replace",
    "model_max_length": 131072,
    "pad_token": "<|endoftext|>",
    "split_special_tokens": False,
    "unk_token": None,
    "tokenizer_class": "CachedQwen2TokenizerFast",
}

Handler = Callable[[Request], Awaitable[Any]]


def _json(data: Any, status: int = 200) -> Response:
    return Response(formats.compact(data), status_code=status, media_type="application/json")


def _error(exc: protocol.ApiError) -> Response:
    return _json(exc.body(), exc.status)


def _rid(request: Request) -> str:
    # vLLM's PoolingServing names a request after X-Request-Id, else random_uuid().
    return request.headers.get("x-request-id") or uuid.uuid4().hex


# -- made-up numbers --------------------------------------------------------------------------


def _digest(seed: int, *parts: Sequence[int]) -> bytes:
    text = f"{seed}|" + "|".join(",".join(map(str, p)) for p in parts)
    return hashlib.blake2b(text.encode(), digest_size=2 * DIM).digest()


def vector(seed: int, ids: Sequence[int], dim: int = DIM) -> list[float]:
    """A unit vector of ``dim`` floats (a prefix of the :data:`DIM` one, renormalised, as a
    Matryoshka model's ``dimensions`` cut), stable across processes."""
    d = _digest(seed, ids)
    raw = [int.from_bytes(d[2 * i : 2 * i + 2], "little") / 32767.5 - 1.0 for i in range(dim)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]


def score(seed: int, query: Sequence[int], doc: Sequence[int]) -> float:
    """A relevance in (0, 1): mostly shared tokens, so a document that repeats the query's words
    ranks first, plus a little hash so ties differ."""
    q, d = set(query), set(doc)
    overlap = len(q & d) / len(q | d) if q | d else 0.0
    noise = int.from_bytes(_digest(seed, query, doc)[:8], "little") / 2**64
    return round(0.05 + 0.85 * overlap + 0.1 * noise, 6)


def probs(seed: int, ids: Sequence[int]) -> list[float]:
    a, b = vector(seed, ids)[:2]
    ea, eb = math.exp(3 * a), math.exp(3 * b)
    return [round(ea / (ea + eb), 6), round(eb / (ea + eb), 6)]


def _base64(vec: Sequence[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()


def _binary(vec: Sequence[float], signed: bool) -> list[int]:
    """Cohere's packed bits: one per dimension (non-negative is 1), eight to a byte."""
    out = []
    for i in range(0, len(vec), 8):
        byte = sum(1 << (7 - j) for j, x in enumerate(vec[i : i + 8]) if x >= 0)
        out.append(byte - 128 if signed else byte)
    return out


# -- requests ---------------------------------------------------------------------------------


def _body_model(body: Any, models: Sequence[str], *, required: bool = False) -> str:
    if not isinstance(body, dict):
        raise protocol.validation_error(
            "", "model_attributes_type", "Input should be a valid dictionary", body
        )
    if required and "model" not in body:
        raise protocol.validation_error("model", "missing", "Field required", body)
    model = protocol._get(body, "model", "str")
    if model and model not in models:
        raise protocol.not_found_model(model)
    return model or models[0]


def _encode(text: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except UnicodeEncodeError as exc:
        raise protocol.unencodable(exc) from None


def _prompts(body: Mapping[str, Any]) -> list[list[int]]:
    """The token ids of a pooling request: chat ``messages`` (one prompt), or ``input`` as
    text, texts, token ids or lists of token ids."""
    if "messages" in body:
        messages = protocol._messages(body)
        try:
            add = protocol._get(body, "add_generation_prompt", "bool", False)
            return [tokenizer.chat_prompt_ids(messages, add_generation_prompt=add)]
        except tokenizer.TemplateError as exc:
            raise protocol.semantic_error(str(exc), "messages") from None
        except UnicodeEncodeError as exc:
            raise protocol.unencodable(exc) from None
    if "input" not in body:
        raise protocol.validation_error("input", "missing", "Field required", body)
    value = body["input"]
    if isinstance(value, str):
        return [_encode(value)]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return [_encode(v) for v in value]
    if isinstance(value, list) and all(protocol._is_int(t) for t in value):
        return [list(value)]
    if isinstance(value, list) and all(
        isinstance(p, list) and all(protocol._is_int(t) for t in p) for p in value
    ):
        return [list(p) for p in value]
    raise protocol.validation_error("input", "string_type", "Input should be a valid string", value)


def _texts(body: Mapping[str, Any], key: str) -> list[str]:
    value = body[key]
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise protocol.validation_error(key, "string_type", "Input should be a valid string", value)


def _dimensions(body: Mapping[str, Any], key: str = "dimensions") -> int:
    dim = protocol._get(body, key, "int")
    if dim is None:
        return DIM
    if not 1 <= dim <= DIM:
        raise protocol.semantic_error(
            f"Dimensions must be between 1 and {DIM} (simulator limit), got {dim}.", key, dim
        )
    return dim


def _list_response(
    prefix: str, rid: str, model: str, data: list[dict[str, Any]], prompt: int
) -> dict[str, Any]:
    """vLLM's pooling response envelope (embeddings, pooling, classify, score)."""
    return {
        "id": f"{prefix}-{rid}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": formats.usage(prompt, 0, details=True),
    }


# -- routes -----------------------------------------------------------------------------------


class PoolingRoutes:
    """The handlers of the routes in this module's docstring. ``chat`` and ``completions`` are
    the app's generation handlers, which ``/invocations`` dispatches to."""

    def __init__(
        self,
        sim: Sim,
        json_body: Callable[[Request], Awaitable[Any]],
        chat: Handler,
        completions: Handler,
    ) -> None:
        self.sim = sim
        self.json_body = json_body
        self.chat = chat
        self.completions = completions

    @property
    def models(self) -> Sequence[str]:
        return self.sim.settings.models

    @property
    def seed(self) -> int:
        return self.sim.settings.seed

    async def embeddings(self, request: Request) -> Response:
        try:
            body = await self.json_body(request)
            model = _body_model(body, self.models)
            prompts = _prompts(body)
            dim = _dimensions(body)
            fmt = body.get("encoding_format") or "float"
            if fmt not in ("float", "base64"):
                raise protocol.validation_error(
                    "encoding_format", "literal_error", "Input should be 'float' or 'base64'", fmt
                )
        except protocol.ApiError as exc:
            return _error(exc)
        data = []
        for i, ids in enumerate(prompts):
            vec = vector(self.seed, ids, dim)
            data.append(
                {
                    "index": i,
                    "object": "embedding",
                    "embedding": vec if fmt == "float" else _base64(vec),
                }
            )
        n = sum(map(len, prompts))
        return _json(_list_response("embd", _rid(request), model, data, n))

    async def pooling(self, request: Request) -> Response:
        try:
            body = await self.json_body(request)
            model = _body_model(body, self.models)
            prompts = _prompts(body)
            dim = _dimensions(body)
        except protocol.ApiError as exc:
            return _error(exc)
        data = [
            {"index": i, "object": "pooling", "data": vector(self.seed, ids, dim)}
            for i, ids in enumerate(prompts)
        ]
        return _json(_list_response("pool", _rid(request), model, data, sum(map(len, prompts))))

    async def classify(self, request: Request) -> Response:
        try:
            body = await self.json_body(request)
            model = _body_model(body, self.models)
            prompts = _prompts(body)
        except protocol.ApiError as exc:
            return _error(exc)
        data = []
        for i, ids in enumerate(prompts):
            p = probs(self.seed, ids)
            data.append(
                {"index": i, "label": LABELS[p.index(max(p))], "probs": p, "num_classes": len(p)}
            )
        n = sum(map(len, prompts))
        return _json(_list_response("classify", _rid(request), model, data, n))

    def _pairs(self, body: Mapping[str, Any]) -> list[tuple[list[int], list[int]]]:
        """Score pairs as vLLM forms them: 1:1, 1:N or N:N."""
        for first, second in SCORE_KEYS:
            if first in body and second in body:
                break
        else:
            raise protocol.validation_error("queries", "missing", "Field required", body)
        left, right = _texts(body, first), _texts(body, second)
        if not left:
            raise protocol.semantic_error("At least one text element must be given", first)
        if not right:
            raise protocol.semantic_error("At least one text_pair element must be given", second)
        if len(left) == 1:
            left = left * len(right)
        elif len(left) != len(right):
            raise protocol.semantic_error("Input lengths must be either 1:1, 1:N or N:N", second)
        return [(_encode(a), _encode(b)) for a, b in zip(left, right, strict=True)]

    async def score(self, request: Request) -> Response:
        try:
            body = await self.json_body(request)
            model = _body_model(body, self.models)
            pairs = self._pairs(body)
        except protocol.ApiError as exc:
            return _error(exc)
        data = [
            {"index": i, "object": "score", "score": score(self.seed, q, d)}
            for i, (q, d) in enumerate(pairs)
        ]
        n = sum(len(q) + len(d) for q, d in pairs)
        return _json(_list_response("score", _rid(request), model, data, n))

    async def rerank(self, request: Request) -> Response:
        try:
            body = await self.json_body(request)
            model = _body_model(body, self.models)
            for key in ("query", "documents"):
                if key not in body:
                    raise protocol.validation_error(key, "missing", "Field required", body)
            query = protocol._get(body, "query", "str")
            docs = _texts(body, "documents")
            top_n = protocol._get(body, "top_n", "int", 0)
        except protocol.ApiError as exc:
            return _error(exc)
        q = _encode(query)
        encoded = [_encode(d) for d in docs]
        results: list[dict[str, Any]] = [
            {
                "index": i,
                "document": {"text": doc, "multi_modal": None},
                "relevance_score": score(self.seed, q, ids),
            }
            for i, (doc, ids) in enumerate(zip(docs, encoded, strict=True))
        ]
        results.sort(key=lambda r: r["relevance_score"], reverse=True)
        if 0 < top_n < len(docs):
            results = results[:top_n]
        n = sum(len(q) + len(ids) for ids in encoded)
        # vLLM's rerank answers come from its score handler: the id says "score".
        return _json(
            {
                "id": f"score-{_rid(request)}",
                "model": model,
                "usage": {"prompt_tokens": n, "total_tokens": n},
                "results": results,
            }
        )

    async def cohere_embed(self, request: Request) -> Response:
        """``/v2/embed``: Cohere's embed request and response (the latter without null fields,
        as vLLM dumps it)."""
        try:
            body = await self.json_body(request)
            _body_model(body, self.models, required=True)
            dim = _dimensions(body, "output_dimension")
            types = protocol._get(body, "embedding_types", "list") or ["float"]
            if any(t not in COHERE_TYPES for t in types):
                raise protocol.validation_error(
                    "embedding_types",
                    "literal_error",
                    "Input should be 'float', 'binary', 'ubinary' or 'base64'",
                    types,
                )
            texts = _texts(body, "texts") if body.get("texts") is not None else None
            if texts is not None:
                prompts = [_encode(t) for t in texts]
            elif body.get("images") is not None or body.get("inputs") is not None:
                prompts = self._cohere_media(body)
            else:
                raise protocol.ApiError(400, "One of texts, images, or inputs must be provided")
        except protocol.ApiError as exc:
            return _error(exc)
        if dim % 8 and {"binary", "ubinary"} & set(types):
            message = (
                "Embedding dimension must be a multiple of 8 for binary embedding types, "
                f"but got {dim}."
            )
            return _error(protocol.ApiError(400, message))
        floats = [vector(self.seed, ids, dim) for ids in prompts]
        embeddings: dict[str, Any] = {}
        for kind in COHERE_TYPES:  # the response model's field order
            if kind == "float" and kind in types:
                embeddings[kind] = floats
            elif kind in ("binary", "ubinary") and kind in types:
                embeddings[kind] = [_binary(v, kind == "binary") for v in floats]
            elif kind == "base64" and kind in types:
                embeddings[kind] = [_base64(v) for v in floats]
        data: dict[str, Any] = {"id": f"embd-{_rid(request)}", "embeddings": embeddings}
        if texts is not None:
            data["texts"] = texts
        tokens = {"input_tokens": sum(map(len, prompts))}
        data["meta"] = {"api_version": {"version": "2"}, "tokens": tokens}
        return _json(data)

    @staticmethod
    def _cohere_media(body: Mapping[str, Any]) -> list[list[int]]:
        """Images and mixed inputs become one chat prompt each, as vLLM renders them."""
        conversations: list[list[Any]] = []
        for uri in protocol._get(body, "images", "list") or []:
            image = [{"type": "image_url", "image_url": {"url": uri}}]
            conversations.append([{"role": "user", "content": image}])
        for item in protocol._get(body, "inputs", "list") or []:
            content = item.get("content") if isinstance(item, dict) else None
            conversations.append([{"role": "user", "content": content}])
        try:
            return [
                tokenizer.chat_prompt_ids(c, add_generation_prompt=False) for c in conversations
            ]
        except tokenizer.TemplateError as exc:
            raise protocol.semantic_error(str(exc), "inputs") from None

    async def tokenizer_info(self, request: Request) -> Response:
        return _json(TOKENIZER_INFO)

    async def invocations(self, request: Request) -> Any:
        """SageMaker's entry: vLLM tries each request type in turn (generation first) and hands
        the body to the first route whose request model accepts it."""
        try:
            body = await self.json_body(request)
        except protocol.ApiError as exc:
            return _error(exc)
        if isinstance(body, dict):
            if isinstance(body.get("messages"), list):
                return await self.chat(request)
            if "prompt" in body:
                return await self.completions(request)
            if "input" in body:
                return await self.embeddings(request)
            if "query" in body and "documents" in body:
                return await self.rerank(request)
            if any(a in body and b in body for a, b in SCORE_KEYS):
                return await self.score(request)
        names = [
            "ChatCompletionRequest",
            "CompletionRequest",
            "EmbeddingRequest",
            "ClassificationRequest",
            "RerankRequest",
            "ScoreRequest",
            "PoolingRequest",
        ]
        message = f"Cannot find suitable handler for request. Expected one of: {names}"
        return _error(protocol.ApiError(400, message))

    async def chat_batch(self, request: Request) -> Any:
        """``/v1/chat/completions/batch``: ``messages`` is a list of conversations; each runs as
        its own engine request and the answer is one chat completion whose choice ``index`` is
        the conversation's (vLLM's ``OpenAIServingChatBatch``). No streaming, no tools."""
        sim, s = self.sim, self.sim.settings
        try:
            body = await self.json_body(request)
            if not isinstance(body, dict):
                raise protocol.validation_error(
                    "", "model_attributes_type", "Input should be a valid dictionary", body
                )
            conversations = body.get("messages")
            if not isinstance(conversations, list) or not all(
                isinstance(c, list) for c in conversations
            ):
                raise protocol.validation_error(
                    "messages", "list_type", "Input should be a valid list", conversations
                )
            unsupported = {
                "stream": body.get("stream") is True,
                "tools": bool(body.get("tools")),
                "n": body.get("n") not in (None, 1),
            }
            for key, bad in unsupported.items():
                if bad:  # vLLM rejects these in a model validator; the wording is the simulator's
                    raise protocol.validation_error(
                        "",
                        "value_error",
                        f"Value error, `{key}` is not supported in batch mode",
                        body,
                    )
        except protocol.ApiError as exc:
            return _error(exc)
        fault = sim.error_rate_error()
        if fault is not None:
            return _error(fault)
        priority = s.scheduling_policy == "priority"
        try:
            parsed = [
                protocol.parse_chat({**body, "messages": c}, s.models, priority_enabled=priority)
                for c in conversations
            ]
            if not parsed:
                raise protocol.semantic_error("messages must not be empty", "messages")
            sp = parsed[0].sampling
            prompts = [g.prompts[0] for g in parsed]
            limits = [
                protocol.effective_max_tokens(len(p), sp.max_tokens, s.max_model_len)
                for p in prompts
            ]
        except protocol.ApiError as exc:
            return _error(exc)
        if sim.engine.dead is not None:
            return Response(status_code=500)  # vLLM's EngineDeadError handler, as for chat
        rid = protocol.request_id(request.headers.get("x-request-id"))
        now = time.monotonic()
        natural = (s.natural_len_min, s.natural_len_max) if sp.max_tokens is None else None
        # Each conversation's answer is its choice 0, seeded as app.py's _output_seed does.
        seed = hash((s.seed, sp.seed or 0, 0)) & 0xFFFF_FFFF_FFFF
        reqs = [
            EngineRequest(
                id=f"{rid}-{k}",
                prompt=p,
                arrival=now,
                max_tokens=limit,
                priority=sp.priority,
                output=Output(
                    seed,
                    max_tokens=limit,
                    prompt=p,
                    natural_range=natural,
                    stop=sp.stop,
                    include_stop=sp.include_stop,
                ),
            )
            for k, (p, limit) in enumerate(zip(prompts, limits, strict=True))
        ]
        g = protocol.GenerationRequest("chat", parsed[0].model, prompts, [None] * len(prompts), sp)
        return Generation(sim, g, reqs, rid)
