"""One exception tree, one rendering: every exception class of ``proxy/`` is defined in
``proxy/errors.py``, and a ``GatewayError`` renders the same bytes on every path it takes."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
from typing import Any

import pytest
from starlette.types import Message

import proxy
from proxy import errors
from proxy.errors import (
    BadRequest,
    Forbidden,
    GatewayError,
    NotFound,
    PolicyRefused,
    Rejected,
    ShuttingDown,
    TokenlaneError,
    Unauthorized,
    UpstreamBusy,
    UpstreamFailed,
    error_messages,
    error_response,
    internal_error,
    send_error,
    sse_error_event,
)

# The relay's own retry signal moves into errors.py with the relay's rework; until then it is
# the one class allowed elsewhere.
PENDING = {"proxy.relay.relay.RetryableFailure"}


def exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(proxy.__path__, "proxy."):
        if info.name.endswith(".__main__"):
            continue  # running it is its only job
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == info.name
            ):
                found[f"{info.name}.{name}"] = obj
    return found


def test_every_exception_class_of_the_package_is_defined_in_errors_py() -> None:
    classes = exception_classes()
    outside = sorted(name for name in classes if not name.startswith("proxy.errors."))
    assert set(outside) <= PENDING, f"define these in proxy/errors.py: {outside}"
    assert len([n for n in classes if n.startswith("proxy.errors.")]) >= 20


def test_every_exception_in_errors_py_is_a_tokenlane_error() -> None:
    for name, cls in exception_classes().items():
        if name.startswith("proxy.errors."):
            assert issubclass(cls, TokenlaneError), name


def test_moved_classes_keep_their_builtin_bases_and_their_old_import_paths() -> None:
    from proxy.edge.admin import Forbidden as AdminForbidden
    from proxy.fleet.fleet import AmbiguousReplica, UnknownReplica
    from proxy.fleet.vllm import ScrapeError
    from proxy.policyfile import PolicyError
    from proxy.routing.lanes import NoLaneMatched
    from proxy.routing.tokens import TokenizerError
    from proxy.state.redislink import Unavailable

    assert AdminForbidden is Forbidden
    assert Unavailable is errors.SharedUnavailable
    for cls in (PolicyError, TokenizerError, ScrapeError):
        assert issubclass(cls, ValueError) and cls.__module__ == "proxy.errors"
    for cls in (NoLaneMatched, UnknownReplica, AmbiguousReplica):
        assert issubclass(cls, LookupError) and cls.__module__ == "proxy.errors"


@pytest.mark.parametrize(
    ("err", "status", "type_", "code"),
    [
        (BadRequest("x", param="messages"), 400, "BadRequestError", 400),
        (Unauthorized("x", code="invalid_api_key"), 401, "AuthenticationError", "invalid_api_key"),
        (Forbidden("x"), 403, "PermissionDeniedError", 403),
        (NotFound("x", param="model"), 404, "NotFoundError", 404),
        (PolicyRefused(["a: b"]), 422, "UnprocessableEntityError", 422),
        (Rejected("x", status=429, reason="r", retry_after_s=0.2), 429, "RateLimitError", 429),
        (
            ShuttingDown("x"),
            503,
            "ServiceUnavailableError",
            503,
        ),
        (UpstreamFailed("x"), 502, "BadGatewayError", 502),
        (UpstreamBusy("x"), 503, "ServiceUnavailableError", 503),
        (internal_error(), 500, "InternalServerError", 500),
        (internal_error(code=None), 500, "InternalServerError", None),
    ],
)
def test_status_type_and_code_of_each_error(
    err: GatewayError, status: int, type_: str, code: Any
) -> None:
    assert err.status == status
    body = err.body()["error"]
    assert body["type"] == type_ and body["code"] == code


def test_asgi_answer_bytes_and_header_order() -> None:
    err = Rejected("slow down", status=429, reason="rate_limited", retry_after_s=2.2)
    start, body = error_messages(err, "rid-1", [(b"x-ratelimit-limit-requests", b"10")])
    payload = (
        b'{"error": {"message": "slow down", "type": "RateLimitError", "param": null, "code": 429}}'
    )
    assert body == {"type": "http.response.body", "body": payload, "more_body": False}
    assert start == {
        "type": "http.response.start",
        "status": 429,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"retry-after", b"3"),
            (b"x-request-id", b"rid-1"),
            (b"x-ratelimit-limit-requests", b"10"),
        ],
    }


async def test_send_error_sends_the_two_messages() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    err = BadRequest("bad", param="n")
    await send_error(send, err)
    assert tuple(sent) == error_messages(err)
    assert [h for h, _ in sent[0]["headers"]] == [b"content-type", b"content-length"]


def test_starlette_answer_is_compact_json_with_the_errors_headers() -> None:
    err = Rejected("busy", status=503, reason="timeout", retry_after_s=0.0)
    response = error_response(err)
    assert response.status_code == 503
    assert response.body == (
        b'{"error":{"message":"busy","type":"ServiceUnavailableError","param":null,"code":503}}'
    )
    assert response.headers["retry-after"] == "1"
    assert response.headers["content-type"] == "application/json"


def test_a_refused_reload_lists_its_problems_after_the_error() -> None:
    body = json.loads(error_response(PolicyRefused(["lanes[0].pool: unknown pool"])).body)
    assert list(body) == ["error", "problems"]
    assert body["problems"] == ["lanes[0].pool: unknown pool"]
    assert body["error"]["message"] == "the new policy is invalid; the old one stays"


def test_sse_error_event_is_the_error_then_done() -> None:
    event = sse_error_event(UpstreamBusy("all replicas failed"))
    assert event == (
        b'data: {"error": {"message": "all replicas failed", "type": "ServiceUnavailableError", '
        b'"param": null, "code": 503}}\n\ndata: [DONE]\n\n'
    )
