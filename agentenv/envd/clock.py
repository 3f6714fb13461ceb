"""Step the guest clock to the host's after a restore.

A microVM restored from a checkpoint resumes with the wall clock it had when it was captured (no
kvmclock under TCG; under KVM the clock source is restored too): it lags by however long the image
sat on disk. The host sends its time in every `/init` (E2B's envd protocol has the `timestamp`
field for exactly this), and envd, PID 1 of the guest with CAP_SYS_TIME, steps CLOCK_REALTIME when
it is off by more than `MAX_SKEW_S`. Under gVisor the sandbox shares the host's clock and
clock_settime is refused; that is fine, there is nothing to correct.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime

log = logging.getLogger("agentenv.envd")

MAX_SKEW_S = 0.5


def parse_timestamp(value: object) -> float | None:
    """RFC 3339 time (`2026-12-02T19:30:00.123Z`) -> Unix seconds; None when absent or invalid."""
    if not isinstance(value, str) or not value:
        return None
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return None
    if dt.tzinfo is None:
        return None
    return dt.timestamp()


def sync(host_time: float) -> float | None:
    """Step the clock to `host_time` if it is off by more than MAX_SKEW_S. Returns the skew corrected
    (seconds the guest was behind; negative: ahead), or None when nothing was (or could be) done."""
    skew = host_time - time.time()
    if abs(skew) <= MAX_SKEW_S:
        return None
    try:
        time.clock_settime(time.CLOCK_REALTIME, host_time)
    except (PermissionError, OSError) as e:
        log.debug("guest clock %.1fs off the host's, not stepped: %s", skew, e)
        return None
    log.info("guest clock stepped by %+.3fs to the host's time", skew)
    return skew
