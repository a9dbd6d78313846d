"""Client keys and the per-key rate limit check (docs/http.md, "Client keys and rate limits").

When the environment variable named by ``server.api_keys_env`` holds comma-separated keys,
every ``/v1/*`` path and every relayed path needs ``Authorization: Bearer <key>``; otherwise 401
in OpenAI's shape. Unset or empty: no client auth and no rate limits (a limit needs a key to
count against).

Only the keys' SHA-256 digests are kept. A presented key is hashed and compared with *every*
digest by ``hmac.compare_digest``, without stopping at a match: hashing gives equal lengths (so
the comparison leaks no length) and the full pass takes the same time whichever key matched.
A key is known elsewhere only by its id, the first 12 hex characters of that digest: rate-limit
buckets and anything that wants to tell clients apart use it, and it cannot be turned back into
the key. The key itself never reaches a log line or a replica (the relay drops
``authorization``; the access log carries no headers).
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from proxy.edge import validate
from proxy.errors import Rejected, Unauthorized
from proxy.routing.profile import output_tokens_for
from proxy.routing.ratelimit import RateLimiter

if TYPE_CHECKING:
    from proxy.observe.metrics import Metrics
    from proxy.relay.call import Call

# The lane label of a rejection made before the request's lane is known (its body is not even
# read for a client without a valid key).
NO_LANE = "none"
KEY_ID_CHARS = 12


def key_id(key: str | bytes) -> str:
    raw = key.encode() if isinstance(key, str) else key
    return hashlib.sha256(raw).hexdigest()[:KEY_ID_CHARS]


class ClientKeys:
    """The configured client keys, as digests."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [
            (hashlib.sha256(k.encode()).digest(), key_id(k)) for k in dict.fromkeys(keys) if k
        ]

        # An attribute, not a property: read on every request from compiled code, where a
        # property of this interpreted class is a Python call. The keys never change.
        self.enabled = bool(self._digests)

    @classmethod
    def from_env(cls, environ: Mapping[str, str], var: str) -> ClientKeys:
        return cls(k.strip() for k in environ.get(var, "").split(","))

    def __len__(self) -> int:
        return len(self._digests)

    def identify(self, authorization: bytes | None) -> str | None:
        """The id of the key in an ``Authorization`` header value; None if missing or wrong."""
        return self.identify_token(bearer_token(authorization))

    def identify_token(self, token: bytes | None) -> str | None:
        """The id of a bare key (a Bearer token, an ``x-api-key`` value); None if wrong."""
        if not token:
            return None
        digest = hashlib.sha256(token).digest()
        found: str | None = None
        for known, kid in self._digests:
            if hmac.compare_digest(digest, known):  # no break: the same work for every key
                found = kid
        return found


def bearer_token(authorization: bytes | None) -> bytes | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        return None
    return token


def request_tokens(call: Call, chars_per_token: float) -> int:
    """What a request counts against ``tokens_per_min``: its estimated prompt tokens plus the
    output tokens it may generate (its max tokens, else the lane's default). A relayed request
    without a profile (embeddings, tokenize, ...) counts its body at ``chars_per_token``, except
    a multipart form (an audio upload): that is not text, and counts only against
    ``requests_per_min``."""
    profile = call.profile
    if profile is None:
        if validate.media_type(call.headers) == b"multipart/form-data":
            return 0
        return math.ceil(len(call.body) / chars_per_token)
    return profile.prompt_tokens_est + (output_tokens_for(profile, call.lane) or 0)


class Guard:
    """The gateway's door: who the client is, and whether its key still has budget."""

    def __init__(self, keys: ClientKeys, limiter: RateLimiter, metrics: Metrics) -> None:
        self.keys = keys
        self.limiter = limiter
        self.metrics = metrics
        self.enabled = keys.enabled  # read on every request (``ClientKeys.enabled``)

    def authenticate(self, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
        """The client's key id (None when auth is off); raises ``Unauthorized``."""
        if not self.keys.enabled:
            return None
        # Anthropic's clients send their key as ``x-api-key``: a key is a key in either header
        # (neither is ever relayed: ``relay.relay.DROP_UPSTREAM``).
        value = api_key = None
        for k, v in headers:
            if k == b"authorization":
                value = v
            elif k == b"x-api-key":
                api_key = v.strip()
        kid = self.keys.identify(value)
        if kid is None and api_key is not None:
            kid = self.keys.identify_token(api_key)
        if kid is not None:
            return kid
        self.metrics.rejections.labels(NO_LANE, "unauthorized").inc()
        if value is None and api_key is None:
            message = (
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY), "
                "or in an x-api-key header."
            )
        else:
            message = "Incorrect API key provided."  # never echo any part of it
        raise Unauthorized(message, code="invalid_api_key")

    def charge(self, kid: str | None, call: Call, chars_per_token: float) -> None:
        """Take the request's cost from its key's budget; raises ``Rejected`` (429). An
        admitted request carries the key's ``x-ratelimit-*`` headers to every answer it gets,
        as OpenAI sends them (``Call.extra_headers``)."""
        if kid is None or not self.limiter.enabled:
            return
        verdict = self.limiter.check(kid, request_tokens(call, chars_per_token))
        if verdict.allowed:
            call.extra_headers = [(k.encode(), v.encode()) for k, v in verdict.headers().items()]
            return
        lane = call.lane.name
        self.metrics.rejections.labels(lane, "rate_limited").inc()
        if verdict.too_large:
            message = (
                f"Request too large: it needs {request_tokens(call, chars_per_token)} tokens, "
                f"more than this key's limit of {verdict.tokens.limit if verdict.tokens else 0} "
                "tokens per minute."
            )
        else:
            message = "Rate limit reached for this key; retry after the time in Retry-After."
        raise Rejected(
            message,
            status=429,
            reason="rate_limited",
            retry_after_s=verdict.retry_after_s,
            headers=verdict.headers(),
        )
