"""GVisorRuntime + NetworkManager against real runsc, netns and nftables (no mocks)."""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import socket
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from agentenv import constants
from agentenv.config import Settings
from agentenv.errors import RuntimeFailure
from agentenv.network.manager import NetworkManager
from agentenv.runtimes.gvisor import GVisorRuntime

from .conftest import DATA_DIR, Outside, SandboxKit, http_get, is_mounted, run, wait_http


def report(msg: str) -> None:
    print(f"[measure] {msg}")


def tcp_reachable_port(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def link_exists(ifname: str) -> bool:
    return os.path.exists(f"/sys/class/net/{ifname}")


def cgroup_dirs(sandbox_id: str) -> list[str]:
    return glob.glob(f"/sys/fs/cgroup/*/agentenv/{sandbox_id}") + glob.glob(f"/sys/fs/cgroup/agentenv/{sandbox_id}")


async def assert_gone(kit: SandboxKit, box) -> None:
    assert box.sandbox_id not in await kit.rt.list_ids()
    assert not os.path.exists(box.slot.netns_path)
    assert not link_exists(box.slot.veth_host)
    assert cgroup_dirs(box.sandbox_id) == []
    assert not is_mounted(box.rootfs)
    nft = run("nft", "list", "set", "ip", kit.net.names.host_table, "internet").stdout
    assert f'"{box.slot.veth_host}"' not in nft


async def test_start_http_stop_leaves_nothing(kit: SandboxKit):
    box, latency = await kit.start(memory_mb=384)
    report(f"start-to-HTTP {latency:.3f}s")
    assert await kit.rt.is_alive(box.sandbox_id)
    assert box.sandbox_id in await kit.rt.list_ids()
    who = http_get(box.slot.host_ip, "/whoami")
    assert who == {"local": constants.GUEST_IP, "hostname": "sandbox"}
    # memory limit from the spec is what the guest sees
    meminfo = http_get(box.slot.host_ip, "/meminfo")["meminfo"]
    total_kb = int(next(line.split()[1] for line in meminfo.splitlines() if line.startswith("MemTotal:")))
    assert abs(total_kb - 384 * 1024) <= 384 * 1024 * 0.02, total_kb
    # the tools layer is mounted read-only
    marker = f"tools of {box.sandbox_id}"
    (kit.tools / "marker.txt").write_text(marker)
    assert http_get(box.slot.host_ip, f"/file?path={constants.TOOLS_MOUNT}/marker.txt")["content"] == marker
    res = http_get(box.slot.host_ip, f"/write?path={constants.TOOLS_MOUNT}/new.txt")
    assert res["written"] is False and "Read-only" in res["error"], res
    assert not (kit.tools / "new.txt").exists()
    assert cgroup_dirs(box.sandbox_id), "cgroups of the running sandbox should exist"

    await kit.destroy(box)
    await assert_gone(kit, box)
    # idempotent
    await kit.rt.stop(box.sandbox_id)
    await kit.net.release(box.slot)
    assert not await kit.rt.is_alive(box.sandbox_id)


async def test_two_sandboxes_same_inner_ip_isolated(kit: SandboxKit):
    (a, _), (b, _) = await asyncio.gather(kit.start(), kit.start())
    assert a.slot.host_ip != b.slot.host_ip
    assert http_get(a.slot.host_ip, "/whoami")["local"] == constants.GUEST_IP
    assert http_get(b.slot.host_ip, "/whoami")["local"] == constants.GUEST_IP
    # independent processes
    assert http_get(a.slot.host_ip, "/count")["count"] == 1
    assert http_get(a.slot.host_ip, "/count")["count"] == 2
    assert http_get(b.slot.host_ip, "/count")["count"] == 1
    # Never the other sandbox, nor a host service listening on all addresses via any slot's host side.
    with socket.create_server(("0.0.0.0", 0)) as host_srv:
        host_port = host_srv.getsockname()[1]
        assert tcp_reachable_port(a.slot.peer_ip, host_port)  # the listener itself works
        for target, port in ((b.slot.host_ip, 49983), (b.slot.peer_ip, host_port), (a.slot.peer_ip, host_port)):
            res = http_get(a.slot.host_ip, f"/connect?host={target}&port={port}&timeout=1")
            assert res["connected"] is False, (target, res)
    res = http_get(b.slot.host_ip, f"/connect?host={a.slot.host_ip}&port=49983&timeout=1")
    assert res["connected"] is False, res
    # Killing one leaves the other untouched.
    await kit.destroy(a)
    await assert_gone(kit, a)
    assert http_get(b.slot.host_ip, "/count")["count"] == 2


async def test_pause_resume(kit: SandboxKit):
    box, _ = await kit.start()
    assert http_get(box.slot.host_ip, "/count")["count"] == 1
    t0 = time.monotonic()
    await kit.rt.pause(box.sandbox_id)
    t_pause = time.monotonic() - t0
    assert await kit.rt.state(box.sandbox_id) == "paused"
    assert await kit.rt.is_alive(box.sandbox_id)
    with pytest.raises(OSError):
        http_get(box.slot.host_ip, "/count", timeout=0.5)
    t0 = time.monotonic()
    await kit.rt.resume(box.sandbox_id)
    t_resume = time.monotonic() - t0
    report(f"pause {t_pause * 1e3:.0f} ms, resume {t_resume * 1e3:.0f} ms")
    assert await kit.rt.state(box.sandbox_id) == "running"
    # gVisor's netstack accepted the request sent while paused; it is served after resume, so
    # the counter moved on by it (or not, if the client's close won the race) but never went back.
    assert http_get(box.slot.host_ip, "/count")["count"] >= 2


async def test_freeze_and_thaw_keep_runscs_state_and_never_resume_a_running_sandbox(kit: SandboxKit):
    """Pause and resume go through the sandbox's control socket (`gvisor_control`), not a runsc start:
    runsc's own commands must see the state they leave, and since a resume of a sandbox that is not
    paused kills it (gVisor's pause is counted), a resume or a second pause must not be sent then."""
    from agentenv.runtimes import gvisor_control
    from agentenv.runtimes.gvisor_state import StateFiles
    box, _ = await kit.start()
    sid, root = box.sandbox_id, kit.rt.root
    assert http_get(box.slot.host_ip, "/count")["count"] == 1
    # an unknown method is refused before anything runs: the caller falls back to runsc
    states = StateFiles(Path(root))
    with pytest.raises(gvisor_control.NotAsked):
        gvisor_control.call(states.control_socket(sid), sid, "containerManager.NoSuchMethod")
    with pytest.raises(gvisor_control.NotAsked):
        gvisor_control.call(states.control_socket("nosuchsandbox0000000x"), "nosuchsandbox0000000x",
                            "containerManager.Pause")
    # resume of a running sandbox: refused (by runsc), and the sandbox runs on
    with pytest.raises(RuntimeFailure):
        await kit.rt.resume(sid)
    assert http_get(box.slot.host_ip, "/count")["count"] == 2
    # paused here, resumed by runsc's own CLI: it finds the state it expects
    await kit.rt.pause(sid)
    with pytest.raises(RuntimeFailure):  # a second pause is refused, not counted
        await kit.rt.pause(sid)
    assert "paused" in run("runsc", f"--root={root}", "state", sid).stdout
    run("runsc", f"--root={root}", "resume", sid)
    assert http_get(box.slot.host_ip, "/count")["count"] == 3  # one resume thawed it
    # paused by runsc's CLI, resumed here
    run("runsc", f"--root={root}", "pause", sid)
    with pytest.raises(OSError):
        http_get(box.slot.host_ip, "/count", timeout=0.5)
    await kit.rt.resume(sid)
    assert await kit.rt.state(sid) == "running"
    assert http_get(box.slot.host_ip, "/count")["count"] >= 4
    await kit.destroy(box)
    await assert_gone(kit, box)


async def test_checkpoint_restore_into_two_new_slots(kit: SandboxKit):
    src, _ = await kit.start()
    for i in range(1, 4):
        assert http_get(src.slot.host_ip, "/count")["count"] == i
    (src.rootfs / "srv" / "note.txt").write_text("written before checkpoint")
    await asyncio.sleep(0.3)  # let the closed connections' last ACKs land: no endpoint may remain

    image = src.dir / "checkpoint"
    t0 = time.monotonic()
    await kit.rt.checkpoint(src.sandbox_id, image)
    t_ckpt = time.monotonic() - t0
    assert not await kit.rt.is_alive(src.sandbox_id)
    assert src.sandbox_id not in await kit.rt.list_ids()
    image_mb = sum(p.stat().st_size for p in image.rglob("*") if p.is_file()) / 1e6

    # Children: new ids, new slots, rootfs at a different path (copy of the source's upper).
    run("umount", str(src.rootfs))
    children = [await kit.prepare(upper_from=src.upper) for _ in range(2)]
    times = []
    for child in children:
        t0 = time.monotonic()
        await kit.rt.restore(child.spec, image)
        await kit.net.activate(child.slot)
        wait_http(child.slot.host_ip)
        times.append(time.monotonic() - t0)
    report(f"checkpoint {t_ckpt:.3f}s image {image_mb:.1f} MB; restore-to-HTTP {', '.join(f'{t:.3f}s' for t in times)}")

    a, b = children
    assert http_get(a.slot.host_ip, "/count")["count"] == 4
    assert http_get(b.slot.host_ip, "/count")["count"] == 4
    assert http_get(a.slot.host_ip, "/count")["count"] == 5
    assert http_get(b.slot.host_ip, "/count")["count"] == 5
    assert http_get(a.slot.host_ip, "/count")["count"] == 6
    # File state came along and each child writes to its own rootfs.
    assert http_get(a.slot.host_ip, "/file?path=/srv/note.txt")["content"] == "written before checkpoint"
    (a.rootfs / "srv" / "note.txt").write_text("child a")
    assert http_get(b.slot.host_ip, "/file?path=/srv/note.txt")["content"] == "written before checkpoint"
    assert http_get(a.slot.host_ip, "/file?path=/srv/note.txt")["content"] == "child a"
    assert http_get(a.slot.host_ip, "/whoami")["local"] == constants.GUEST_IP


async def test_checkpoint_restore_same_id_same_slot(kit: SandboxKit):
    """The 'pause to disk' flow: checkpoint, then restore under the same id into its own slot."""
    box, _ = await kit.start()
    assert http_get(box.slot.host_ip, "/count")["count"] == 1
    await asyncio.sleep(0.3)
    image = box.dir / "checkpoint"
    await kit.rt.checkpoint(box.sandbox_id, image)
    await kit.net.deactivate(box.slot)
    t0 = time.monotonic()
    await kit.rt.restore(box.spec, image)
    await kit.net.activate(box.slot)
    wait_http(box.slot.host_ip)
    report(f"restore same id/slot to HTTP {time.monotonic() - t0:.3f}s")
    assert http_get(box.slot.host_ip, "/count")["count"] == 2


async def test_checkpoint_through_the_control_socket_and_its_refusal_on_a_full_disk(kit: SandboxKit):
    """A checkpoint that leaves the sandbox running is asked of the Sentry over its control socket
    (`gvisor_control.Control.checkpoint`: no runsc start while it is frozen). An image file that
    cannot be created, or a refusal there (a real ENOSPC: a 1 MiB tmpfs as the image dir), thaws it
    and says why; with room the image is written, the sandbox runs on, and the image restores into
    a new slot."""
    from agentenv.errors import CaptureRefused
    box, _ = await kit.start()
    sid = box.sandbox_id
    assert kit.rt.settings.runsc_checkpoint_via == "socket"
    assert http_get(box.slot.host_ip, "/count")["count"] == 1
    await asyncio.sleep(0.3)  # the closed connections' last ACKs land: no endpoint may remain
    console = box.spec.bundle_dir / "console.log"
    frozen_calls: list[str] = []

    async def while_frozen() -> None:
        frozen_calls.append(await kit.rt.state(sid))

    # an image dir already holding a file of that name: nothing is asked, the sandbox is thawed
    taken = box.dir / "taken"
    taken.mkdir()
    (taken / "checkpoint.img").write_text("not this checkpoint's")
    with pytest.raises(CaptureRefused):
        await kit.rt.checkpoint_running(sid, taken, while_frozen=while_frozen)
    assert await kit.rt.state(sid) == "running"
    assert http_get(box.slot.host_ip, "/count")["count"] == 2
    await asyncio.sleep(0.3)

    full = box.dir / "full"
    full.mkdir()
    run("mount", "-t", "tmpfs", "-o", "size=1m", "agentenv-test-full", str(full))
    try:
        with pytest.raises(CaptureRefused) as refused:
            await kit.rt.checkpoint_running(sid, full, while_frozen=while_frozen)
        assert "no space left on device" in refused.value.message.lower(), refused.value.message
        assert frozen_calls == [], "the disk was copied although the image failed"
        assert await kit.rt.state(sid) == "running"
        assert http_get(box.slot.host_ip, "/count")["count"] == 3
        assert "through the control socket" in console.read_text(errors="replace")
    finally:
        run("umount", str(full))

    image = box.dir / "image"
    await asyncio.sleep(0.3)
    frozen_s = await kit.rt.checkpoint_running(sid, image, while_frozen=while_frozen)
    assert frozen_calls == ["paused"], frozen_calls  # the disk is copied while it is frozen
    assert (image / "checkpoint.img").stat().st_size > 0 and (image / "pages.img").stat().st_size > 0
    assert "--- runsc checkpoint --leave-running" not in console.read_text(errors="replace"), \
        "the checkpoint ran a runsc command"
    report(f"checkpoint through the control socket: frozen {frozen_s * 1e3:.0f} ms")
    assert await kit.rt.state(sid) == "running"
    assert http_get(box.slot.host_ip, "/count")["count"] == 4
    await asyncio.sleep(0.3)
    child = await kit.prepare(upper_from=box.upper)
    await kit.rt.restore(child.spec, image)
    await kit.net.activate(child.slot)
    wait_http(child.slot.host_ip)
    assert http_get(child.slot.host_ip, "/count")["count"] == 4  # the counter as it was at the image
    assert http_get(box.slot.host_ip, "/count")["count"] == 5  # and the source runs on its own


def _neighbours(netns: str | None, dev: str) -> str:
    argv = ["ip"] + (["-n", netns] if netns else []) + ["neigh", "show", "dev", dev]
    return run(*argv).stdout


async def test_no_arp_in_a_slot_also_after_a_restore_into_it(kit: SandboxKit):
    """Every neighbour of a slot is permanent (an unanswered ARP stalled a fresh or restored sandbox's
    first connections 1 s), also after the slot's links were taken down for a restore into it."""
    box, _ = await kit.start()
    slot = box.slot

    def assert_permanent(where: str) -> None:
        host_side = _neighbours(None, slot.veth_host)
        assert f"{slot.host_ip} lladdr" in host_side and "PERMANENT" in host_side, f"{where}: {host_side!r}"
        ns_side = _neighbours(slot.netns, "host0")
        assert f"{slot.peer_ip} lladdr" in ns_side and "PERMANENT" in ns_side, f"{where}: {ns_side!r}"

    assert_permanent("after the start")
    await asyncio.sleep(0.3)
    image = box.dir / "checkpoint"
    await kit.rt.checkpoint(box.sandbox_id, image)
    await kit.net.deactivate(box.slot)
    gateway = _neighbours(slot.netns, "eth0")
    assert f"{constants.GUEST_GATEWAY_IP} lladdr {constants.GUEST_GATEWAY_MAC} PERMANENT" in gateway, gateway
    await kit.rt.restore(box.spec, image)
    await kit.net.activate(box.slot, guest_mac=constants.GUEST_MAC)
    assert_permanent("after a restore into the slot")
    wait_http(slot.host_ip)


async def test_cleanup_orphans_after_crash(kit: SandboxKit, settings):
    box, _ = await kit.start()
    # Simulated crash: forget every object; a fresh manager/runtime must find and remove it.
    # (The box stays registered with the kit so a failing assertion still cleans it up.)
    net2, rt2 = NetworkManager(settings), GVisorRuntime(settings)
    found = net2.slot_for(box.sandbox_id)  # before any discovery: scans the kernel
    assert found == box.slot
    await net2.setup_host()
    assert net2.slot_for(box.sandbox_id) == box.slot
    assert box.sandbox_id in await rt2.list_ids()
    # Only sandboxes of this data dir are touched; keep every other agentenv netns on the host.
    others = {net2.names.sandbox_of_netns(n) for n in os.listdir("/run/netns")} - {None}
    keep = (others | {b.sandbox_id for b in kit.boxes}) - {box.sandbox_id}
    assert box.sandbox_id in await rt2.cleanup_orphans(keep)
    removed = await net2.cleanup_orphans(keep)
    assert box.sandbox_id in removed
    run("umount", str(box.rootfs), check=False)
    shutil.rmtree(box.dir, ignore_errors=True)
    await assert_gone(kit, box)


async def test_allocation_speed_and_release(kit: SandboxKit):
    slots, times = [], []
    try:
        for _ in range(10):
            t0 = time.monotonic()
            slots.append(await kit.net.allocate(kit.new_id("alloc")))
            times.append(time.monotonic() - t0)
        t0 = time.monotonic()
        parallel = await asyncio.gather(*[kit.net.allocate(kit.new_id("alloc")) for _ in range(20)],
                                        return_exceptions=True)
        t_par = time.monotonic() - t0
        slots += [s for s in parallel if not isinstance(s, BaseException)]
        errors = [e for e in parallel if isinstance(e, BaseException)]
        assert not errors, errors
        with pytest.raises(RuntimeFailure):
            await kit.net.allocate(slots[0].sandbox_id)  # one slot per sandbox
        assert len({s.index for s in slots}) == len(slots)
        assert len({s.host_ip for s in slots}) == len(slots)
        nft = run("nft", "list", "set", "ip", kit.net.names.host_table, "internet").stdout
        assert all(f'"{s.veth_host}"' in nft for s in slots)
    finally:
        t0 = time.monotonic()
        for s in slots:
            await kit.net.release(s)
        t_rel = (time.monotonic() - t0) / max(len(slots), 1)
    report(f"allocate median {statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms; "
           f"20 in parallel {t_par * 1e3:.0f} ms; release {t_rel * 1e3:.1f} ms each")
    for s in slots:
        assert not os.path.exists(s.netns_path) and not link_exists(s.veth_host)


async def test_internet_access_switch(kit: SandboxKit, outside: Outside):
    """Guest -> outside works only for slots in the root-ns `internet` set (forward + masquerade)."""
    (a, _), (b, _) = await asyncio.gather(kit.start(allow_internet=True), kit.start(allow_internet=False))

    def reach(box) -> bool:
        res = http_get(box.slot.host_ip, f"/connect?host={outside.ip}&port={outside.port}&timeout=1")
        return res["connected"]

    assert reach(a) is True
    assert reach(b) is False
    b.slot = await kit.net.set_internet(b.slot, True)
    a.slot = await kit.net.set_internet(a.slot, False)
    assert kit.net.slot_for(b.sandbox_id).allow_internet is True
    assert reach(b) is True
    assert reach(a) is False


async def test_failed_start_cleans_up(kit: SandboxKit):
    box = await kit.prepare()
    box.spec.args = ["/does/not/exist"]
    with pytest.raises(RuntimeFailure):
        await kit.rt.start(box.spec)
    assert box.sandbox_id not in await kit.rt.list_ids()
    assert cgroup_dirs(box.sandbox_id) == []
    await kit.destroy(box)
    await assert_gone(kit, box)


OLD_RUNSC_VERSION = "0.0~20221219.0-2+b3"  # Debian 12's own runsc, what agentenv ran before 20240729


def old_runsc(cache: Path) -> Path | None:
    """Debian 12's runsc binary, fetched with `apt-get download` and unpacked once (None if apt has none)."""
    binary = cache / "unpacked" / "usr" / "bin" / "runsc"
    if binary.exists():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["apt-get", "download", f"runsc={OLD_RUNSC_VERSION}"], cwd=cache, capture_output=True,
                       text=True, timeout=300)
    debs = sorted(cache.glob("runsc_*.deb"))
    if r.returncode != 0 or not debs:
        return None
    subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(cache / "unpacked")], check=True, timeout=120)
    return binary


