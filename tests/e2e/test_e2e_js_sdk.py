"""Runs tests/js/smoke.test.mjs (official npm `e2b` SDK) against the test server."""

from __future__ import annotations

from e2e_util import run_node_tests


def test_js_sdk_smoke(server):
    run_node_tests(server, "smoke.test.mjs", passes=1, timeout=300)

