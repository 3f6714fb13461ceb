"""Operation traces (agentenv/orchestrator/trace.py): every step's time lands in its operation."""

from __future__ import annotations

import asyncio

import pytest

from agentenv.orchestrator import trace


def test_spans_of_concurrent_children_belong_to_the_operation() -> None:
    async def main() -> dict:
        with trace.operation("fork", "isrc"):
            with trace.span("runtime.checkpoint", "isrc"):
                await asyncio.sleep(0.02)

            async def child(sid: str) -> None:
                with trace.span("runtime.restore", sid):
                    await asyncio.sleep(0.01)

            await asyncio.gather(child("ia"), child("ib"))
        return trace.recent(1)[0]

    t = asyncio.run(main())
    assert t["operation"] == "fork" and t["error"] is None
    assert [(s["name"], s["sandboxID"]) for s in t["spans"]] == [
        ("runtime.checkpoint", "isrc"), ("runtime.restore", "ia"), ("runtime.restore", "ib")]
    assert t["spans"][0]["durationMs"] >= 15
    assert t["durationMs"] >= t["spans"][0]["durationMs"] + 5  # the children ran after the checkpoint


def test_a_failed_operation_records_its_error_and_nested_ones_join_the_outer() -> None:
    with pytest.raises(KeyError):
        with trace.operation("wake", "i1"):
            with trace.operation("resume", "i1"):  # nested: a span of the outer trace
                raise KeyError("x")
    t = trace.recent(1)[0]
    assert t["operation"] == "wake" and t["error"] == "KeyError"
    assert [s["name"] for s in t["spans"]] == ["resume"]


def test_a_span_outside_an_operation_is_not_recorded() -> None:
    before = trace.recent(200)
    with trace.span("alone"):
        pass
    assert trace.recent(200) == before