async def test_image_of_the_old_runsc_fails_with_the_cause(kit: SandboxKit, settings: Settings):
    """Upgrade path: a memory image written by Debian 12's runsc (paused sandboxes, snapshots of an
    older agentenv) is refused by the current runsc at once, with an error naming the cause."""
    binary = old_runsc(DATA_DIR.parent / f"{DATA_DIR.name}-old-runsc")
    if binary is None:
        pytest.skip(f"apt-get download runsc={OLD_RUNSC_VERSION} failed (no Debian 12 archive in apt)")
    old = GVisorRuntime(settings.model_copy(update={"runsc_path": str(binary), "runsc_platform": "ptrace"}))
    box = await kit.prepare()
    await old.start(box.spec)
    try:
        await kit.net.activate(box.slot)
        wait_http(box.slot.host_ip)
        await asyncio.sleep(0.3)
        image = box.dir / "checkpoint"
        await old.checkpoint(box.sandbox_id, image)  # the old runsc stops the container
    finally:
        await old.stop(box.sandbox_id)
    await kit.net.deactivate(box.slot)
    t0 = time.monotonic()
    with pytest.raises(RuntimeFailure) as e:
        await kit.rt.restore(box.spec, image)
    assert time.monotonic() - t0 < 60  # never a hang
    assert e.value.error_code == "image_incompatible", e.value.message
    assert "cannot restore a checkpoint across releases" in e.value.message
    assert not await kit.rt.is_alive(box.sandbox_id)  # nothing half-restored
    assert box.sandbox_id not in await kit.rt.list_ids()


