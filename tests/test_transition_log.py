"""Transition logs: one field per fact (reason, evidence, ejection length), none printed as
None."""

from __future__ import annotations

import json
import logging

import pytest

from .test_fleet import admit, make, stall


def test_transition_log_has_reason_evidence_and_length_as_separate_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fleet, clock, _ = make()
    r = next(fleet.replicas())
    with caplog.at_level(logging.INFO, "tokenlane.health"):
        admit(fleet, r, clock)
        stall(fleet, r, clock)
    records = [rec for rec in caplog.records if rec.name == "tokenlane.health"]
    healthy = next(rec for rec in records if "to=healthy" in rec.getMessage())
    assert "reason=" not in healthy.getMessage() and "None" not in healthy.getMessage()
    ejected = next(rec for rec in records if "to=ejected" in rec.getMessage())
    message = ejected.getMessage()
    assert "reason=stall ejected_for=30.0s" in message
    assert ejected.ejected_for == "30.0s"  # type: ignore[attr-defined]
    assert ejected.reason == "stall"  # type: ignore[attr-defined]
    evidence = ejected.evidence  # type: ignore[attr-defined]
    assert evidence.startswith("running ") and "30.0s" not in evidence
    assert message.endswith(f"evidence={json.dumps(evidence)}")
