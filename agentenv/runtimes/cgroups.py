"""The cgroup every sandbox's processes live under (`/agentenv`, `constants.CGROUP_PARENT`).

runsc places a gVisor sandbox's processes in `/agentenv/<sandbox id>` itself; a VM runtime places
its VMM there with `place` and removes the group with `remove`. The parent's CPU weight
(`weigh_sandboxes_cpu`, `Settings.sandbox_cpu_weight`) makes all sandboxes together weigh less than
one host process, so a saturated host still runs its control plane first. The sampler reads each
sandbox's CPU (and, for runsc's groups, memory) from the same groups.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import signal
import time
from pathlib import Path

from agentenv.constants import CGROUP_PARENT, CGROUP_ROOT
from agentenv.errors import RuntimeFailure
from agentenv.runtimes._reaper import process_name

log = logging.getLogger(__name__)

CGROUP_FS = Path(CGROUP_ROOT)
# A stopped sandbox's group still busy after this long has strays in it (`remove`).
KILL_AFTER_S = 1.0


def weigh_sandboxes_cpu(weight: int) -> str | None:
    """Give the parent cgroup of every sandbox (`/agentenv`, created here if runsc has not yet) a CPU
    weight of `weight` (cgroup v2 `cpu.weight`; v1 `cpu.shares` = weight × 1024 / 100). Returns what
    was written, or None (0: left alone; no writable cgroup fs). Sandboxes keep their own CPU quota
    below it; the weight only decides who runs first when the host's CPU is saturated.

    Measured on a 2-core host at 48 busy sandboxes (the cluster load test), a node agent's main thread
    over 8 s: at the kernel's default weight it ran 0.11 s and waited 2.9 s on the run queue (its
    heartbeats took seconds and nodes fenced themselves); at weight 5 it waited 0.14-0.33 s."""
    if weight <= 0:
        return None
    try:
        if (CGROUP_FS / "cpu" / "cpu.shares").exists():  # v1
            d = CGROUP_FS / "cpu" / CGROUP_PARENT
            d.mkdir(exist_ok=True)
            value, name = str(max(2, weight * 1024 // 100)), "cpu.shares"
        elif (CGROUP_FS / "cgroup.controllers").exists():  # v2
            d = CGROUP_FS / CGROUP_PARENT
            d.mkdir(exist_ok=True)
            if not (d / "cpu.weight").exists():  # the cpu controller is not on for the root's children
                (CGROUP_FS / "cgroup.subtree_control").write_text("+cpu")
            value, name = str(min(10000, weight)), "cpu.weight"
        else:
            return None
        (d / name).write_text(value)
        return f"{d / name} = {value}"
    except OSError as e:
        log.warning("could not set the sandboxes' CPU weight (%s); under a saturated CPU the node's own "
                    "processes compete with them as equals: %s", CGROUP_FS / CGROUP_PARENT, e)
        return None


def place(sandbox_id: str, pid: int, weight: int) -> Path | None:
    """Move process `pid` (all its threads) into `/agentenv/<sandbox_id>` of the CPU controller,
    weighing the parent first (`weight`). Returns the group, or None where there is no writable
    cgroup fs (logged: the process then competes with the host's as an equal)."""
    weigh_sandboxes_cpu(weight)
    if (CGROUP_FS / "cpu" / "cpu.shares").exists():  # v1: one tree per controller
        d = CGROUP_FS / "cpu" / CGROUP_PARENT / sandbox_id
    elif (CGROUP_FS / "cgroup.controllers").exists():  # v2
        d = CGROUP_FS / CGROUP_PARENT / sandbox_id
    else:
        return None
    try:
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.procs").write_text(str(pid))
    except OSError as e:
        log.warning("could not put %s (pid %d) under %s: %s", sandbox_id, pid, d.parent, e)
        return None
    return d


def _nested(group: str) -> list[str]:
    """The groups nested in `group`, deepest first. By `scandir`'s entry types: a cgroup v1 group
    holds dozens of control files, and stat-ing each (`Path.rglob` + `is_dir`) cost a kill
    ~2 ms of the server's CPU over the controllers."""
    found, todo = [], [group]
    while todo:
        with os.scandir(todo.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    found.append(entry.path)
                    todo.append(entry.path)
    return sorted(found, key=lambda p: -p.count("/"))


def _groups(sandbox_id: str) -> list[str]:
    """The sandbox's group in every controller (cgroup v1: one tree each) or the unified tree (v2)."""
    return glob.glob(str(CGROUP_FS / "*" / CGROUP_PARENT / sandbox_id)) + \
        glob.glob(str(CGROUP_FS / CGROUP_PARENT / sandbox_id))


async def remove(sandbox_id: str, owner: str | None = None, wait_s: float = 5.0) -> None:
    """Remove `/agentenv/<sandbox_id>` (and groups nested in it) in every controller, once its
    processes are gone: a group is busy (EBUSY) for a moment after its last process exited.

    Called when the sandbox is stopped. `owner`: what the command line of this runtime's processes
    of the sandbox contains (runsc's `--root`, a VM's bundle dir). Those still in its group after
    `KILL_AFTER_S` outlived the stop (`runsc delete` did not end them; seen for a sandbox a restarted
    server's recovery dropped, whose EBUSY then aborted the server's start). They are killed
    (logged), then the group goes. Nothing else is: the group's name is the sandbox id, and another server on the
    same host may run that sandbox now (a paused sandbox moved between two nodes of one host).
    A group still busy `wait_s` after that is an error."""
    dirs = _groups(sandbox_id)
    t0 = time.monotonic()
    deadline = t0 + wait_s
    for d in dirs:
        killed = False
        while True:
            try:
                # Children first (runsc may create nested groups); rmdir only works on empty groups.
                for sub in _nested(d):
                    os.rmdir(sub)
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError as e:  # EBUSY while the last sandbox processes exit
                if owner and not killed and time.monotonic() - t0 > KILL_AFTER_S:
                    killed = True
                    n = len(kill_members(Path(d), owner))
                    if n:
                        log.warning("sandbox %s: %d process(es) outlived it in %s; killed", sandbox_id, n, d)
                        deadline = time.monotonic() + wait_s
                if time.monotonic() > deadline:
                    raise RuntimeFailure(f"cannot remove cgroup {d}: {e}") from e
                await asyncio.sleep(0.05)


def freeze(sandbox_id: str, frozen: bool = True) -> bool:
    """Freeze (or thaw) every process of the sandbox in the host's cgroup freezer: v1's
    `freezer/agentenv/<id>/freezer.state`, v2's `agentenv/<id>/cgroup.freeze`. A frozen sandbox
    takes no CPU at all; its memory, network slot and connections stay as they are. Returns whether
    a freezer took it (False: the sandbox has no group with a freezer, e.g. a VM's CPU-only v1
    group; or none is writable). Idempotent; a plain write, cheap enough for the event loop.

    What it is for: an idle gVisor sandbox is not idle on the host. runsc 20240729's systrap platform
    wakes a Go timer every 400 µs whatever the sandbox does (its fast-path monitor; gVisor issue
    #13361, parked when idle only since gVisor PR #13470 of 2026-06), measured at 25-47 ms of CPU a
    second per sandbox here. A pooled sandbox waits frozen (`SandboxPool`)."""
    for path, value in ((CGROUP_FS / "freezer" / CGROUP_PARENT / sandbox_id / "freezer.state",
                         "FROZEN" if frozen else "THAWED"),
                        (CGROUP_FS / CGROUP_PARENT / sandbox_id / "cgroup.freeze", "1" if frozen else "0")):
        try:
            path.write_text(value)
            return True
        except FileNotFoundError:
            continue
        except OSError as e:
            log.warning("could not %s sandbox %s (%s): %s", "freeze" if frozen else "thaw", sandbox_id, path, e)
            return False
    return False


def set_timer_slack(sandbox_id: str, slack_ns: int) -> int:
    """Give every thread of the sandbox (all its processes: Sentry, gofer, stubs) a timer slack of
    `slack_ns` (`/proc/<tid>/timerslack_ns`, see prctl(2) PR_SET_TIMERSLACK): the kernel may then
    fire their timed waits up to that much late and batch the wake-ups. Threads they create later
    inherit it. Returns how many threads took it (0: no group with a thread list, e.g. no cgroup fs).

    What it is for: runsc 20240729's systrap platform wakes a Go timer every 400 µs however idle the
    sandbox is (see `freeze`); coarser host timers make those wake-ups fewer. Measured on an idle
    `runsc do sleep`: 44 ms of CPU a second at the kernel's default 50 µs, 27 at 1 ms, 17 at 5 ms,
    7 at 20 ms. The price is the sandbox's own timers: a 1 ms `sleep` inside took 1.2 ms at the
    default, 1.9 ms at 1 ms of slack, 5.9 ms at 5 ms (syscalls, I/O, process spawns and loopback TCP
    round trips inside did not change); `commands.run("true")` took as long at 1 ms as at the
    default, 5 ms more at 5 ms and 26 ms more at 20 ms (the Sentry's own short waits are timers too),
    and one connection's HTTP round trips into the sandbox ran 13 % slower at 0.5 ms and 35 % at
    1 ms. Timers fire late, never early. Hence off by default (`sandbox_timer_slack_us`)."""
    value = str(slack_ns)
    done: set[int] = set()
    for _ in range(2):  # a thread made meanwhile by one not yet set inherited the old slack
        for tid in _thread_ids(sandbox_id):
            if tid in done:
                continue
            try:
                with open(f"/proc/{tid}/timerslack_ns", "w") as slack:
                    slack.write(value)
                done.add(tid)
            except (FileNotFoundError, ProcessLookupError):
                pass  # the thread ended meanwhile
            except OSError as e:  # an optimisation: never a reason to fail a start
                log.warning("could not set the timer slack of sandbox %s's threads: %s", sandbox_id, e)
                return len(done)
    return len(done)


def _thread_ids(sandbox_id: str) -> list[int]:
    """Every thread in the sandbox's group and the groups nested in it, from the first controller's
    group that lists threads (v1 `tasks`, v2 `cgroup.threads`; all controllers hold the same ones)."""
    for group in _groups(sandbox_id):
        for name in ("tasks", "cgroup.threads"):
            if not os.path.exists(os.path.join(group, name)):
                continue
            try:
                dirs = [group, *_nested(group)]
            except OSError:  # the group went meanwhile (the sandbox stopped)
                return []
            tids: list[int] = []
            for d in dirs:
                try:
                    with open(os.path.join(d, name)) as f:
                        tids += [int(x) for x in f.read().split()]
                except (OSError, ValueError):
                    pass
            return tids
    return []


def kill_members(group: Path, owner: str, comm: str | None = None) -> list[int]:
    """SIGKILL every process in `group` (and the groups nested in it) whose command line contains
    `owner` (and, given `comm`, whose name is `comm`); returns their pids. `group` is a sandbox's
    group (`/agentenv/<sandbox id>` of some controller): the sandbox is thawed first, since a process
    frozen by cgroup v1's freezer (`freeze`) does not die of a SIGKILL until it is thawed."""
    freeze(group.name, False)
    mark = os.fsencode(owner)
    killed = []
    for procs in [group / "cgroup.procs"] + [Path(sub) / "cgroup.procs" for sub in _nested(str(group))]:
        try:
            pids = [int(x) for x in procs.read_text().split()]
        except (OSError, ValueError):
            continue
        for pid in pids:
            try:
                if mark not in Path(f"/proc/{pid}/cmdline").read_bytes():
                    continue
                if comm is not None and process_name(pid) != comm:
                    continue
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, FileNotFoundError):
                pass
    return killed


def kill_sandbox(sandbox_id: str, owner: str, comm: str) -> list[int]:
    """SIGKILL the sandbox's processes named `comm` whose command line contains `owner`, found in its
    group of the first controller that has one; returns their pids. The group is thawed first: a
    process frozen by cgroup v1's freezer (a pooled sandbox, `freeze`) does not die of a SIGKILL
    until it is thawed (`kill_members` does)."""
    for d in _groups(sandbox_id):
        if os.path.exists(os.path.join(d, "cgroup.procs")):
            return kill_members(Path(d), owner, comm)
    return []