def _host_spin_share(seconds: float) -> float:
    """CPU time a busy host process (this test's own cgroup, like the node agent) gets per second of
    wall time while the sandboxes spin."""
    code = ("import os,time\nt=time.monotonic()+%f\nwhile time.monotonic()<t: pass\n"
            "print(sum(os.times()[:2]))" % seconds)
    t0 = time.monotonic()
    out = subprocess.run(["python3", "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out) / (time.monotonic() - t0)


async def test_host_processes_run_first_when_sandboxes_saturate_the_cpu(kit: SandboxKit):
    """All sandboxes together weigh `sandbox_cpu_weight` (5) against a host process's 100: a node agent
    whose sandboxes burn every core still gets the CPU it asks for (its heartbeat stays on time)."""
    from agentenv.runtimes.gvisor import CGROUP_FS, CGROUP_PARENT

    box, _ = await kit.start(cpu_count=os.cpu_count() or 1)
    v1 = CGROUP_FS / "cpu" / CGROUP_PARENT / "cpu.shares"
    if v1.exists():
        assert v1.read_text().strip() == str(kit.settings.sandbox_cpu_weight * 1024 // 100)
    else:
        assert (CGROUP_FS / CGROUP_PARENT / "cpu.weight").read_text().strip() == str(kit.settings.sandbox_cpu_weight)
    procs = 2 * (os.cpu_count() or 1)
    assert len(http_get(box.slot.host_ip, f"/burn?procs={procs}&seconds=8")["pids"]) == procs
    await asyncio.sleep(1.0)  # the children are spinning
    share = await asyncio.to_thread(_host_spin_share, 3.0)
    report(f"a busy host process got {share:.2f} of a core while {procs} sandbox processes spun "
           f"({os.cpu_count()} cores)")
    # With the kernel's default weight it got 0.51 of a core here (2 cores); weight 5: 0.96, and
    # 0.85 in a CI run on a busy machine (the host process also shares the cores with other host
    # processes). 0.75 keeps well clear of both.
    assert share >= 0.75, share
    await kit.destroy(box)
    await assert_gone(kit, box)


def _cut_state_file(kit: SandboxKit, sandbox_id: str) -> Path:
    """What a runsc command killed while saving the container's state leaves: runsc truncates the file
    and then writes it (measured with random SIGKILLs of `runsc pause`/`resume`: an empty file)."""
    path, = Path(kit.rt.root).glob(f"{sandbox_id}_sandbox:*.state")
    path.write_bytes(b"")
    probe = run("runsc", f"--root={kit.rt.root}", "state", sandbox_id, check=False)
    assert probe.returncode != 0 and "unexpected end of JSON input" in probe.stderr, probe.stderr
    return path


async def test_state_file_cut_by_a_killed_runsc_is_put_back(kit: SandboxKit):
    """A cut state file made runsc refuse every command on a live sandbox (a restarted server then
    dropped it): the state agentenv expected before the pause or resume is put back."""
    box, _ = await kit.start()
    sid = box.sandbox_id
    await kit.rt.pause(sid)
    _cut_state_file(kit, sid)
    assert await kit.rt.state(sid) == "paused"  # the status the killed `runsc pause` was saving
    await kit.rt.resume(sid)
    assert http_get(box.slot.host_ip, "/count")["count"] >= 1
    await kit.rt.pause(sid)
    await kit.rt.resume(sid)
    _cut_state_file(kit, sid)
    assert await kit.rt.is_alive(sid)
    assert await kit.rt.state(sid) == "running"
    assert http_get(box.slot.host_ip, "/count")["count"] >= 2
    await kit.destroy(box)
    await assert_gone(kit, box)
    assert not list(Path(kit.rt.root).glob(f"**/{sid}*")), "runsc's or agentenv's state of the sandbox is left"


async def test_stop_of_a_sandbox_whose_state_cannot_be_put_back_leaves_nothing(kit: SandboxKit):
    """A state file cut with nothing to put back (a runsc killed while creating the container): runsc
    cannot delete it, so stop kills its processes and removes what runsc keeps of it."""
    box, _ = await kit.start()
    sid = box.sandbox_id
    _cut_state_file(kit, sid)
    assert await kit.rt.state(sid) is None
    await kit.destroy(box)
    await assert_gone(kit, box)
    assert not list(Path(kit.rt.root).glob(f"*{sid}*")), "runsc's state, lock or socket of the sandbox is left"
