"""Sandbox lifecycle through the sync Python SDK: create, info, list, connect, timeout, kill."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from e2b import (
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxQuery,
    SandboxState,
)

from e2e_util import SandboxFactory, new_tag, wait_until

GROUP_SIZE = 3
ODD_METADATA = {"user id": "a&b=c d/%"}


@pytest.fixture(scope="module")
def group(sandbox_factory: SandboxFactory) -> tuple[str, list[Sandbox]]:
    """Three sandboxes sharing a unique ``group`` metadata value; the last one has odd metadata."""
    tag = new_tag()
    sandboxes = []
    for i in range(GROUP_SIZE):
        metadata = {"group": tag, "index": str(i)}
        if i == GROUP_SIZE - 1:
            metadata.update(ODD_METADATA)
        sandboxes.append(sandbox_factory.create(metadata=metadata, envs={"E2E_VAR": f"value-{i}-{tag}"}))
    return tag, sandboxes


def list_all(query: SandboxQuery, limit: int | None = None) -> list[list]:
    """All pages of ``Sandbox.list`` (a list of pages)."""
    paginator = Sandbox.list(query=query, limit=limit)
    pages = []
    while paginator.has_next:
        pages.append(paginator.next_items())
        assert len(pages) < 100, "paginator does not terminate"
    return pages


def listed_ids(query: SandboxQuery) -> set[str]:
    return {s.sandbox_id for page in list_all(query) for s in page}


def test_create_ids_are_distinct_and_url_safe(group):
    _, sandboxes = group
    ids = [s.sandbox_id for s in sandboxes]
    assert len(set(ids)) == len(ids)
    for sid in ids:
        assert sid and sid.isalnum() and sid == sid.lower(), sid


def test_create_env_vars_visible_to_commands(group):
    tag, sandboxes = group
    for i, sbx in enumerate(sandboxes):
        result = sbx.commands.run("echo $E2E_VAR")
        assert result.stdout == f"value-{i}-{tag}\n"


def test_get_info(group):
    tag, sandboxes = group
    sbx = sandboxes[0]
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert info.state == SandboxState.RUNNING
    assert info.metadata.get("group") == tag
    assert info.metadata.get("index") == "0"
    assert "base" in (info.template_id, info.name)
    assert info.end_at > info.started_at
    assert info.cpu_count >= 1 and info.memory_mb > 0
    # the static variant returns the same sandbox
    assert Sandbox.get_info(sbx.sandbox_id).sandbox_id == sbx.sandbox_id


def test_list_filters_by_metadata(group):
    tag, sandboxes = group
    assert listed_ids(SandboxQuery(metadata={"group": tag})) == {s.sandbox_id for s in sandboxes}
    assert listed_ids(SandboxQuery(metadata={"group": tag, "index": "1"})) == {sandboxes[1].sandbox_id}
    # keys/values with spaces, '&', '=', '/', '%' survive the SDK's multi-level encoding
    assert listed_ids(SandboxQuery(metadata={"group": tag, **ODD_METADATA})) == {sandboxes[-1].sandbox_id}
    assert listed_ids(SandboxQuery(metadata={"group": tag, "index": "nope"})) == set()
    listed = [s for page in list_all(SandboxQuery(metadata={"group": tag})) for s in page]
    by_id = {s.sandbox_id: s for s in listed}
    assert by_id[sandboxes[-1].sandbox_id].metadata["user id"] == ODD_METADATA["user id"]


def test_list_filters_by_state(group):
    tag, sandboxes = group
    ids = {s.sandbox_id for s in sandboxes}
    running = [s for page in list_all(SandboxQuery(metadata={"group": tag}, state=[SandboxState.RUNNING])) for s in page]
    assert {s.sandbox_id for s in running} == ids
    assert all(s.state == SandboxState.RUNNING for s in running)
    assert listed_ids(SandboxQuery(metadata={"group": tag}, state=[SandboxState.PAUSED])) == set()
    both = SandboxQuery(metadata={"group": tag}, state=[SandboxState.RUNNING, SandboxState.PAUSED])
    assert listed_ids(both) == ids


def test_list_paging(group):
    tag, sandboxes = group
    pages = list_all(SandboxQuery(metadata={"group": tag}), limit=1)
    non_empty = [p for p in pages if p]
    assert all(len(p) == 1 for p in non_empty), [len(p) for p in pages]
    # at most one trailing empty page, and only at the end
    assert all(pages[:len(non_empty)]), [len(p) for p in pages]
    assert len(pages) - len(non_empty) <= 1
    ids = [p[0].sandbox_id for p in non_empty]
    assert len(ids) == GROUP_SIZE and set(ids) == {s.sandbox_id for s in sandboxes}


def test_connect_by_id_shares_state(group):
    tag, sandboxes = group
    original = sandboxes[0]
    again = Sandbox.connect(original.sandbox_id)
    assert again.sandbox_id == original.sandbox_id
    path = f"/home/user/connect-{tag}.txt"
    again.files.write(path, "written through the second handle")
    assert original.files.read(path) == "written through the second handle"
    assert again.commands.run("echo $E2E_VAR").stdout == f"value-0-{tag}\n"
    assert again.is_running()


def test_set_timeout_moves_end(group):
    _, sandboxes = group
    sbx = sandboxes[1]
    sbx.set_timeout(1800)
    later = sbx.get_info().end_at
    assert later > datetime.now(timezone.utc) + timedelta(seconds=1500)
    sbx.set_timeout(1200)  # set_timeout may also shorten
    sooner = sbx.get_info().end_at
    assert sooner < later
    assert sbx.is_running()


def test_kill(sandbox_factory: SandboxFactory):
    tag = new_tag()
    sbx = sandbox_factory.create(metadata={"kill-test": tag})
    assert sbx.is_running()
    assert sbx.kill() is True
    assert sbx.is_running() is False
    assert Sandbox.kill(sbx.sandbox_id) is False
    assert listed_ids(SandboxQuery(metadata={"kill-test": tag})) == set()
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id)
    with pytest.raises(SandboxException):
        Sandbox.connect(sbx.sandbox_id)


def test_timeout_expiry(sandbox_factory: SandboxFactory):
    tag = new_tag()
    sbx = sandbox_factory.create(metadata={"expiry-test": tag}, timeout=600)
    before = sbx.get_info().end_at
    sbx.set_timeout(3)
    after = sbx.get_info().end_at
    assert after < before
    # Hang guard only: the sandbox must be gone some time after its 3 s timeout.
    wait_until(lambda: not sbx.is_running(), "the sandbox to expire", limit=120, interval=0.5)
    with pytest.raises(SandboxException):
        Sandbox.connect(sbx.sandbox_id)
    assert listed_ids(SandboxQuery(metadata={"expiry-test": tag})) == set()
    assert Sandbox.kill(sbx.sandbox_id) is False
