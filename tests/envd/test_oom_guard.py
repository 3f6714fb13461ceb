"""envd's in-sandbox OOM killer (envd/oom.py) on real processes: over the limit, the largest
process is killed and envd itself is spared."""

from __future__ import annotations

import subprocess
import sys
import time

from agentenv.envd.oom import OomGuard, biggest_process, memory_used


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
