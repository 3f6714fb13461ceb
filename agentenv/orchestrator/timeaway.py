"""How long a restored sandbox was away, so that its commands' timeouts count only the time it ran.

Under gVisor a restored sandbox's monotonic clock has moved on by the wall time since its capture
(`RuntimeTraits.restore_advances_clock`), and so has it after a wait frozen in the pool (the cgroup
freezer stops the Sentry, not the host clock it reads). envd's kill timers run on that clock; E2B's
(a Firecracker guest's clock stands still while it is paused) do not count a pause. So every capture
stamps its memory image with the time it was taken (`stamp`), a restore on such a runtime notes how
long ago that was (`restored`), a pooled sandbox adds the time it waited frozen (`parked`,
`unparked`), and the next `/init` hands envd the total (`take`; `agentenvAwayMs`), which moves every
process deadline back by that much (`agentenv/envd/lifetime.py`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

log = logging.getLogger("agentenv.orchestrator")

CAPTURED_AT_FILE = "captured_at"  # in a memory image: the Unix time its capture began


def stamp(image_dir: Path, captured_at: float) -> None:
    """Record in a memory image when its capture began (the sandbox's clock stopped counting then)."""
    try:
        (image_dir / CAPTURED_AT_FILE).write_text(f"{captured_at:.3f}\n")
    except OSError as e:
        log.warning("could not record the capture time in %s: %s", image_dir, e)


def captured_at(image_dir: Path) -> float | None:
    try:
        return float((image_dir / CAPTURED_AT_FILE).read_text().strip())
    except (OSError, ValueError):
        return None  # an image from before agentenv recorded it: nothing is moved


class TimeAway:
    """Per sandbox on this node: the seconds it was away that envd has not been told of yet."""

    def __init__(self) -> None:
        self._away: dict[str, float] = {}
        self._parked_at: dict[str, float] = {}

    def restored(self, sandbox_id: str, image_dir: Path) -> None:
        """The sandbox was just restored from `image_dir` on a runtime whose clock moved on meanwhile."""
        at = captured_at(image_dir)
        if at is not None:
            self._away[sandbox_id] = self._away.get(sandbox_id, 0.0) + max(0.0, time.time() - at)

    def parked(self, sandbox_id: str) -> None:
        self._parked_at[sandbox_id] = time.monotonic()

    def unparked(self, sandbox_id: str) -> None:
        since = self._parked_at.pop(sandbox_id, None)
        if since is not None:
            self._away[sandbox_id] = self._away.get(sandbox_id, 0.0) + (time.monotonic() - since)

    def take(self, sandbox_id: str) -> float | None:
        """The time away to tell envd now (None: nothing to tell); told once."""
        return self._away.pop(sandbox_id, None)

    def forget(self, sandbox_id: str) -> None:
        self._away.pop(sandbox_id, None)
        self._parked_at.pop(sandbox_id, None)
