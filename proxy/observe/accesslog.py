"""The access log: one JSON line per request on the ``tokenlane.access`` logger (stdout).

Lines are written with the rest of a request's outcome, off its path (``outcomes.Outcomes``).
This module is the logger and its handler; the lines are made in ``proxy.observe.accessline``,
which is compiled (``proxy/compiled.py``): a handler compiled crashed the process at logging's
shutdown, so the handler stays here, interpreted.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("tokenlane.access")


PLAIN = logging.Formatter("%(message)s")


class BatchedLines(logging.StreamHandler):
    """The access log's handler (``configure_logging``): a batch of outcomes' lines
    (``flush_lines``) leaves in one write to the stream, not one write per line. The stream's
    own buffer cannot be relied on for that: with ``PYTHONUNBUFFERED=1`` (the Docker image
    sets it, as CI and most process managers do) every line was a system call of its own.

    Its lines are the messages as they are; while nobody gave it another formatter (``plain``)
    the access log hands it lines itself (``write``), without a log record."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.setFormatter(PLAIN)
        self._lines: list[str] = []

    @property
    def plain(self) -> bool:
        return self.formatter is PLAIN

    def write(self, line: str) -> None:
        """Hold ``line`` for the batch's write. Without ``emit``'s lock: access lines are
        written on the event loop's thread alone."""
        self._lines.append(line + self.terminator)

    def write_all(self, lines: list[str]) -> None:
        """``write`` of each of ``lines``: a batch's lines, in one call."""
        end = self.terminator
        self._lines.append(end.join(lines) + end)

    def emit(self, record: logging.LogRecord) -> None:
        """A record (another formatter, a filter) is held for the batch's write as well."""
        try:
            self._lines.append(self.format(record) + self.terminator)
        except Exception:
            self.handleError(record)

    def flush(self) -> None:
        """Write what is held in one write, then flush the stream (``flush_lines``; also
        ``logging.shutdown`` at exit); a failed write is reported (``handleError``) as
        ``emit`` reports one, not raised: the batch's other outcomes still get recorded."""
        lines = self._lines
        if not lines:
            return
        self._lines = []
        text = lines[0] if len(lines) == 1 else "".join(lines)
        try:
            self.stream.write(text)
            self.stream.flush()
        except Exception:
            self.handleError(logging.makeLogRecord({"msg": text, "name": logger.name}))


def flush_lines(log: logging.Logger = logger) -> None:
    """Write out the lines of the batch just recorded (``outcomes.Outcomes``)."""
    for handler in log.handlers:
        if isinstance(handler, BatchedLines):
            handler.flush()


__all__ = ["PLAIN", "BatchedLines", "flush_lines", "logger"]
