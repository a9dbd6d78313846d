# The C module's functions (proxy/relay/_tokenscan.c): continuation.scan_events' and
# continuation.take_token's and continuation.match_role's contracts.
from typing import Any

def scan(
    data: bytes, start: int, head: bytes, tail: bytes, strip: bool, single: bool
) -> tuple[bytes, bytes, int, bool] | None: ...
def take(data: bytes, head: bytes, tail: bytes, strip: bool, lists: list[Any]) -> bytes | None: ...
def role(
    event: bytes, before_created: bytes, between: bytes, after: bytes
) -> tuple[str, int, int, int, int] | None: ...
