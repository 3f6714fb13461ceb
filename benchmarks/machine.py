"""What the whole machine spent, for the benchmarks that put a CPU cost next to a throughput."""

from __future__ import annotations

import os


def machine_cpu_s() -> float:
    """CPU seconds the whole machine spent so far (user + system + irq, not idle or iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")
