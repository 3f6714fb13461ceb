"""Detect host resources an agentenv server (or a crash of it) left behind for a data dir.

Used by the session ``server`` fixture after shutdown + ``agentenv gc`` and by
``tests/test_zz_leftovers.py`` right after killing a sandbox.  Everything is read from the
host (``runsc list``, ``ip netns list``, ``/proc``), never from the server's own state.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from agentenv.network.slots import SlotNames
from agentenv.proc import pid_alive
from agentenv.runtimes.gvisor_state import EXPECTED_DIR

# Servers started by the tests inherit AGENTENV_INSTANCE (and need their own AGENTENV_SLOT_SUBNET);
# the names below follow agentenv.network.slots.SlotNames so parallel sessions never see each other.
INSTANCE = os.environ.get("AGENTENV_INSTANCE", "")
NETNS_PREFIX = f"agentenv-{INSTANCE}-" if INSTANCE else "agentenv-"
HOST_TABLE = f"agentenv-{INSTANCE}" if INSTANCE else "agentenv"


def runsc_root(data_dir: str | os.PathLike[str]) -> Path:
    return Path(data_dir) / "run" / "runsc"


def runsc_containers(data_dir: str | os.PathLike[str]) -> list[str]:
    """IDs of all runsc containers under ``<data_dir>/run/runsc`` (empty if the root is absent)."""
    root = runsc_root(data_dir)
    if not root.is_dir():
        return []
    runsc = shutil.which("runsc")
    if runsc is None:
        # Without runsc nobody could have started a container; state files would still be a leak.
        return [f"<runsc missing; state entries: {p.name}>" for p in root.iterdir()]
    proc = subprocess.run(
        [runsc, "--root", str(root), "list", "-quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"runsc list failed ({proc.returncode}): {proc.stderr.strip()}")
    listed = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    # the state agentenv keeps for a container's next status change (runtimes/gvisor_state.py) goes with it
    kept = sorted(root.glob(f"{EXPECTED_DIR}/*.json"))
    return listed + [f"<expected state of {p.stem}, a container runsc no longer has>" for p in kept
                     if p.stem not in listed]


def live_spare(name: str, instance: str = INSTANCE) -> bool:
    """A ready network slot of a running server (agentenv/network/spares.py): its own, not a
    leftover. A dead server's are leftovers."""
    owner = SlotNames(instance).spare_owner(name)
    return owner is not None and pid_alive(owner)


def _ours(name: str) -> bool:
    """A netns of this instance: ``<prefix><sandbox id>`` (sandbox ids never contain ``-``), or a
    dead server's spare slot (``<prefix>_<pid>_<index>``)."""
    return name.startswith(NETNS_PREFIX) and "-" not in name[len(NETNS_PREFIX):] and not live_spare(name)


def agentenv_netns() -> list[str]:
    """Names of this instance's sandbox network namespaces (``agentenv-[<instance>-]<id>``)."""
    names: set[str] = set()
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    if proc.returncode == 0:
        for line in proc.stdout.splitlines():
            parts = line.split()
            if parts and _ours(parts[0]):
                names.add(parts[0])
    netns_dir = Path("/run/netns")
    if netns_dir.is_dir():
        names.update(p.name for p in netns_dir.iterdir() if _ours(p.name))
    return sorted(names)


def _unescape_mountinfo(path: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal sequences
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def mounts_under(directory: str | os.PathLike[str]) -> list[str]:
    """Mount points strictly below ``directory`` in this process's mount namespace."""
    base = os.path.realpath(directory).rstrip("/")
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 5:
                continue
            mount_point = _unescape_mountinfo(fields[4])
            if mount_point.startswith(base + "/"):
                found.append(mount_point)
    return found


def processes_mentioning(text: str, exclude_pids: set[int] | frozenset[int] = frozenset()) -> list[str]:
    """``"<pid>: <cmdline>"`` for every process whose command line mentions ``text`` as a path.

    ``text`` must be followed by ``/``, a separator or the end of an argument so that
    ``/var/tmp/agentenv-test`` does not match ``/var/tmp/agentenv-test2``.
    """
    pattern = re.compile(re.escape(text.rstrip("/")) + r"(?=/|\x00|\s|=|:|$)")
    skip = set(exclude_pids) | {os.getpid()}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid in skip:
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # exited meanwhile, or a kernel thread
        if not raw:
            continue
        cmdline = raw.decode("utf-8", "replace")
        if pattern.search(cmdline):
            found.append(f"{pid}: {cmdline.replace(chr(0), ' ').strip()}")
    return found


@dataclass
class Leftovers:
    containers: list[str] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)
    processes: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)  # scratch a server removes (forks' kept images)

    def __bool__(self) -> bool:
        return bool(self.containers or self.netns or self.mounts or self.processes or self.files)

    def describe(self) -> str:
        parts = []
        if self.containers:
            parts.append(f"runsc containers: {self.containers}")
        if self.netns:
            parts.append(f"network namespaces: {self.netns}")
        if self.mounts:
            parts.append(f"mounts: {self.mounts}")
        if self.processes:
            parts.append("processes:\n    " + "\n    ".join(self.processes))
        if self.files:
            parts.append(f"files: {self.files}")
        return "\n  ".join(parts) if parts else "nothing"


def haproxy_master(config: Path) -> int | None:
    """The HAProxy master running `config` in master-worker mode (its workers are its children)."""
    from agentenv.proxy.haproxy import processes_running

    pids = processes_running(config)
    for pid in pids:
        if parent_of(pid) not in pids:
            return pid
    return None


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def find_leftovers(
    data_dir: str | os.PathLike[str],
    *,
    ignore_netns: set[str] | frozenset[str] = frozenset(),
    exclude_pids: set[int] | frozenset[int] = frozenset(),
) -> Leftovers:
    """Everything still on the host that belongs to the agentenv instance using ``data_dir``.

    ``ignore_netns``: ``agentenv-*`` namespaces that existed before the server under test was
    started (they cannot be its leftovers; e.g. another instance on a developer machine).
    """
    given = os.path.abspath(data_dir)
    real = os.path.realpath(data_dir)
    processes = processes_mentioning(real, exclude_pids)
    if given != real:
        processes += [p for p in processes_mentioning(given, exclude_pids) if p not in processes]
    return Leftovers(
        containers=runsc_containers(real),
        netns=[n for n in agentenv_netns() if n not in ignore_netns],
        mounts=mounts_under(real),
        processes=processes,
        files=sorted(str(p) for p in Path(real, "fork-images").glob("*")) + data_plane_sock_dir(real),
    )


def data_plane_sock_dir(data_dir: str) -> list[str]:
    """The data plane's socket dir in the temp dir, while it exists (a stop or `agentenv gc` removes it)."""
    from agentenv.proxy.haproxy import sock_dir_for

    d = sock_dir_for(Path(data_dir))
    return [str(d)] if d.exists() else []


def assert_no_leftovers(
    data_dir: str | os.PathLike[str],
    *,
    ignore_netns: set[str] | frozenset[str] = frozenset(),
    exclude_pids: set[int] | frozenset[int] = frozenset(),
) -> None:
    """Fail if any runsc container, ``agentenv-*`` netns, mount or process of ``data_dir`` is left."""
    left = find_leftovers(data_dir, ignore_netns=ignore_netns, exclude_pids=exclude_pids)
    assert not left, f"agentenv left resources behind for {data_dir}:\n  {left.describe()}"
