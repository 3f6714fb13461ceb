"""runsc's container state files, kept manageable when a runsc command dies mid-write.

runsc saves a container's state (`<root>/<container>_sandbox:<sandbox>.state`, JSON) with a plain
truncate-and-write, under an flock on the `.lock` file beside it. A runsc command killed inside
that write (a server killed with its process group, Ctrl-C in a terminal, a timeout) leaves the
file empty or cut short. The sandbox itself runs on, but every later runsc command on it fails
with `reading container metadata file ...: unexpected end of JSON input`: it can no longer be
paused, captured or even deleted, and a restarted server took it for dead and dropped it.
(Measured: 1 in ~130 random SIGKILLs of `runsc pause`/`resume` left the file empty.)

The write happens only after the command's own work succeeded, so the truth after a cut write is
the status the command was setting. Before each pause, resume or checkpoint, `expect` keeps a copy
of the state with that status (agentenv's own file, beside runsc's); `repair` puts it back, under
runsc's lock, when runsc's file is found unreadable. `remove` deletes what a container that cannot
be repaired leaves in the root once its processes are gone. A freeze or thaw done without runsc
(`gvisor_control`) writes runsc's file itself, atomically and under runsc's lock (`held`, `save`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Iterator

from agentenv.proc import pid_exists

log = logging.getLogger(__name__)

EXPECTED_DIR = "agentenv-expected"  # in runsc's root; runsc only looks at `*.state` files there
LOCK_WAIT_S = 5.0
# runsc's message for a state file it cannot parse (container.Load -> StateFile.load)
_UNREADABLE = re.compile(r'reading container metadata file "([^"]+)"')


def unreadable_state_file(error: str) -> Path | None:
    """The state file a runsc error says it could not read, if that is what failed."""
    m = _UNREADABLE.search(error)
    return Path(m.group(1)) if m else None


class StateFiles:
    """The state files under one runsc `--root` (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _state_file(self, container_id: str) -> Path:
        return self.root / f"{container_id}_sandbox:{container_id}.state"

    def path(self, container_id: str) -> Path | None:
        """runsc's state file of a container (None if runsc has none). Every agentenv sandbox is one
        container whose sandbox id is its own id: the name is known, no listing of the root."""
        path = self._state_file(container_id)
        return path if path.exists() else None

    def control_socket(self, sandbox_id: str) -> Path:
        """The sandbox's control server, where runsc's commands (and `gvisor_control`) call it."""
        return self.root / f"runsc-{sandbox_id}.sock"

    def _expected(self, container_id: str) -> Path:
        return self.root / EXPECTED_DIR / f"{container_id}.json"

    def _keep(self, container_id: str, data: bytes) -> None:
        target = self._expected(container_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(target, data)

    def expect(self, container_id: str, status: str | None = None) -> None:
        """Keep the container's state as it will be once the next runsc command (which sets `status`,
        or leaves it) has saved it. Best effort: without a readable state there is nothing to keep."""
        path = self.path(container_id)
        state = _read(path) if path else None
        if state is None:
            return
        if status is not None:
            state["status"] = status
        self._keep(container_id, json.dumps(state).encode())

    @contextlib.contextmanager
    def held(self, container_id: str) -> Iterator[dict | None]:
        """runsc's lock on the container, held, and its state as read under it: what a runsc command
        sees. None (and no lock) when runsc has no readable state for it or its lock did not come."""
        path = self.path(container_id)
        if path is None:
            yield None
            return
        with _locked(path.with_suffix(".lock")) as held:
            yield _read(path) if held else None

    def save(self, container_id: str, state: dict, status: str) -> None:
        """Write the container's state with `status`, as runsc saves it and as expected from now on
        (under `held`: the caller did what runsc's command does)."""
        data = json.dumps({**state, "status": status}).encode()
        _write_atomic(self._state_file(container_id), data)
        self._keep(container_id, data)

    def repair(self, state_file: Path) -> bool:
        """Put the expected state back if `state_file` is unreadable; True if it was repaired."""
        container_id = state_file.name.split("_sandbox:", 1)[0]
        expected = self._expected(container_id)
        if state_file.parent != self.root or not expected.is_file():
            return False
        with _locked(state_file.with_suffix(".lock")) as held:
            if not held or _read(state_file) is not None:
                return False  # a runsc command is writing it right now, or it is readable again
            _write_atomic(state_file, expected.read_bytes())
        log.warning("runsc's state file of %s was cut short (a runsc command killed while saving it); "
                    "restored it with status %r", container_id, _read(state_file, {}).get("status"))
        return True

    def forget(self, container_id: str) -> None:
        """The container is gone: its expected state too."""
        self._expected(container_id).unlink(missing_ok=True)

    def delete_stopped(self, container_id: str) -> bool:
        """What `runsc delete` does for a container whose sandbox and gofer processes are gone
        (SIGKILLed and reaped by the caller): remove its state, lock and control socket, under
        runsc's lock. True if done; False (nothing done: the caller runs `runsc delete`) when its
        state is unreadable, one of its processes still exists, or its spec has hooks to run."""
        with self.held(container_id) as state:
            if state is None:
                return False
            sandbox = state.get("sandbox") or {}
            pids = [pid for pid in (state.get("goferPid"), sandbox.get("pid")) if isinstance(pid, int) and pid > 0]
            if not pids or any(pid_exists(pid) for pid in pids) or (state.get("spec") or {}).get("hooks"):
                return False
            sock = sandbox.get("controlSocketPath")
            self._delete(container_id, self._state_file(container_id),
                         Path(sock) if sock else self.control_socket(container_id))
        return True

    def remove(self, container_id: str) -> bool:
        """Delete what runsc keeps of a container whose state file is unreadable (its processes
        must be gone already): state, lock and control socket. True if there was such a file."""
        path = self.path(container_id)
        if path is None or _read(path) is not None:
            return False
        sandbox_id = path.name.split("_sandbox:", 1)[1].removesuffix(".state")
        self._delete(container_id, path, self.control_socket(sandbox_id))
        log.warning("removed runsc's unreadable state of %s", container_id)
        return True

    def _delete(self, container_id: str, state_file: Path, control_socket: Path) -> None:
        """What runsc keeps of a container whose processes are gone: its control socket, state and lock."""
        for leftover in (control_socket, state_file, state_file.with_suffix(".lock")):
            leftover.unlink(missing_ok=True)
        self.forget(container_id)


def _read(path: Path | None, default: dict | None = None) -> dict | None:
    try:
        state = json.loads(path.read_bytes()) if path else None
    except (OSError, ValueError):
        return default
    return state if isinstance(state, dict) else default


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)  # no fsync: what it guards against is a killed process, not a lost host
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[bool]:
    """runsc's flock on a container's `.lock` file, waited for up to LOCK_WAIT_S; yields whether held."""
    try:
        fd = os.open(lock_file, os.O_RDWR)
    except OSError:
        yield False
        return
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.05)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
