"""Captures that leave the sandbox running (`RuntimeTraits.captures_running`: gVisor).

The sandbox is frozen for its memory image (`checkpoint --leave-running`) and a copy of its
writable upper — only what changed since its previous capture (`storage.upperdiff`), stacked over
that capture's chain — then thawed; the copy and the image are sealed into a layer and a memory
artifact while it runs on (`seal_copy`). Used by `capture.Capture` for fork, snapshot and checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from agentenv.errors import AgentEnvError, CaptureRefused, Unavailable
from agentenv.models import SandboxRecord
from agentenv.orchestrator import continuity
from agentenv.orchestrator.host import SandboxHost, Sealed
from agentenv.orchestrator.trace import span
from agentenv.proc import run_cmd
from agentenv.storage import upperdiff

log = logging.getLogger("agentenv.orchestrator")

# A sandbox's last capture that left it running (`LiveCapture.remember`): the base of the next one's delta.
CAPTURE_BASE = "capture-base.json"
# At most this many deltas over a sandbox's own layers; then a capture copies its whole upper again
# (overlayfs takes a page of lower paths, ~40 layers).
MAX_DELTAS = 16


@dataclass
class FrozenCapture:
    """What `checkpoint_running` took: the freeze's length, the layers its upper copy goes over (pinned
    until `unpin_layers`), the upper's index at the freeze and the upper's inode."""

    frozen_s: float
    base: list[str]
    index: dict
    upper_ino: int


async def copy_tree(src: Path, dst: Path) -> None:
    """`cp -a` (owners, modes, xattrs incl. overlay whiteouts and opaque marks, hard links, holes);
    a reflink where the file system can (XFS, btrfs)."""
    shutil.rmtree(dst, ignore_errors=True)
    try:
        await run_cmd(["cp", "-a", "--reflink=auto", "--", str(src), str(dst)], timeout=600, what="cp -a upper")
    except BaseException:
        shutil.rmtree(dst, ignore_errors=True)
        raise


class LiveCapture:
    """The capture of a running sandbox on the host (no states: `capture.Capture` owns those)."""

    def __init__(self, host: SandboxHost) -> None:
        self.host = host

    async def checkpoint_running(self, rec: SandboxRecord, image_dir: Path, upper_copy: Path) -> "FrozenCapture":
        """Capture a running sandbox and leave it running: memory into `image_dir` and its writable
        upper into `upper_copy`, both taken while it is frozen (one instant), then thawed.

        `upper_copy` is what changed since the sandbox's previous capture (`upperdiff`), to be stacked
        over that capture's chain, or — the first time, after its upper was replaced, or every
        `MAX_DELTAS` captures — a copy of the whole upper over its own layers (`base`).
        The sandbox is unavailable only for the freeze. A refusal (Unavailable, 503) leaves it running
        and nothing in either directory; any other error means the runtime could not thaw it or it died.
        """
        sid = rec.sandbox_id
        rt = self.host.runtime_for(sid, rec.runtime)
        upper = self.host.rootfs.upper_path(sid)
        baseline = self._baseline(rec, upper)
        got = FrozenCapture(0.0, list(baseline["chain"]) if baseline else list(rec.layers), {}, os.stat(upper).st_ino)
        for d in got.base:
            self.host.pin_layer(d)
        await self.host.quiesce(sid)
        kwargs = {}
        if rt.traits.resets_connections:
            with span("envd.connections", sid):
                kwargs["reset_connections"] = await self.host.holds_connections(sid)

        async def copy_upper() -> None:
            with span("capture.copy_upper", sid):
                got.index = await upperdiff.index(upper)
                if baseline is None:
                    await copy_tree(upper, upper_copy)
                    return
                copy, gone = upperdiff.changes(upper, upperdiff.load(baseline["index"]), got.index)
                await upperdiff.write_delta(upper, upper_copy, copy, gone)

        began = time.time()
        try:
            with span("runtime.checkpoint_running", sid):
                got.frozen_s = await rt.checkpoint_running(sid, image_dir, while_frozen=copy_upper, **kwargs)
        except Exception as e:  # noqa: BLE001
            self.host.unpin_layers(got.base)
            if isinstance(e, CaptureRefused) or await rt.state(sid) == "running":
                shutil.rmtree(image_dir, ignore_errors=True)
                shutil.rmtree(upper_copy, ignore_errors=True)
                msg = e.message if isinstance(e, AgentEnvError) else str(e)
                log.warning("checkpoint of %s refused, sandbox untouched: %s", sid, msg)
                raise Unavailable(f"Sandbox {sid} could not be captured: {msg}", error_code="capture_failed",
                                  headers={"Retry-After": "5"}) from e
            raise
        continuity.record(self.host.sandbox_dir(sid), image_dir, began)
        if kwargs.get("reset_connections"):
            log.info("capture of %s reset its TCP connections first (one extra checkpoint while it ran)", sid)
        return got

    def _baseline(self, rec: SandboxRecord, upper: Path) -> dict | None:
        """The sandbox's previous capture, if its upper copy can be a delta over that capture's chain:
        the same upper (inode), the same layers under it, not too deep, every layer still here."""
        try:
            b = json.loads((self.host.sandbox_dir(rec.sandbox_id) / CAPTURE_BASE).read_text())
            same = b["upper_ino"] == os.stat(upper).st_ino and b["lowers"] == list(rec.layers)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not same or len(b["chain"]) - len(rec.layers) >= MAX_DELTAS:
            return None
        if not all(self.host.artifacts.layer_dir(d).is_dir() for d in b["chain"]):
            return None
        return b

    def remember(self, rec: SandboxRecord, got: "FrozenCapture", chain: list[str]) -> None:
        """The capture's chain and upper index: the base of the sandbox's next capture's delta."""
        path = self.host.sandbox_dir(rec.sandbox_id) / CAPTURE_BASE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"upper_ino": got.upper_ino, "lowers": list(rec.layers), "chain": chain,
                                   "index": got.index}))
        os.replace(tmp, path)

    async def seal_copy(self, sandbox_id: str, image: Path | None, upper_copy: Path) -> Sealed:
        """Seal what `checkpoint_running` took: the upper's copy into a layer, the image (if given) into
        a memory artifact (both pinned against GC until the caller unpins them: `unpin_sealed`)."""
        with span("seal.upper", sandbox_id):
            layer = await self.host.artifacts.seal_upper(upper_copy)
        if layer:
            self.host.pin_layer(layer)
        if image is None:
            return Sealed(layer, None)
        try:
            with span("seal.memory", sandbox_id):
                mem = await self.host.artifacts.seal_memory(image)
        except BaseException:
            if layer:
                self.host.unpin_layer(layer)
            raise
        self.host.pin(mem)
        return Sealed(layer, mem)
