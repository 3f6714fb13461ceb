"""envd's in-sandbox OOM killer (envd/oom.py) on real processes: over the limit, the largest
process is killed and envd itself is spared."""

from __future__ import annotations

import re
import subprocess
import sys
import time

from agentenv.envd.oom import ALLOC_RATE, POLL_MAX_S, POLL_S, MemInfo, OomGuard, biggest_process, memory_used


def test_kills_the_largest_process_when_over_the_limit():
    small = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    big = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(200 << 20); time.sleep(60)"])
    try:
        mine = lambda: [small.pid, big.pid]  # noqa: E731 - never look at the host's other processes
        deadline = time.monotonic() + 20
        while (biggest_process(mine(), set()) or (0, 0))[1] < 150 << 20:
            assert time.monotonic() < deadline, "the big process never grew"
            time.sleep(0.1)
        assert biggest_process(mine(), set())[0] == big.pid
        assert OomGuard(memory_used() * 2, mine).check_once() is None  # under the limit: nothing happens
        killed = OomGuard(1, mine).check_once()  # any use is over a 1-byte limit
        assert killed == big.pid
        assert big.wait(10) == -9
        assert small.poll() is None
    finally:
        for p in (small, big):
            p.kill()
            p.wait()


def test_disabled_without_a_limit(monkeypatch):
    monkeypatch.delenv("AGENTENV_ENVD_MEMORY_LIMIT_MB", raising=False)
    assert OomGuard.from_environ() is None
    monkeypatch.setenv("AGENTENV_ENVD_MEMORY_LIMIT_MB", "512")
    assert OomGuard.from_environ().limit == 512 << 20


def test_kept_descriptor_reads_the_file_of_that_moment():
    """The guard reads /proc/meminfo through one descriptor kept open: each look must see the file of
    that moment, not as it was when first read. This host's MemAvailable is no fixed measure (its
    balloon and hot-plugged memory move it by hundreds of MiB), so the re-read is shown on a file that
    moves exactly: this process's own RSS in /proc/self/status, through the same class."""
    status = MemInfo("/proc/self/status")
    rss = lambda: int(re.search(rb"VmRSS:\s+(\d+) kB", status.read()).group(1)) << 10  # noqa: E731
    try:
        before = rss()
        hog = bytearray(400 << 20)
        hog[::4096] = b"x" * len(hog[::4096])  # touch every page
        assert rss() - before >= 350 << 20
        del hog
        assert rss() - before < 100 << 20
    finally:
        status.close()
    mem = MemInfo()
    try:  # and /proc/meminfo through it reads as a fresh open does
        fresh_before, kept, fresh_after = memory_used(), mem.used(), memory_used()
        slack = 32 << 20
        assert min(fresh_before, fresh_after) - slack <= kept <= max(fresh_before, fresh_after) + slack
    finally:
        mem.close()


def test_looks_more_often_as_memory_nears_the_limit():
    """Far under the limit the guard waits, but never longer than memory growing at ALLOC_RATE would
    need to reach it; near it (and after a kill) it looks every POLL_S."""
    guard = OomGuard(1 << 30)
    guard.last_used = 100 << 20
    far = guard.next_look_in()
    assert POLL_S < far <= POLL_MAX_S
    assert guard.last_used + far * ALLOC_RATE <= guard.limit - guard.margin + 1
    guard.last_used = guard.limit - guard.margin - (10 << 20)
    assert guard.next_look_in() == POLL_S
    guard.last_used = 0
    big = OomGuard(64 << 30)
    assert big.next_look_in() == POLL_MAX_S
    assert guard.next_look_in() < big.next_look_in()
