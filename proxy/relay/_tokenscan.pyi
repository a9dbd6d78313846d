# The C module's one function (proxy/relay/_tokenscan.c): continuation.scan_events' contract.
def scan(
    data: bytes, start: int, head: bytes, tail: bytes, strip: bool, single: bool
) -> tuple[bytes, bytes, int, bool] | None: ...
