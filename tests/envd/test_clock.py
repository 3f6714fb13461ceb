"""The `/init` timestamp parsing envd uses to step a restored microVM's clock (the stepping itself
is checked inside a real QEMU guest: tests/qemu/test_qemu_e2e.py; here the host clock must never be
touched, so only the no-op path runs)."""

from __future__ import annotations

import time

import pytest

from agentenv.envd import clock


@pytest.mark.parametrize("text, expected", [
    ("2026-12-02T19:30:00Z", 1796239800.0),
    ("2026-12-02T19:30:00.250Z", 1796239800.25),
    ("2026-12-02T20:30:00.250+01:00", 1796239800.25),
])
def test_parses_rfc3339(text, expected):
    assert clock.parse_timestamp(text) == pytest.approx(expected)


@pytest.mark.parametrize("value", [None, "", "yesterday", "2026-12-02T19:30:00", 17, {"t": 1}])
def test_rejects_missing_invalid_or_zone_less_times(value):
    assert clock.parse_timestamp(value) is None


def test_a_clock_within_the_allowed_skew_is_left_alone():
    assert clock.sync(time.time() + clock.MAX_SKEW_S / 2) is None
