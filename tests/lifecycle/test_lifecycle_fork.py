"""The headline scenario: fork a sandbox whose process holds 100 MiB of memory into 16 children."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2b import Sandbox

from lifecycle_util import WORK, ask_worker, assert_same_worker, kill_quietly, read_state, setup_worker

FORK_COUNT = 16
MEMORY_MIB = 100


@pytest.mark.timeout(600)
def test_fork_16_children_keep_process_memory_and_files(server, tracker):
    src = tracker.create()
    src.files.write(f"{WORK}/shared/base.txt", "written before the fork\n")
    before = setup_worker(src, MEMORY_MIB, wait_counter=10)
    pre = ask_worker(src)
    assert pre.hash == pre.h0, "worker's memory hash differs right after start"

    at_fork = read_state(src)
    t0 = time.monotonic()
    results = src.fork(count=FORK_COUNT, timeout=600, request_timeout=540)
    fork_s = time.monotonic() - t0
    children = [r for r in results if isinstance(r, Sandbox)]
    for c in children:
        tracker.add(c)
    errors = [r for r in results if not isinstance(r, Sandbox)]
    print(f"fork({FORK_COUNT}) of a {MEMORY_MIB} MiB process took {fork_s:.1f}s; {len(children)} children")
    try:
        assert len(results) == FORK_COUNT
        assert not errors, f"{len(errors)} fork children failed: {errors[:3]}\n{server.log_tail(40)}"
        ids = {c.sandbox_id for c in children}
        assert len(ids) == FORK_COUNT and src.sandbox_id not in ids

        # The image the children restored from was not kept (nor sealed into the page store: a fork
        # keeps it only until its children are up)
        assert not list((server.data_dir / "fork-images").glob(f"{src.sandbox_id}-*"))

        # The source keeps running under the same id with the same process.
        src_after = ask_worker(src)
        assert_same_worker(src_after, at_fork, "source after fork")
        assert src.is_running()

        def check_child(c: Sandbox) -> str:
            got = ask_worker(c, timeout=180)
            assert_same_worker(got, at_fork, f"child {c.sandbox_id}")
            assert c.files.read(f"{WORK}/shared/base.txt") == "written before the fork\n"
            c.files.write(f"{WORK}/shared/child-{c.sandbox_id}.txt", c.sandbox_id)
            return c.sandbox_id

        with ThreadPoolExecutor(max_workers=8) as pool:
            done = list(pool.map(check_child, children))
        assert sorted(done) == sorted(ids)

        # Every child sees exactly its own write; the source sees none.
        def listing(s: Sandbox) -> set[str]:
            return {e.name for e in s.files.list(f"{WORK}/shared")}

        with ThreadPoolExecutor(max_workers=8) as pool:
            listings = dict(zip([c.sandbox_id for c in children], pool.map(listing, children)))
        for cid, names in listings.items():
            assert names == {"base.txt", f"child-{cid}.txt"}, f"child {cid} sees {names}"
        assert listing(src) == {"base.txt"}, "a child's write leaked into the source"

        # The counters keep going independently after the fork.
        later = read_state(children[0])
        assert later is not None and later.counter > at_fork.counter
        assert before.pid == at_fork.pid
    finally:
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(kill_quietly, children))
    alive = {s.sandbox_id for s in Sandbox.list().next_items()}
    assert not (alive & {c.sandbox_id for c in children}), "killed fork children still listed"
