"""Resource limits that hold, and attacks from inside one sandbox that must leave the node and the
other sandboxes serving. Runs its own server with tight per-sandbox limits (disk images,
bandwidth cap, open files, 512 MiB / 1 CPU sandboxes); a bystander sandbox's command latency is measured during each attack and
printed (the numbers in docs/security.md come from this output)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from e2b import CommandExitException, Sandbox

from sec_util import Latency, LimitsServer, start_limits_server, stop_limits_server

RESULTS: dict[str, dict] = {}
ATTACK_S = 20


@pytest.fixture(scope="module")
def limits(server) -> Iterator[LimitsServer]:
    subnet = os.environ.get("AGENTENV_TEST_RUNTIME_SUBNET", "10.214.0.0/16")
    base = server.data_dir.with_name(server.data_dir.name + "-limits")
    srv = start_limits_server(base, server.data_dir / "images", subnet)
    try:
        yield srv
    finally:
        stop_limits_server(srv)
        if RESULTS:
            print("\nsecurity results: " + json.dumps(RESULTS, indent=1))


@pytest.fixture(scope="module")
def make(limits) -> Iterator:
    made: list[Sandbox] = []

    def create(**kw) -> Sandbox:
        sbx = Sandbox.create(api_key=limits.api_key, api_url=limits.api_url, sandbox_url=limits.api_url,
                             timeout=900, **kw)
        made.append(sbx)
        return sbx

    yield create
    for s in made:
        try:
            s.kill()
        except Exception:  # noqa: BLE001
            pass


@pytest.fixture(scope="module")
def bystander(make) -> Sandbox:
    return make()


@pytest.fixture(scope="module")
def baseline(bystander) -> dict:
    with Latency(bystander) as lat:
        time.sleep(8)
    RESULTS["baseline"] = lat.summary()
    print(f"\nbaseline: bystander latency with no attack {RESULTS['baseline']}")
    assert not lat.errors
    return RESULTS["baseline"]


def _node_serves(limits: LimitsServer) -> None:
    assert limits.proc.poll() is None, "the server died"
    assert requests.get(limits.api_url + "/health", timeout=10).status_code == 200


def _attack(name: str, limits, bystander, attacker: Sandbox, cmd: str, *, user: str = "user") -> tuple[Latency, str]:
    """Starts `cmd` in the attacker, samples the bystander for ATTACK_S seconds, returns both views."""
    attacker.commands.run(f"nohup sh -c '{cmd}' >/tmp/attack.log 2>&1 &", user=user, timeout=30)
    with Latency(bystander) as lat:
        time.sleep(ATTACK_S)
    RESULTS[name] = lat.summary()
    print(f"\n{name}: bystander latency during the attack {RESULTS[name]}")
    assert not lat.errors, lat.errors[:3]
    assert lat.samples, "no command completed in the bystander during the attack"
    _node_serves(limits)
    try:
        after = attacker.commands.run("tail -c 600 /tmp/attack.log; echo", timeout=30).stdout
    except Exception as e:  # noqa: BLE001 - the attacker may be gone (memory limit)
        after = f"<attacker unreachable: {type(e).__name__}>"
    return lat, after


def test_limits_are_applied_inside(make, limits):
    sbx = make()
    assert sbx.commands.run("ulimit -n").stdout.strip() == str(limits.nofile)
    mem_kb = int(sbx.commands.run("awk '/MemTotal/{print $2}' /proc/meminfo").stdout)
    assert mem_kb <= limits.memory_mb * 1024
    # the disk quota: the writable layer stops at the template's disk size, the host keeps its space
    r = sbx.commands.run(f"dd if=/dev/zero of=/home/user/fill bs=1M count={limits.disk_mb + 200} 2>&1; "
                         "stat -c %s /home/user/fill", timeout=300)
    size = int(r.stdout.strip().splitlines()[-1])
    assert limits.disk_mb * 0.9 * 2**20 <= size <= limits.disk_mb * 2**20, r.stdout
    assert "No space left" in r.stdout or "Disk quota" in r.stdout
    # deleting frees the quota again, and the sandbox keeps working
    sbx.commands.run("rm /home/user/fill")
    sbx.files.write("/home/user/after.txt", "x" * 10_000)
    assert sbx.commands.run("wc -c < /home/user/after.txt").stdout.strip() == "10000"


def _disk_image(limits, sbx: Sandbox) -> Path:
    return limits.data_dir / "sandboxes" / sbx.sandbox_id / "disk.img"


def test_disk_image_is_sparse_and_goes_with_the_sandbox(limits, make):
    t0 = time.monotonic()
    sbx = make()
    RESULTS["create_with_disk_image_s"] = {"s": round(time.monotonic() - t0, 2)}
    img = _disk_image(limits, sbx)
    st = img.stat()
    assert st.st_size == limits.disk_mb << 20
    assert st.st_blocks * 512 < st.st_size // 4  # only what was written takes host space
    sbx.kill()
    assert not img.exists() and not img.parent.exists()


def _fill(sbx: Sandbox, name: str, mb: int) -> int:
    """Writes up to `mb` MiB of zeros; returns the bytes that made it to disk."""
    r = sbx.commands.run(f"dd if=/dev/zero of=/home/user/{name} bs=1M count={mb} 2>/dev/null; "
                         f"stat -c %s /home/user/{name}; rm -f /home/user/{name}", timeout=300)
    return int(r.stdout.strip().splitlines()[-1])


def test_disk_image_through_pause_resume_fork_and_snapshot(limits, make):
    sbx = make()
    sbx.commands.run("head -c 100000 /dev/urandom > /home/user/keep && md5sum /home/user/keep > /home/user/keep.md5")
    img = _disk_image(limits, sbx)
    sbx.pause()
    # A paused sandbox holds no loop device: its container, slot and disk go right after the pause
    # has answered (`SandboxHost.stand_down_later`), in well under a second.
    deadline = time.monotonic() + 10
    while img.with_name("disk").is_mount():
        assert time.monotonic() < deadline, "the paused sandbox still holds its loop device after 10 s"
        time.sleep(0.05)
    assert img.exists()
    sbx = Sandbox.connect(sbx.sandbox_id, api_key=limits.api_key, api_url=limits.api_url,
                          sandbox_url=limits.api_url)
    assert sbx.commands.run("md5sum -c /home/user/keep.md5").exit_code == 0
    assert _fill(sbx, "f", limits.disk_mb + 100) <= limits.disk_mb << 20
    # fork (a capture: the upper is sealed into a layer out of the image): both sides keep the file
    # and each has a disk of its own with the full quota again
    r = requests.post(f"{limits.api_url}/sandboxes/{sbx.sandbox_id}/fork", json={"count": 1},
                      headers={"X-API-KEY": limits.api_key}, timeout=300)
    assert r.status_code == 201, r.text
    child_id = r.json()[0]["sandbox"]["sandboxID"]
    child = Sandbox.connect(child_id, api_key=limits.api_key, api_url=limits.api_url, sandbox_url=limits.api_url)
    try:
        for s in (sbx, child):
            assert s.commands.run("md5sum -c /home/user/keep.md5").exit_code == 0
            written = _fill(s, "g", limits.disk_mb + 100)
            assert (limits.disk_mb - 64) << 20 <= written <= limits.disk_mb << 20
        assert _disk_image(limits, child).exists()
        snap = sbx.create_snapshot()
        try:
            restored = make(template=snap.snapshot_id)
            assert restored.commands.run("md5sum -c /home/user/keep.md5").exit_code == 0
            assert _disk_image(limits, restored).exists()
        finally:
            Sandbox.delete_snapshot(snap.snapshot_id, api_key=limits.api_key, api_url=limits.api_url)
    finally:
        child.kill()


def test_bandwidth_cap(make, limits):
    sbx = make()
    mb = 10
    sbx.commands.run(f"head -c {mb * 2**20} /dev/urandom > /home/user/blob")
    t0 = time.monotonic()
    data = sbx.files.read("/home/user/blob", format="bytes")
    dt = time.monotonic() - t0
    assert len(data) == mb * 2**20
    mbit = len(data) * 8 / dt / 1e6
    RESULTS["download_mbit_with_cap"] = {"cap": limits.bandwidth_mbit, "measured": round(mbit, 1)}
    print(f"\ndownload through a {limits.bandwidth_mbit} Mbit/s cap: {mbit:.1f} Mbit/s")
    assert mbit <= limits.bandwidth_mbit * 1.25


def test_fork_bomb(limits, make, bystander, baseline):
    attacker = make()
    _, log = _attack("fork_bomb", limits, bystander, attacker, "timeout 60 bash -c \":(){ :|:& };:\"")
    # the attacker's sandbox is contained: the API still controls it
    attacker.kill()
    assert bystander.commands.run("echo alive").stdout == "alive\n"


def test_memory_hog(limits, make, bystander, baseline):
    """The hog's process dies (envd's OOM guard kills the largest process), its sandbox lives on."""
    attacker = make()
    hog = "python3 -c \"a=[]\nwhile True: a.append(bytearray(32<<20))\""
    _, log = _attack("memory_hog", limits, bystander, attacker, hog)
    print(f"memory_hog: attacker afterwards: {log.strip()[-200:]!r}")
    assert attacker.commands.run("echo survived", timeout=30).stdout == "survived\n"
    assert attacker.commands.run("pgrep -f 'bytearra[y]' >/dev/null && echo hog || echo none").stdout == "none\n"
    # and a foreground hog gets the exit status of a killed process
    with pytest.raises(CommandExitException) as e:
        attacker.commands.run(hog, timeout=120)
    RESULTS["memory_hog"]["foreground_exit"] = e.value.exit_code
    print(f"memory_hog: foreground hog ended with exit code {e.value.exit_code}: {e.value.error!r}")
    assert attacker.commands.run("echo still").stdout == "still\n"
    assert bystander.commands.run("echo alive").stdout == "alive\n"


def test_disk_filler(limits, make, bystander, baseline):
    attacker = make()
    _, log = _attack("disk_filler", limits, bystander, attacker,
                     "for i in $(seq 1 40); do dd if=/dev/zero of=/home/user/f$i bs=1M count=100; done")
    used = _disk_image(limits, attacker).stat().st_blocks * 512
    RESULTS["disk_filler"]["host_bytes_used"] = used
    assert used <= (limits.disk_mb + 64) * 2**20, used
    assert "No space left" in log or "quota" in log.lower(), log


def test_open_file_exhaustion(limits, make, bystander, baseline):
    attacker = make()
    opener = ("python3 -c \"import os,time\nfs=[]\ntry:\n  [fs.append(os.open(\\\"/etc/hostname\\\", os.O_RDONLY)) "
              "for _ in range(10**6)]\nexcept OSError as e: print(len(fs), e, flush=True)\ntime.sleep(60)\"")
    cmd = " & ".join([opener] * 8) + " & wait"
    _, log = _attack("open_files", limits, bystander, attacker, cmd)
    counts = [int(line.split()[0]) for line in log.splitlines() if line[:1].isdigit()]
    RESULTS["open_files"]["per_process_fds"] = counts[:8]
    assert counts and max(counts) < limits.nofile, log
    assert attacker.commands.run("echo still").stdout == "still\n"


def test_cpu_hog(limits, make, bystander, baseline):
    attacker = make()
    _attack("cpu_hog", limits, bystander, attacker, "for i in 1 2 3 4 5 6 7 8; do timeout 60 sh -c \"while :; do :; done\" & done; wait")
    attacker.kill()
