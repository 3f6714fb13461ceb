"""QEMU step of benchmarks/run.py: the real Linux guest through agentenv's QEMU runtime.

Drives `QemuRuntime` directly (no API server) with agentenv's own NetworkManager slots, the
guest image of the data dir (built first if absent) and envd's /health as "ready":

- **cold boot**: `start` -> envd healthy (kernel boot + initramfs + envd start, under TCG here);
- **checkpoint**: migration to a file with `x-ignore-shared` (the RAM file is moved, not copied);
- **restore**: one clone from that image into a fresh slot -> `restore` returned -> envd healthy;
- **fork**: N clones of the same image in parallel -> all healthy;
- **memory per clone**: RSS, PSS, shared and private pages of every clone's QEMU process while
  all run: the clones map the checkpoint's RAM file copy-on-write, so PSS << RSS.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MEM_MIB = 512


def _smaps(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "kB":
            out[parts[0].rstrip(":")] = int(parts[1])
    return out


async def run(quick: bool, data_dir: Path, images_from: Path | None = None, log=print) -> dict:
    from agentenv.config import load_settings
    from agentenv.network.manager import NetworkManager
    from agentenv.orchestrator import envd_client
    from agentenv.runtimes.base import SandboxSpec
    from agentenv.runtimes.qemu import QemuRuntime
    from agentenv.storage import guest
    from agentenv.storage.images import ImageStore

    if shutil.which("qemu-system-x86_64") is None:
        return {"skipped": "qemu-system-x86_64 not installed"}
    data_dir.mkdir(parents=True, exist_ok=True)
    if images_from is not None and (images_from / "base").is_dir() and not (data_dir / "images").exists():
        import subprocess

        subprocess.run(["cp", "-al", str(images_from), str(data_dir / "images")], check=True, timeout=300)
    settings = load_settings(data_dir=data_dir, runtime="qemu")
    store = ImageStore(settings)
    base = await store.ensure_base()
    tools = await store.ensure_tools()
    t0 = time.monotonic()
    await guest.build_guest_image(store.images_dir, base, tools, 2048)
    log(f"qemu: guest image ready ({time.monotonic() - t0:.1f}s)")
    net = NetworkManager(settings)
    await net.setup_host()
    rt = QemuRuntime(settings)
    fork_n = 4
    boots = 1 if quick else 2
    restores = 2 if quick else 4
    res: dict = {"accel": rt.accel, "machine": rt.machine, "guest_mem_mib": MEM_MIB, "vcpus": 1}
    slots: dict[str, object] = {}
    live: list[str] = []

    async def spec(sid: str) -> SandboxSpec:
        slots[sid] = await net.allocate(sid, allow_internet=False)
        env = {**store.envd_env(), "AGENTENV_ENVD_HOST_TOKEN": "bench"}
        return SandboxSpec(sandbox_id=sid, rootfs=base, tools_dir=tools, slot=slots[sid],
                           bundle_dir=settings.paths.sandbox_dir(sid) / "bundle", cpu_count=1,
                           memory_mb=MEM_MIB, args=list(store.envd_argv()), env=env, disk_mb=2048, lowers=[base])

    async def ready(sid: str) -> None:
        await net.activate(slots[sid])
        await envd_client.wait_healthy(slots[sid].host_ip, timeout=rt.envd_timeout,
                                       is_alive=lambda: rt.is_alive(sid))

    async def drop(sid: str) -> None:
        await rt.stop(sid)
        if sid in slots:
            await net.release(slots.pop(sid))
        shutil.rmtree(settings.paths.sandbox_dir(sid), ignore_errors=True)

    try:
        boot_s, ckpt_s = [], []
        image = data_dir / "bench-image"
        for i in range(boots):
            sid = f"qbboot{i}"
            s = await spec(sid)
            t0 = time.monotonic()
            await rt.start(s)
            live.append(sid)
            await ready(sid)
            boot_s.append(time.monotonic() - t0)
            log(f"qemu: cold boot {i}: {boot_s[-1]:.1f}s to envd healthy")
            if i == boots - 1:
                await asyncio.sleep(2)  # let the guest settle (free-page reporting returns boot garbage)
                shutil.rmtree(image, ignore_errors=True)
                t0 = time.monotonic()
                await rt.checkpoint(sid, image)
                ckpt_s.append(time.monotonic() - t0)
                log(f"qemu: checkpoint {ckpt_s[-1] * 1000:.0f} ms")
            live.remove(sid)
            await drop(sid)
        ram_file = image / "ram"
        res["image"] = {"state_bytes": (image / "state").stat().st_size,
                        "ram_file_mib": ram_file.stat().st_size >> 20,
                        "ram_allocated_mib": round(ram_file.stat().st_blocks * 512 / 2**20, 1),
                        "disk_qcow2_mib": round((image / "disk.qcow2").stat().st_size / 2**20, 1)}

        restore_call, restore_ready = [], []
        for i in range(restores):
            sid = f"qbrest{i}"
            s = await spec(sid)
            t0 = time.monotonic()
            await rt.restore(s, image)
            restore_call.append(time.monotonic() - t0)
            live.append(sid)
            await ready(sid)
            restore_ready.append(time.monotonic() - t0)
            log(f"qemu: restore {i}: running after {restore_call[-1] * 1000:.0f} ms, envd healthy after "
                f"{restore_ready[-1] * 1000:.0f} ms")
            live.remove(sid)
            await drop(sid)

        ids = [f"qbfork{i}" for i in range(fork_n)]
        specs = [await spec(sid) for sid in ids]
        t0 = time.monotonic()

        async def one(s: SandboxSpec) -> float:
            await rt.restore(s, image)
            live.append(s.sandbox_id)
            await ready(s.sandbox_id)
            return time.monotonic() - t0

        each = await asyncio.gather(*(one(s) for s in specs))
        fork_s = time.monotonic() - t0
        log(f"qemu: fork of {fork_n}: all healthy after {fork_s:.2f}s")
        await asyncio.sleep(1)
        mem = []
        for sid in ids:
            sm = _smaps(rt._pid(sid))  # noqa: SLF001 - the benchmark reads the VMM's own pid
            mem.append({"rss_mib": round(sm["Rss"] / 1024, 1), "pss_mib": round(sm["Pss"] / 1024, 1),
                        "shared_mib": round((sm.get("Shared_Clean", 0) + sm.get("Shared_Dirty", 0)) / 1024, 1),
                        "private_mib": round((sm.get("Private_Clean", 0) + sm.get("Private_Dirty", 0)) / 1024, 1)})
        for m in mem:
            log(f"qemu: clone memory: RSS {m['rss_mib']} MiB, PSS {m['pss_mib']} MiB, shared {m['shared_mib']} MiB, "
                f"private {m['private_mib']} MiB")

        # A restored clone's capture: full-RAM migration, then the helper rewrites it into a RAM file.
        image2 = data_dir / "bench-image-2"
        shutil.rmtree(image2, ignore_errors=True)
        t0 = time.monotonic()
        await rt.checkpoint(ids[0], image2)
        recapture_s = time.monotonic() - t0
        live.remove(ids[0])
        log(f"qemu: checkpoint of a restored clone (full stream + RAM-file rewrite): {recapture_s:.2f}s")
        ids2 = [f"qbre{i}" for i in range(2)]
        t0 = time.monotonic()
        specs2 = [await spec(sid) for sid in ids2]
        await asyncio.gather(*(rt.restore(s2, image2) for s2 in specs2))
        live.extend(ids2)
        await asyncio.gather(*(ready(sid) for sid in ids2))
        re_restore_s = time.monotonic() - t0
        await asyncio.sleep(1)
        mem2 = [_smaps(rt._pid(sid)) for sid in ids2]  # noqa: SLF001
        res["recapture"] = {"checkpoint_s": recapture_s, "two_restores_ready_s": re_restore_s,
                            "ram_allocated_mib": round((image2 / "ram").stat().st_blocks * 512 / 2**20, 1),
                            "clone_rss_mib": [round(m["Rss"] / 1024, 1) for m in mem2],
                            "clone_pss_mib": [round(m["Pss"] / 1024, 1) for m in mem2]}
        log(f"qemu: 2 restores of it healthy after {re_restore_s:.2f}s; PSS {res['recapture']['clone_pss_mib']} "
            f"of RSS {res['recapture']['clone_rss_mib']} MiB")

        def st(xs: list[float]) -> dict:
            return {"n": len(xs), "min": min(xs), "p50": statistics.median(xs), "max": max(xs)}

        res.update({"cold_boot_s": st(boot_s), "checkpoint_s": st(ckpt_s), "restore_call_s": st(restore_call),
                    "restore_ready_s": st(restore_ready), "fork": {"n": fork_n, "all_ready_s": fork_s,
                                                                    "each_ready_s": sorted(each)},
                    "clone_memory": mem,
                    "clone_memory_mean": {k: round(statistics.mean(m[k] for m in mem), 1) for k in mem[0]}})
        return res
    finally:
        for sid in list(live) + [s for s in list(slots) if s not in live]:
            try:
                await drop(sid)
            except Exception as e:  # noqa: BLE001
                log(f"qemu: cleanup of {sid}: {e}")


def report(r: dict) -> list[str]:
    if not r or "skipped" in r:
        return [f"### QEMU: skipped ({(r or {}).get('skipped', 'not run')})", ""]

    def row(name: str, s: dict, scale: float = 1.0, unit: str = "s") -> str:
        f = (lambda x: f"{x * scale:.0f} ms") if unit == "ms" else (lambda x: f"{x:.2f} s")
        return f"| {name} | {s['n']} | {f(s['min'])} | {f(s['p50'])} | {f(s['max'])} |"

    img, mm = r["image"], r["clone_memory_mean"]
    return [
        f"### QEMU runtime: real Linux guest ({r['machine']}, accelerator {r['accel']}, {r['guest_mem_mib']} MiB, "
        f"{r['vcpus']} vCPU)", "",
        "| | n | min | p50 | max |", "|---|---|---|---|---|",
        row("cold boot → envd healthy", r["cold_boot_s"]),
        row("checkpoint (migration to file, x-ignore-shared)", r["checkpoint_s"], 1e3, "ms"),
        row("restore: `restore()` returned (VM running)", r["restore_call_s"], 1e3, "ms"),
        row("restore → envd healthy", r["restore_ready_s"], 1e3, "ms"),
        "",
        f"Fork into {r['fork']['n']} parallel restores of one checkpoint: all envd healthy after "
        f"{r['fork']['all_ready_s']:.2f} s. Checkpoint image: device state {img['state_bytes'] / 1024:.0f} KiB, RAM file "
        f"{img['ram_file_mib']} MiB of which {img['ram_allocated_mib']} MiB allocated, disk overlay "
        f"{img['disk_qcow2_mib']} MiB.", "",
        f"Host memory per running clone (mean of {len(r['clone_memory'])}): RSS {mm['rss_mib']} MiB, "
        f"**PSS {mm['pss_mib']} MiB**, shared {mm['shared_mib']} MiB, private {mm['private_mib']} MiB "
        "(clones map the checkpoint's RAM file copy-on-write: pages they only read are counted once).", "",
        *([f"Capture of a *restored* clone (full-RAM migration, then a helper QEMU rewrites it into a RAM file): "
           f"{r['recapture']['checkpoint_s']:.2f} s ({r['recapture']['ram_allocated_mib']} MiB of RAM allocated); "
           f"2 restores of that image healthy after {r['recapture']['two_restores_ready_s']:.2f} s, PSS "
           f"{' / '.join(str(x) for x in r['recapture']['clone_pss_mib'])} MiB of RSS "
           f"{' / '.join(str(x) for x in r['recapture']['clone_rss_mib'])} MiB.", ""] if "recapture" in r else []),
    ]
