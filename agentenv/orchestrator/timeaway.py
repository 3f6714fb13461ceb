"""How long a restored sandbox was away, so that its commands' timeouts count only the time it ran.

Under gVisor a restored sandbox's monotonic clock has moved on by the wall time since its capture
(`RuntimeTraits.restore_advances_clock`). envd's kill timers run on that clock; E2B's (a Firecracker
guest's clock stands still while it is paused) do not count a pause. So every capture stamps its
memory image with the time it was taken (`stamp`), a restore on such a runtime notes how long ago that
was (`restored`), and the next `/init` hands it to envd (`take`; `agentenvAwayMs`), which moves every
process deadline back by that much (`agentenv/envd/lifetime.py`).

A pooled sandbox is told at its take, so its wait in the pool is not counted: that is harmless, as
what pools restore (warm images, template builds) holds no command with a timeout (a template's
start command has none).
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

    def restored(self, sandbox_id: str, image_dir: Path) -> None:
        """The sandbox was just restored from `image_dir` on a runtime whose clock moved on meanwhile."""
        at = captured_at(image_dir)
        if at is not None:
            self._away[sandbox_id] = max(0.0, time.time() - at)

    def take(self, sandbox_id: str) -> float | None:
        """The time away to tell envd now (None: nothing to tell); told once."""
        return self._away.pop(sandbox_id, None)

    def forget(self, sandbox_id: str) -> None:
        self._away.pop(sandbox_id, None)
