"""Firecracker step of benchmarks/run.py: snapshot load through agentenv's runtime vs the bare VMM.

Both columns restore the same full snapshot (the purpose-written test guest of
tests/firecracker, 256 MiB of guest memory) into a fresh Firecracker process in the same slot
netns (which has its tap), samples interleaved:

- **ours**: `FirecrackerRuntime.restore(spec, image)`: fresh work dir, reflink copy of the writable
  disk, tap check, spawn in the netns, wait for the API socket, `PUT /snapshot/load` (File backend,
  resume), MMDS identity, metadata file.
- **raw**: the bare VMM driven by hand: `nsenter --net` + `firecracker --api-sock`, poll for the
  socket, one hand-written HTTP/1.1 `PUT /snapshot/load` over the Unix socket (disk copy and tap
  made beforehand, untimed).

Each is timed until the call returns (VM resumed) and until the guest prints its next counter line.
Also: pause, full and diff snapshot times, and 4 parallel restores (fork) through the runtime.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

MEM_MIB = 256


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _stats(xs: list[float]) -> dict:
    return {"n": len(xs), "min": min(xs), "p50": _pct(xs, 50), "p95": _pct(xs, 95), "max": max(xs),
            "mean": statistics.mean(xs)}


async def _http_put_unix(sock: str, path: str, body: dict) -> int:
    """One bare HTTP/1.1 PUT on a Unix socket; returns the status (the 'raw API call')."""
    data = json.dumps(body).encode()
    r, w = await asyncio.open_unix_connection(sock)
    w.write(f"PUT {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nAccept: application/json\r\n\r\n".encode() + data)
    await w.drain()
    status = int((await r.readline()).split()[1])
    while (await r.readline()) not in (b"\r\n", b""):
        pass
    w.close()
    return status


async def _wait_line(path: Path, after: int, timeout: float = 20.0) -> float:
    """Seconds until `path` shows a complete counter line above `after`."""
    from firecracker.testguest import counters

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            vals = counters(path.read_bytes())
        except OSError:
            vals = []
        if vals and vals[-1] > after:
            return time.monotonic() - t0
        await asyncio.sleep(0.0005)
    raise TimeoutError(f"no counter above {after} in {path}")


async def _raw_restore(binary: Path, netns_path: str, work: Path, image: Path):
    """(seconds until the load call returned, the process): the bare VMM restoring `image` in `work`."""
    from agentenv.runtimes.firecracker import CONSOLE_LOG, MEMORY_FILE, STATE_FILE

    sock = work / "api.sock"
    sock.unlink(missing_ok=True)
    console = open(work / CONSOLE_LOG, "wb")
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        "nsenter", f"--net={netns_path}", "--", str(binary), "--api-sock", "api.sock", cwd=work,
        stdout=console, stderr=console, stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
    console.close()
    while not sock.exists():
        await asyncio.sleep(0.0005)
    for _ in range(2000):
        try:
            status = await _http_put_unix(str(sock), "/snapshot/load", {
                "snapshot_path": str(image / STATE_FILE),
                "mem_backend": {"backend_type": "File", "backend_path": str(image / MEMORY_FILE)},
                "enable_diff_snapshots": True, "resume_vm": True})
            break
        except (ConnectionRefusedError, FileNotFoundError):
            await asyncio.sleep(0.0005)
    t_call = time.monotonic() - t0
    if status != 204:
        raise RuntimeError(f"raw snapshot load -> {status}: {(work / CONSOLE_LOG).read_text()[-500:]}")
    return t_call, proc


async def run(quick: bool, data_dir: Path, log=print) -> dict:
    from agentenv.config import load_settings
    from agentenv.network.manager import NetworkManager
    from agentenv.runtimes.base import SandboxSpec, VmBoot, VmDisk
    from agentenv.runtimes.firecracker import CONSOLE_LOG, FirecrackerRuntime, find_firecracker
    from agentenv.runtimes.select import detect_virt
    from agentenv.storage import reflink as rl
    from firecracker import testguest

    binary = find_firecracker()
    if binary is None:
        return {"skipped": "firecracker not installed (scripts/install-firecracker.sh)"}
    reps = 8 if quick else 40
    settings = load_settings(data_dir=data_dir)
    net = NetworkManager(settings)
    await net.setup_host()
    rt = FirecrackerRuntime(data_dir, binary=binary)
    res: dict = {"firecracker": binary.name, "binary": str(binary), "guest_mem_mib": MEM_MIB,
                 "host_virt": detect_virt().kind}
    slots: dict[str, object] = {}
    raw_procs: list = []
    try:
        guest = testguest.build(data_dir / "guest")
        tmpl = data_dir / "template.raw"
        with open(tmpl, "wb") as f:
            f.truncate(64 << 20)
        boot = VmBoot(kernel=guest.elf.resolve(), cmdline="console=ttyS0",
                      disks=[VmDisk("rootfs", tmpl, read_only=False, root=True)])

        async def spec(sid: str) -> SandboxSpec:
            if sid not in slots:
                slots[sid] = await net.allocate(sid, allow_internet=False)
            return SandboxSpec(sandbox_id=sid, rootfs=Path("/"), tools_dir=Path("/"), slot=slots[sid],
                               bundle_dir=data_dir / "b" / sid, cpu_count=1, memory_mb=MEM_MIB, vm=boot)

        # --- capture: boot, pause, full snapshot; restore, diff snapshot
        src = await spec("fcbsrc")
        t0 = time.monotonic()
        await rt.start(src)
        await _wait_line(rt.workdir("fcbsrc") / CONSOLE_LOG, 0)
        res["boot_to_first_line_s"] = time.monotonic() - t0
        vm = rt.vm("fcbsrc")
        t0 = time.monotonic()
        await vm.pause()
        res["pause_s"] = time.monotonic() - t0
        await vm.resume()
        image = rt.root / "bench-capture"
        shutil.rmtree(image, ignore_errors=True)
        t0 = time.monotonic()
        await rt.checkpoint("fcbsrc", image)
        res["full_checkpoint_s"] = time.monotonic() - t0
        res["full_memory_bytes"] = (image / "memory").stat().st_size
        await rt.restore(src, image)
        await _wait_line(rt.workdir("fcbsrc") / CONSOLE_LOG, guest.counter_in(image / "memory") + 1)
        vm = rt.vm("fcbsrc")
        t0 = time.monotonic()
        await vm.pause()
        await vm.snapshot(diff=True, state="d.state", memory="d.mem")
        res["diff_snapshot_s"] = time.monotonic() - t0
        with open(rt.workdir("fcbsrc") / "d.mem", "rb") as f:
            res["diff_dirty_bytes"] = sum(e - s for s, e in rl.data_extents(f.fileno(), os.fstat(f.fileno()).st_size))
        await rt.stop("fcbsrc")
        captured = guest.counter_in(image / "memory")

        # --- restore: ours vs raw, interleaved, same slot netns (tap0 there)
        sid = "fcbrest"
        s = await spec(sid)
        raw_work = rt.root / "bench-raw"
        ours_call, ours_line, raw_call, raw_line = [], [], [], []
        for i in range(reps):
            t0 = time.monotonic()
            await rt.restore(s, image)
            ours_call.append(time.monotonic() - t0)
            ours_line.append(ours_call[-1] + await _wait_line(rt.workdir(sid) / CONSOLE_LOG, captured))
            await rt.stop(sid)

            shutil.rmtree(raw_work, ignore_errors=True)
            raw_work.mkdir()
            rl.clone(image / "rootfs.raw", raw_work / "rootfs.raw")    # untimed: the bare VMM's disk
            t_call, proc = await _raw_restore(binary, s.slot.netns_path, raw_work, image)
            raw_procs.append(proc)
            raw_call.append(t_call)
            raw_line.append(t_call + await _wait_line(raw_work / CONSOLE_LOG, captured))
            await _kill(proc)
            raw_procs.remove(proc)
        res["restore"] = {"ours_call": _stats(ours_call), "ours_first_line": _stats(ours_line),
                          "raw_call": _stats(raw_call), "raw_first_line": _stats(raw_line),
                          "overhead_ratio_p50": _pct(ours_call, 50) / _pct(raw_call, 50),
                          "overhead_ratio_min": min(ours_call) / min(raw_call)}
        log(f"firecracker restore p50: ours {_pct(ours_call, 50) * 1e3:.1f} ms, raw {_pct(raw_call, 50) * 1e3:.1f} ms")

        # --- per-sandbox disks: reflink copy on the VM store vs a full copy (why the store is XFS)
        big = rt.root / "bench-disk.raw"
        with open(big, "wb") as f:
            for _ in range(256):
                f.write(os.urandom(1 << 20))
            f.flush()
            os.fsync(f.fileno())
        refl, full = [], []
        for i in range(5):
            t0 = time.monotonic()
            rl.reflink(big, rt.root / f"bench-disk-{i}.raw")
            refl.append(time.monotonic() - t0)
        for i in range(2):
            t0 = time.monotonic()
            _plain_copy(big, rt.root / f"bench-full-{i}.raw")   # read + write: what a filesystem without reflink pays
            full.append(time.monotonic() - t0)
        for p in rt.root.glob("bench-*.raw"):
            p.unlink()
        res["disk_256mib"] = {"reflink": _stats(refl), "full_copy": _stats(full)}

        # --- fork: 4 parallel restores into fresh slots
        kids = [await spec(f"fcbk{i}") for i in range(4)]
        fork = []
        for _ in range(3 if quick else 5):
            t0 = time.monotonic()
            await asyncio.gather(*(rt.restore(k, image) for k in kids))
            await asyncio.gather(*(_wait_line(rt.workdir(k.sandbox_id) / CONSOLE_LOG, captured) for k in kids))
            fork.append(time.monotonic() - t0)
            await asyncio.gather(*(rt.stop(k.sandbox_id) for k in kids))
        res["fork4_all_running_s"] = _stats(fork)
        shutil.rmtree(image, ignore_errors=True)
        shutil.rmtree(raw_work, ignore_errors=True)
    finally:
        for proc in raw_procs:
            await _kill(proc)
        for sid in list(slots):
            try:
                await rt.stop(sid)
            except Exception:  # noqa: BLE001
                pass
            await net.release(slots.pop(sid))
        await rt.close()
        rt.store.destroy()
    return res


def _plain_copy(src: Path, dst: Path) -> None:
    with open(src, "rb") as s, open(dst, "wb") as d:
        while chunk := s.read(1 << 20):
            d.write(chunk)
        d.flush()
        os.fsync(d.fileno())


async def _kill(proc) -> None:
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    await proc.wait()


def report(r: dict) -> list[str]:
    if not r or "skipped" in r:
        return [f"### Firecracker: skipped ({(r or {}).get('skipped', 'not run')})", ""]
    rs = r["restore"]

    def ms(x: float) -> str:
        return f"{x * 1e3:.1f} ms"

    return [
        f"### Firecracker snapshot load: agentenv runtime vs bare VMM ({r['guest_mem_mib']} MiB guest, "
        f"host KVM: {r['host_virt']})", "",
        "| | n | min | p50 | p95 | max |", "|---|---|---|---|---|---|",
        *(f"| {name} | {rs[k]['n']} | {ms(rs[k]['min'])} | {ms(rs[k]['p50'])} | {ms(rs[k]['p95'])} | "
          f"{ms(rs[k]['max'])} |"
          for name, k in (("agentenv `restore()` returns (VM resumed)", "ours_call"),
                          ("bare VMM: spawn + `PUT /snapshot/load` returns", "raw_call"),
                          ("agentenv: until the guest prints its next line", "ours_first_line"),
                          ("bare VMM: until the guest prints its next line", "raw_first_line"))),
        "", f"Overhead ratio agentenv / bare VMM: **{rs['overhead_ratio_p50']:.2f}×** at p50, "
        f"**{rs['overhead_ratio_min']:.2f}×** at the minimum (least disturbed by other load).", "",
        f"Pause {ms(r['pause_s'])}; full checkpoint (snapshot + move into the capture dir) "
        f"{ms(r['full_checkpoint_s'])}; diff snapshot {ms(r['diff_snapshot_s'])} "
        f"({r['diff_dirty_bytes'] / 1024:.0f} KiB dirty); fork into 4 restores, all printing: "
        f"p50 {ms(r['fork4_all_running_s']['p50'])}.", "",
        *([f"Per-sandbox disk of 256 MiB of data on the VM store: reflink copy p50 "
           f"{ms(r['disk_256mib']['reflink']['p50'])} vs full copy p50 {ms(r['disk_256mib']['full_copy']['p50'])}.", ""]
          if "disk_256mib" in r else []),
    ]


if __name__ == "__main__":
    data = Path(os.environ.get("AGENTENV_BENCH_DATA_DIR", "/var/tmp/agentenv-bench")) / "fc"
    out = asyncio.run(run("--quick" in sys.argv, data))
    print(json.dumps(out, indent=1))
    print("\n".join(report(out)))
