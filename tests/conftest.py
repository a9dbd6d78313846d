"""Fixtures shared by the test modules."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, object]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(json.loads(record.getMessage()))


@pytest.fixture
def access_lines() -> Iterator[list[dict[str, object]]]:
    """The access-log records written while the test runs, parsed."""
    logger = logging.getLogger("tokenlane.access")
    handler = _Lines()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
