"""What a restored sandbox continues from its memory image besides its memory: its boot and its clock.

**Its boot.** A sandbox's /proc/sys/kernel/random/boot_id is a file in its sandbox dir, bind-mounted
(`SandboxSpec.boot_id_file`). Every capture copies it into the image (`record`); a restore continues
that boot, a boot or a create from a template is a new one (`write_boot_id`).

**Its clock.** Under gVisor a restored sandbox's monotonic clock has moved on by the wall time since
its capture (`RuntimeTraits.restore_advances_clock`). envd's kill timers run on that clock; E2B's (a
Firecracker guest's clock stands still while it is paused) do not count a pause. So every capture
stamps its image with the time it began (`record`), a restore on such a runtime notes how long ago
that was (`time_away`, kept by `SandboxHost` until then), and the next `/init` hands it to envd
(`agentenvAwayMs`), which moves every process deadline back by that much (`agentenv/envd/lifetime.py`).
A pooled sandbox is told at its take, so its wait in the pool is not counted: that is harmless, as
what pools restore (warm images, template builds) holds no command with a timeout (a template's
start command has none).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from pathlib import Path

log = logging.getLogger("agentenv.orchestrator")

# In a sandbox dir: its boot_id (bind-mounted). In a memory image: the boot it continues.
BOOT_ID_FILE = "boot_id"
CAPTURED_AT_FILE = "captured_at"  # in a memory image: the Unix time its capture began


def record(sandbox_dir: Path, image_dir: Path, captured_at: float) -> None:
    """After a capture into `image_dir`: the boot it continues and the time the capture began."""
    try:
        (image_dir / CAPTURED_AT_FILE).write_text(f"{captured_at:.3f}\n")
    except OSError as e:
        log.warning("could not record the capture time in %s: %s", image_dir, e)
    boot_id = sandbox_dir / BOOT_ID_FILE
    try:  # without it a restore is a new boot_id
        if boot_id.is_file():
            shutil.copyfile(boot_id, image_dir / BOOT_ID_FILE)
    except OSError as e:
        log.warning("could not record the boot_id of %s in its image: %s", sandbox_dir.name, e)


def write_boot_id(sandbox_dir: Path, image: Path | None) -> None:
    """Write the sandbox's /proc/sys/kernel/random/boot_id (bind-mounted from its sandbox dir).

    gVisor fixes its own boot_id when its kernel boots and keeps it in a checkpoint, so every
    sandbox warm-started from one template image would share it. A boot, and a create from a
    template (its warm or built image is ours, not the user's), is a new boot; a restore of
    `image` continues the boot the image recorded (`record`): a full pause/resume (also on another
    node), a capture's source, fork children and sandboxes created from a memory snapshot. An image
    without one (taken before the mount existed) restores its own mount table, so the file it gets
    here is unused.
    """
    boot = None
    if image is not None:
        try:
            boot = str(uuid.UUID((image / BOOT_ID_FILE).read_text().strip()))
        except (OSError, ValueError):
            boot = None
    path = sandbox_dir / BOOT_ID_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{boot or uuid.uuid4()}\n")
    os.replace(tmp, path)


def time_away(image_dir: Path) -> float | None:
    """Seconds since the capture of the image just restored; None for an image from before agentenv
    recorded it (nothing is moved)."""
    try:
        return max(0.0, time.time() - float((image_dir / CAPTURED_AT_FILE).read_text().strip()))
    except (OSError, ValueError):
        return None
