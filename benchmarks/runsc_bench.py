#!/usr/bin/env python3
"""gVisor releases and platforms side by side: old runsc (0.0~20221219, ptrace) vs the current one on
each platform that works here, in the same run, on bare runsc containers (no agentenv server).

Usage (as root, from the repo):
    .venv/bin/python benchmarks/runsc_bench.py [--quick]

Per configuration (binary x platform) it measures:
  - syscall cost inside the container: a static C program (getppid through syscall(2) and through
    glibc's wrapper, open+close, fork+exec of /bin/true) and a Python loop of getppid, run with
    `runsc exec`; and `runsc exec /bin/true` itself;
  - container start -> first TCP answer (overlay + netns slot + `runsc run` + python server answers),
    and -> envd's GET /health (when the test data dir has a tools layer);
  - checkpoint of an idle container and of one holding 200 MiB of random bytes: default (flate)
    vs `--compression=none`; restore -> first answer (uncompressed also with `restore --direct`);
    `checkpoint --leave-running` (source keeps answering);
  - 16 parallel restores of the 200 MiB image into fresh slots/overlays, until all answer.
The old runsc is fetched with `apt-get download runsc=0.0~20221219.0-2+b3` into
/var/cache/agentenv-bench/ and unpacked with `dpkg-deb -x` (idempotent). Containers are built with
benchmarks/run.py's Raw pieces (agentenv's NetworkManager, RootfsManager, GVisorRuntime: same OCI
spec, same /proc/sys/net/core netns wrapper), one GVisorRuntime (own --root) per configuration.
Data dir /var/tmp/agentenv-bench-runsc, instance tag "rb", slots in 10.221.0.0/16: it never
collides with a test run or a server. Everything it creates is removed on exit, also on failure.
Writes benchmarks/results/runsc-<timestamp>[-quick].json + .md; see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from run import RAW_SERVER, Raw, hardware, loadavg, log, sandbox_pss_mb, sh, stats  # noqa: E402

DATA_DIR = Path(os.environ.get("AGENTENV_RUNSC_BENCH_DIR", "/var/tmp/agentenv-bench-runsc"))
INSTANCE = "rb"
SUBNET = "10.221.0.0/16"
TEST_IMAGES = Path(os.environ.get("AGENTENV_TEST_DATA_DIR", "/var/tmp/agentenv-test")) / "images"
BASE_ROOTFS = TEST_IMAGES / "base/rootfs"
CACHE = Path("/var/cache/agentenv-bench")
OLD_VERSION = "0.0~20221219.0-2+b3"
RESULTS = REPO / "benchmarks" / "results"
HOLD_MIB = 200
PARALLEL = 16

# Inside the container (static, from the tools bind mount): raw syscall costs and fork+exec.
SYSBENCH_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    long n = atol(argv[1]), m = atol(argv[2]), f = atol(argv[3]);
    /* syscall(2) loads the number from a register: systrap cannot patch that call site, so every
       call takes the signal (SIGSYS) path. glibc's getppid() is "mov $110, %eax; syscall", which
       systrap rewrites into a jump to its fast path after the first calls. */
    double t0 = now();
    for (long i = 0; i < n; i++) syscall(SYS_getppid);
    double raw = (now() - t0) / n;
    t0 = now();
    for (long i = 0; i < n; i++) getppid();
    double libc = (now() - t0) / n;
    t0 = now();
    for (long i = 0; i < m; i++) { int fd = open("/etc/hostname", O_RDONLY); if (fd >= 0) close(fd); }
    double openclose = (now() - t0) / m;
    t0 = now();
    for (long i = 0; i < f; i++) {
        pid_t p = fork();
        if (p == 0) { execl("/bin/true", "true", (char *)0); _exit(127); }
        int st; waitpid(p, &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) { fprintf(stderr, "child failed\n"); return 1; }
    }
    double forkexec = (now() - t0) / f;
    printf("{\"getppid_us\": %.4f, \"getppid_libc_us\": %.4f, \"open_close_us\": %.4f, \"fork_exec_ms\": %.4f}\n",
           raw * 1e6, libc * 1e6, openclose * 1e6, forkexec * 1e3);
    return 0;
}
"""
PY_LOOP = "import os,sys,time\nn=int(sys.argv[1])\nt=time.perf_counter()\nfor _ in range(n): os.getppid()\nprint(time.perf_counter()-t)"
PY_LOOP_N = 20_000          # scaled to "per 100k" in the report
SYS_ITERS = (20_000, 5_000, 100)  # getppid, open+close, fork+exec per run inside gVisor
HOST_ITERS = (2_000_000, 200_000, 500)

# Checkpoint/restore variants: (checkpoint flags, restore flags). The old runsc knows only the first.
VARIANTS: dict[str, tuple[list[str], list[str]]] = {
    "flate": ([], []),
    "none": (["--compression=none"], []),
    "none+direct": (["--compression=none"], ["--direct"]),
}


@dataclass(frozen=True)
class Config:
    name: str       # e.g. "old-ptrace"
    binary: str
    platform: str
    release: str

    @property
    def old(self) -> bool:
        return self.release < "20230101"


class Interrupted(BaseException):
    """SIGTERM/SIGHUP/SIGINT: unwind through every `finally`, so cleanup runs."""


_MAIN_PID = os.getpid()


def _on_signal(signum: int, _frame: object) -> None:
    if os.getpid() != _MAIN_PID:
        # A forked helper (pyroute2 forks one per netns socket and ends it with SIGTERM) inherits
        # this handler: it must die as it would by default, never unwind into our code.
        os._exit(128 + signum)
    raise Interrupted(f"signal {signum}")


# ---------------------------------------------------------------- binaries


def old_runsc() -> Path:
    """The Debian bookworm runsc (0.0~20221219), downloaded and unpacked once into CACHE."""
    dest = CACHE / f"runsc-{OLD_VERSION}"
    binary = dest / "usr/bin/runsc"
    if binary.exists():
        return binary
    CACHE.mkdir(parents=True, exist_ok=True)
    debs = sorted(CACHE.glob(f"runsc_{OLD_VERSION}_*.deb"))
    if not debs:
        log(f"apt-get download runsc={OLD_VERSION} into {CACHE}")
        r = sh(["apt-get", "download", f"runsc={OLD_VERSION}"], timeout=300, cwd=CACHE)
        debs = sorted(CACHE.glob(f"runsc_{OLD_VERSION}_*.deb"))
        if not debs:
            raise RuntimeError(f"apt-get download runsc={OLD_VERSION} failed (is Debian bookworm main in the apt "
                               f"sources?): {r.stderr.strip()[-500:]}")
    tmp = CACHE / f".runsc-{OLD_VERSION}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(tmp)], check=True, timeout=120)
    tmp.rename(dest)
    return binary


def build_sysbench(out: Path) -> None:
    src = out.with_suffix(".c")
    src.write_text(SYSBENCH_C)
    r = sh(["gcc", "-O2", "-static", "-o", str(out), str(src)], timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"gcc failed (apt-get install gcc libc6-dev): {r.stderr[-800:]}")


async def probe_platforms(binaries: dict[str, str]) -> dict[str, dict[str, str]]:
    """Which platforms really run a process, per binary (kvm too: it may hang, the probe times out)."""
    from agentenv.runtimes.gvisor_platform import PLATFORMS, probe

    async def timed(binary: str, platform: str) -> str:
        t0 = time.monotonic()
        result = await probe(binary, platform)
        return f"{result} ({time.monotonic() - t0:.2f} s)"

    out: dict[str, dict[str, str]] = {}
    for label, binary in binaries.items():
        results = await asyncio.gather(*(timed(binary, p) for p in PLATFORMS))
        out[label] = dict(zip(PLATFORMS, results))
    return out


# ---------------------------------------------------------------- the rig


class Rig(Raw):
    """benchmarks/run.py's Raw (overlay + slot + runsc), with one GVisorRuntime per configuration."""

    def __init__(self, root: Path, base: Path, configs: list[Config]) -> None:  # noqa: D107 - no super(): own layout
        from agentenv.config import load_settings
        from agentenv.network.manager import NetworkManager
        from agentenv.runtimes.gvisor import GVisorRuntime
        from agentenv.storage.rootfs import RootfsManager

        self.root = root
        self.settings = load_settings(data_dir=root, instance=INSTANCE, slot_subnet=SUBNET)
        self.net = NetworkManager(self.settings)
        self.rootfs = RootfsManager(self.settings.paths)
        self.base = base.resolve()
        self.tools = root / "tools"
        self.has_envd = False
        if not self.tools.exists():
            # A private hard-linked copy of the newest tools layer (envd + its Python), as run.py does.
            layers = sorted((t for t in (TEST_IMAGES / "tools").glob("*") if (t / "bin").is_dir()),
                            key=lambda t: t.stat().st_mtime)
            root.mkdir(parents=True, exist_ok=True)
            if layers:
                subprocess.run(["cp", "-al", str(layers[-1]), str(self.tools)], check=True, timeout=120)
        (self.tools / "bin").mkdir(parents=True, exist_ok=True)
        self.has_envd = (self.tools / "bin" / "python3").exists()
        self.runtimes = {
            c.name: GVisorRuntime(self.settings.model_copy(update={
                "runsc_path": c.binary, "runsc_platform": c.platform, "data_dir": root / "rt" / c.name}))
            for c in configs}
        self.rt = next(iter(self.runtimes.values()))
        self.live: dict[str, object] = {}
        self.owner: dict[str, object] = {}  # sandbox id -> the GVisorRuntime that runs it
        self._n = 0
        self.loop = asyncio.new_event_loop()
        self._reaper: asyncio.Task | None = None

    def use(self, cfg: Config) -> None:
        self.rt = self.runtimes[cfg.name]

    async def destroy(self, sid: str) -> None:
        """Raw.destroy with the runtime that started `sid`."""
        current = self.rt
        self.rt = self.owner.pop(sid, current)
        try:
            await super().destroy(sid)
        finally:
            self.rt = current

    def new_id(self) -> str:
        # Fixed length: runsc matches container ids by prefix ("x1" would also match "x10").
        self._n += 1
        return f"rbx{os.getpid() % 100000:05d}{self._n:04d}"

    async def setup(self) -> None:
        from agentenv.runtimes._reaper import become_subreaper, reap_forever

        # Like the server: reap runsc's orphaned helpers at once (PID 1 here reaps every 2 s, which
        # `runsc delete` and checkpoint would otherwise wait for).
        become_subreaper()
        self._reaper = self.loop.create_task(reap_forever())
        await self.net.setup_host()

    async def start(self, mem_mb: int = 0, envd: bool = False) -> tuple[str, dict]:
        """overlay + slot + `runsc run` + first TCP answer of the python server (envd: GET /health)."""
        from agentenv.orchestrator import envd_client

        sid = self.new_id()
        self.owner[sid] = self.rt
        t0 = time.monotonic()
        rootfs, slot = await self._prepare(sid)
        t1 = time.monotonic()
        await self.rt.start(self.spec(sid, rootfs, slot, mem_mb, envd=envd))
        t2 = time.monotonic()
        await self.net.activate(slot)
        if envd:
            await envd_client.wait_healthy(slot.host_ip)
        else:
            await self.wait_answer(slot.host_ip)
        t3 = time.monotonic()
        return sid, {"total": t3 - t0, "prepare": t1 - t0, "runsc_run": t2 - t1, "to_answer": t3 - t2}

    async def checkpoint(self, sid: str, image: Path, flags: list[str] | None = None) -> float:
        """Timed `runsc checkpoint [flags]`; without --leave-running the stopped container is deleted
        afterwards (not timed) so its id can be restored."""
        flags = flags or []
        await asyncio.sleep(0.3)  # let the probe connection finish closing on the sandbox side
        shutil.rmtree(image, ignore_errors=True)
        image.mkdir(parents=True)
        slot = self.live[sid]
        t0 = time.monotonic()
        try:
            await self.rt._runsc("checkpoint", *flags, f"--image-path={image}", sid, timeout=300,
                                 netns_path=slot.netns_path,
                                 output_file=self.settings.paths.sandbox_dir(sid) / "ckpt.log")
            return time.monotonic() - t0
        finally:
            if "--leave-running" not in flags:
                await self.rt.stop(sid)

    async def restore_into(self, sid: str, image: Path, flags: list[str] | None = None) -> dict:
        """`runsc restore [flags]` of `image` as `sid` (its old slot, or a new one) until it answers."""
        t0 = time.monotonic()
        self.owner.setdefault(sid, self.rt)
        slot = self.live.get(sid)
        if slot is None:
            rootfs, slot = await self._prepare(sid)
        else:
            await self.net.deactivate(slot)
            rootfs = self.rootfs.rootfs_path(sid)
        spec = self.spec(sid, rootfs, slot)
        await self.rt._global_flags()
        self.rt._write_bundle(spec)
        t1 = time.monotonic()
        try:
            await self.rt._runsc("restore", "--detach", *(flags or []), f"--image-path={image}",
                                 f"--bundle={spec.bundle_dir}", sid, timeout=120, netns_path=slot.netns_path,
                                 output_file=spec.bundle_dir / "console.log")
        except BaseException:
            await asyncio.shield(self.rt.stop(sid))
            raise
        t2 = time.monotonic()
        await self.net.activate(slot)
        await self.wait_answer(slot.host_ip)
        t3 = time.monotonic()
        return {"total": t3 - t0, "prepare": t1 - t0, "runsc_restore": t2 - t1, "to_answer": t3 - t2}

    async def exec(self, sid: str, *argv: str, timeout: float = 300) -> str:
        res = await self.rt._runsc("exec", sid, *argv, timeout=timeout)
        return res.stdout

    async def destroy_all(self) -> None:
        for sid in list(self.live):
            await self.destroy(sid)
        for rt in self.runtimes.values():  # anything a runsc root still knows (e.g. after a crash)
            self.rt = rt
            for sid in await rt.list_ids():
                await rt.stop(sid)
        await self.rootfs.cleanup_orphans(set())
        await self.net.cleanup_orphans(set())

    async def close(self) -> None:
        try:
            await self.destroy_all()
        finally:
            await self.net.teardown_host()
            if self._reaper is not None:
                self._reaper.cancel()


# ---------------------------------------------------------------- measurements
#
# Every measurement goes round-robin over the configurations (rep 1 of each, rep 2 of each, ...),
# so a change of load on the shared machine hits all of them alike.


def host_syscalls(sysbench: Path, reps: int) -> dict:
    c = [json.loads(sh([str(sysbench), *map(str, HOST_ITERS)], timeout=120).stdout) for _ in range(reps)]
    py = [float(sh([sys.executable, "-c", PY_LOOP, str(PY_LOOP_N * 5)], timeout=120).stdout) / 5 for _ in range(reps)]
    return _syscall_stats(c, py, [])


def _syscall_stats(c: list[dict], py: list[float], execs: list[float]) -> dict:
    out = {k: stats([s[k] for s in c]) for k in ("getppid_us", "getppid_libc_us", "open_close_us", "fork_exec_ms")}
    out["py_loop_100k_s"] = stats([x * 100_000 / PY_LOOP_N for x in py])
    if execs:
        out["runsc_exec_true_s"] = stats(execs)
    return out


class Runner:
    """Runs one phase over all configurations; a configuration that fails is dropped from the phase."""

    def __init__(self, rig: Rig, configs: list[Config], res: dict) -> None:
        self.rig, self.configs, self.res = rig, configs, res

    def each(self, phase: str, fn, configs: list[Config] | None = None) -> list[Config]:
        """fn(cfg) for each configuration; returns the ones that did not fail."""
        ok = []
        for cfg in configs if configs is not None else self.configs:
            self.rig.use(cfg)
            try:
                self.rig.run(fn(cfg))
                ok.append(cfg)
            except Exception:  # noqa: BLE001 - recorded; the others go on
                self.res[cfg.name].setdefault("errors", {})[phase] = traceback.format_exc()[-3000:]
                log(f"{cfg.name} {phase} failed:\n{traceback.format_exc()}")
        return ok

    def start_all(self, phase: str, mem_mb: int = 0) -> dict[str, str]:
        sids: dict[str, str] = {}

        async def go(cfg: Config) -> None:
            sids[cfg.name], _ = await self.rig.start(mem_mb=mem_mb)
        self.each(phase, go)
        return sids

    def destroy(self, sids: dict[str, str]) -> None:
        for sid in sids.values():
            self.rig.run(self.rig.destroy(sid))


def bench_syscalls(r: Runner, reps: int) -> None:
    from agentenv import constants

    sids = r.start_all("syscalls")
    live = [c for c in r.configs if c.name in sids]
    c_s: dict[str, list] = {c.name: [] for c in live}
    py: dict[str, list] = {c.name: [] for c in live}
    ex: dict[str, list] = {c.name: [] for c in live}

    async def one(cfg: Config) -> None:
        sid = sids[cfg.name]
        out = await r.rig.exec(sid, f"{constants.TOOLS_MOUNT}/bin/sysbench", *map(str, SYS_ITERS))
        c_s[cfg.name].append(json.loads(out.strip().splitlines()[-1]))
        py[cfg.name].append(float((await r.rig.exec(sid, "/usr/bin/python3", "-c", PY_LOOP, str(PY_LOOP_N))).strip()))
        for _ in range(2):
            t0 = time.monotonic()
            await r.rig.exec(sid, "/bin/true", timeout=60)
            ex[cfg.name].append(time.monotonic() - t0)
    try:
        for _ in range(reps):
            live = r.each("syscalls", one, live)
    finally:
        r.destroy(sids)
    for cfg in live:
        r.res[cfg.name]["syscalls"] = _syscall_stats(c_s[cfg.name], py[cfg.name], ex[cfg.name])


def bench_start(r: Runner, reps: int, envd: bool = False) -> None:
    """Start -> first answer of the python server, or (envd=True) of envd's GET /health."""
    phases: dict[str, list] = {c.name: [] for c in r.configs}
    key = "start_envd" if envd else "start"

    async def one(cfg: Config) -> None:
        sid, ph = await r.rig.start(envd=envd)
        try:
            phases[cfg.name].append(ph)
        finally:
            await r.rig.destroy(sid)
    live = r.configs
    for _ in range(reps):
        live = r.each(key, one, live)
    for cfg in live:
        r.res[cfg.name][key] = {k: stats([p[k] for p in phases[cfg.name]]) for k in ("total", "runsc_run", "to_answer")}


def du_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def bench_checkpoint_restore(r: Runner, mem_mb: int, reps: int, images: Path) -> None:
    """One container per configuration holding `mem_mb`; `reps` checkpoint -> restore cycles per
    variant, then `checkpoint --leave-running` (new runsc). Images stay for the parallel restores."""
    sids = r.start_all(f"cr-{mem_mb}", mem_mb)
    try:
        for variant, (ck_flags, rs_flags) in VARIANTS.items():
            cfgs = [c for c in r.configs if c.name in sids and not (c.old and (ck_flags or rs_flags))]
            samples: dict[str, dict[str, list]] = {c.name: {"ck": [], "rs": [], "size": []} for c in cfgs}

            async def cycle(cfg: Config, variant: str = variant, ck_flags: list[str] = ck_flags,
                            rs_flags: list[str] = rs_flags) -> None:
                img, sm, sid = images / cfg.name / f"{mem_mb}-{variant}", samples[cfg.name], sids[cfg.name]
                sm["ck"].append(await r.rig.checkpoint(sid, img, ck_flags))
                sm["size"].append(du_mb(img))
                sm["rs"].append((await r.rig.restore_into(sid, img, rs_flags))["total"])
            for _ in range(reps):
                cfgs = r.each(f"cr-{mem_mb}-{variant}", cycle, cfgs)
            for cfg in cfgs:
                sm = samples[cfg.name]
                r.res[cfg.name].setdefault("cr", {}).setdefault(str(mem_mb), {})[variant] = {
                    "checkpoint_s": stats(sm["ck"]), "restore_to_answer_s": stats(sm["rs"]), "image_MB": stats(sm["size"])}
                log(f"  {cfg.name} {mem_mb} MiB {variant}: checkpoint {stats(sm['ck'])['p50']:.3f}s, "
                    f"restore->answer {stats(sm['rs'])['p50']:.3f}s, image {sm['size'][-1]:.1f} MB")
        bench_leave_running(r, sids, mem_mb, reps, images)
    finally:
        r.destroy(sids)


def bench_leave_running(r: Runner, sids: dict[str, str], mem_mb: int, reps: int, images: Path) -> None:
    """`checkpoint --leave-running` (flate and uncompressed): time, and how soon the source answers."""
    for variant in ("flate", "none"):
        flags = ["--leave-running", *VARIANTS[variant][0]]
        cfgs = [c for c in r.configs if c.name in sids and not c.old]
        ck: dict[str, list] = {c.name: [] for c in cfgs}
        ans: dict[str, list] = {c.name: [] for c in cfgs}

        async def one(cfg: Config, flags: list[str] = flags) -> None:
            sid = sids[cfg.name]
            ck[cfg.name].append(await r.rig.checkpoint(sid, images / cfg.name / f"{mem_mb}-leave", flags))
            t0 = time.monotonic()
            await r.rig.wait_answer(r.rig.live[sid].host_ip, timeout=15)
            ans[cfg.name].append(time.monotonic() - t0)
        for _ in range(reps):
            cfgs = r.each(f"leave-running-{mem_mb}-{variant}", one, cfgs)
        for cfg in cfgs:
            shutil.rmtree(images / cfg.name / f"{mem_mb}-leave", ignore_errors=True)
            r.res[cfg.name]["cr"][str(mem_mb)][f"leave_running_{variant}"] = {
                "checkpoint_s": stats(ck[cfg.name]), "source_answers_after_s": stats(ans[cfg.name])}


async def parallel_restores(rig: Rig, img: Path, flags: list[str], n: int) -> dict:
    ids = [rig.new_id() for _ in range(n)]
    t0 = time.monotonic()
    try:
        res = await asyncio.gather(*(rig.restore_into(i, img, flags) for i in ids), return_exceptions=True)
        all_answer = time.monotonic() - t0
        errors = [repr(e)[:300] for e in res if isinstance(e, BaseException)]
        await asyncio.sleep(1)
        pss = sandbox_pss_mb(ids[0])[0] if not errors else None
        return {"all_answer_s": all_answer, "errors": errors, "child_pss_MiB": pss}
    finally:
        await asyncio.gather(*(rig.destroy(i) for i in ids), return_exceptions=True)


def bench_parallel(r: Runner, rounds: int, images: Path) -> None:
    for variant in VARIANTS:
        cfgs = [c for c in r.configs if not (c.old and variant != "flate")
                and variant in r.res[c.name].get("cr", {}).get(str(HOLD_MIB), {})]
        runs: dict[str, list] = {c.name: [] for c in cfgs}

        async def one(cfg: Config, variant: str = variant) -> None:
            img = images / cfg.name / f"{HOLD_MIB}-{variant.split('+')[0]}"
            runs[cfg.name].append(await parallel_restores(r.rig, img, VARIANTS[variant][1], PARALLEL))
            log(f"  {cfg.name} {PARALLEL} parallel restores ({variant}, {HOLD_MIB} MiB): "
                f"{runs[cfg.name][-1]['all_answer_s']:.2f} s, errors {runs[cfg.name][-1]['errors']}")
        for _ in range(rounds):
            cfgs = r.each(f"parallel-{variant}", one, cfgs)
        for cfg in cfgs:
            rs = runs[cfg.name]
            r.res[cfg.name].setdefault("parallel", {})[variant] = {
                "all_answer_s": stats([x["all_answer_s"] for x in rs]), "errors": sum((x["errors"] for x in rs), []),
                "child_pss_MiB": [x["child_pss_MiB"] for x in rs]}


def bench_all(rig: Rig, configs: list[Config], quick: bool) -> dict:
    reps = 3 if quick else 7
    res: dict = {c.name: {"config": asdict(c)} for c in configs}
    r = Runner(rig, configs, res)
    images = rig.root / "images"
    try:
        log("syscalls, fork+exec, runsc exec")
        bench_syscalls(r, reps)
        log("start -> first answer")
        bench_start(r, reps)
        if rig.has_envd:
            log("start -> envd healthy")
            bench_start(r, reps, envd=True)
        for mem in (0, HOLD_MIB):
            log(f"checkpoint/restore holding {mem} MiB")
            bench_checkpoint_restore(r, mem, reps, images)
        log(f"{PARALLEL} parallel restores")
        bench_parallel(r, 1 if quick else 2, images)
    finally:
        shutil.rmtree(images, ignore_errors=True)
    return res


# ---------------------------------------------------------------- report


def _cell(s: dict | None, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    if not s or not s.get("n"):
        return "–"
    return f"{fmt.format(s['p50'] * scale)} (n={s['n']})"


def report(res: dict) -> str:
    cfgs = [c for c in res.get("configs", []) if c in res.get("results", {})]
    results = res.get("results", {})
    host = res.get("host", {})
    m = res["meta"]
    lines = [f"# gVisor releases and platforms ({m['started']}, {'quick' if m['quick'] else 'full'}, "
             f"{m.get('duration_s', 0):.0f} s)", "",
             f"load average at start {m['load_start']}, at end {m.get('load_end')}; kernel {m['hardware']['kernel']}, "
             f"{m['hardware']['nproc']} cores. Medians, n = samples.", "",
             "Platform probes (`runsc do` of one process; kvm hangs until the 10 s timeout on PVM):", ""]
    for binary, probes in m.get("probes", {}).items():
        lines.append(f"- `{binary}`: " + ", ".join(f"{p}: {r}" for p, r in probes.items()))
    head = "| | host | " + " | ".join(cfgs) + " |"
    lines += ["", head, "|---" * (len(cfgs) + 2) + "|"]

    def row(label: str, get, scale: float = 1.0, fmt: str = "{:.2f}", host_stat=None) -> None:
        cells = []
        for c in cfgs:
            try:
                cells.append(_cell(get(results[c]), scale, fmt))
            except (KeyError, TypeError):
                cells.append("–")
        lines.append(f"| {label} | {_cell(host_stat, scale, fmt) if host_stat else '–'} | " + " | ".join(cells) + " |")

    row("getppid via syscall(2) (unpatchable site), µs", lambda r: r["syscalls"]["getppid_us"], fmt="{:.2f}",
        host_stat=host.get("getppid_us"))
    row("getppid() of glibc (patchable site), µs", lambda r: r["syscalls"]["getppid_libc_us"], fmt="{:.2f}",
        host_stat=host.get("getppid_libc_us"))
    row("open+close, µs", lambda r: r["syscalls"]["open_close_us"], fmt="{:.1f}", host_stat=host.get("open_close_us"))
    row("Python loop, 100k getppid, s", lambda r: r["syscalls"]["py_loop_100k_s"], fmt="{:.3f}",
        host_stat=host.get("py_loop_100k_s"))
    row("fork+exec of /bin/true, ms", lambda r: r["syscalls"]["fork_exec_ms"], fmt="{:.2f}",
        host_stat=host.get("fork_exec_ms"))
    row("`runsc exec /bin/true`, ms", lambda r: r["syscalls"]["runsc_exec_true_s"], 1e3, "{:.0f}")
    row("start → first answer (python server), s", lambda r: r["start"]["total"], fmt="{:.3f}")
    row("  of which `runsc run`, s", lambda r: r["start"]["runsc_run"], fmt="{:.3f}")
    row("start → envd `GET /health`, s", lambda r: r["start_envd"]["total"], fmt="{:.3f}")
    for mem in ("0", str(HOLD_MIB)):
        what = "idle" if mem == "0" else f"{HOLD_MIB} MiB"
        for v in VARIANTS:
            row(f"checkpoint, {what}, {v}, s", lambda r, v=v, mem=mem: r["cr"][mem][v]["checkpoint_s"], fmt="{:.3f}")
            row(f"restore → answer, {what}, {v}, s", lambda r, v=v, mem=mem: r["cr"][mem][v]["restore_to_answer_s"],
                fmt="{:.3f}")
            row(f"image, {what}, {v}, MB", lambda r, v=v, mem=mem: r["cr"][mem][v]["image_MB"], fmt="{:.1f}")
        for v in ("flate", "none"):
            row(f"checkpoint --leave-running, {what}, {v}, s",
                lambda r, mem=mem, v=v: r["cr"][mem][f"leave_running_{v}"]["checkpoint_s"], fmt="{:.3f}")
            row(f"  source answers after, {what}, {v}, s",
                lambda r, mem=mem, v=v: r["cr"][mem][f"leave_running_{v}"]["source_answers_after_s"], fmt="{:.3f}")
    for v in VARIANTS:
        row(f"{PARALLEL} parallel restores ({HOLD_MIB} MiB, {v}) all answering, s",
            lambda r, v=v: r["parallel"][v]["all_answer_s"], fmt="{:.2f}")
    notes = []
    for c in cfgs:
        for phase, trace in results[c].get("errors", {}).items():
            notes.append(f"- {c} {phase} failed: {trace.strip().splitlines()[-1][:300]}")
        for v, p in results[c].get("parallel", {}).items():
            if p.get("errors"):
                notes.append(f"- {c} parallel {v}: {len(p['errors'])} failed: {p['errors'][0]}")
            pss = [x for x in p.get("child_pss_MiB", []) if x]
            if pss:
                notes.append(f"- {c} parallel {v}: PSS of one restored child {pss[0]:.0f} MiB")
    if res.get("errors"):
        notes.append(f"- run errors: {json.dumps(res['errors'])[:600]}")
    if notes:
        lines += ["", "Notes:", *notes]
    lines += ["", f"Cleanup: {m.get('leftovers')}"]
    return "\n".join(lines)


# ---------------------------------------------------------------- cleanup and main


def leftovers(root: Path) -> dict:
    mounts = [ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()
              if ln.split()[4].startswith(str(root))]
    netns = [n for n in os.listdir("/run/netns")] if os.path.isdir("/run/netns") else []
    ours = [n for n in netns if n.startswith(f"agentenv-{INSTANCE}-")]
    cgroups = [str(p) for p in Path("/sys/fs/cgroup").glob("*/agentenv/rbx*")]
    table = sh(["nft", "list", "table", "ip", f"agentenv-{INSTANCE}"]).returncode == 0
    return {"mounts": mounts, "netns": ours, "cgroups": cgroups, "nft_table": table}


def remove_data_dir(root: Path) -> None:
    left = leftovers(root)
    if left["mounts"]:
        log(f"NOT removing {root}: still mounted {left['mounts']}")
        return
    shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 samples instead of 7, one parallel round (~5 min)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root (runsc, netns, mounts)", file=sys.stderr)
        return 2
    if not (BASE_ROOTFS / "usr/bin/python3").exists():
        print(f"no base rootfs at {BASE_ROOTFS}: AGENTENV_DATA_DIR={BASE_ROOTFS.parents[2]} agentenv image build",
              file=sys.stderr)
        return 2
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, _on_signal)
    from agentenv.runtimes.gvisor_platform import runsc_release

    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t_start = time.monotonic()
    res: dict = {"meta": {"started": started, "quick": args.quick, "load_start": loadavg(),
                          "hardware": hardware(), "data_dir": str(DATA_DIR)}, "results": {}}
    rig: Rig | None = None
    rc = 0
    try:
        new_bin = shutil.which("runsc") or "/usr/bin/runsc"
        old_bin = str(old_runsc())
        releases = {"old": runsc_release(old_bin) or "?", "new": runsc_release(new_bin) or "?"}
        res["meta"]["binaries"] = {"old": [old_bin, releases["old"]], "new": [new_bin, releases["new"]]}
        log(f"old runsc {releases['old']} at {old_bin}; new runsc {releases['new']} at {new_bin}")
        probes = asyncio.run(probe_platforms({f"{releases['old']}": old_bin, f"{releases['new']}": new_bin}))
        res["meta"]["probes"] = probes
        log(f"platform probes: {probes}")
        configs = [Config(f"old-{p}", old_bin, p, releases["old"]) for p in ("ptrace", "systrap", "kvm")
                   if probes[releases["old"]][p].startswith("ok ")]
        configs += [Config(f"new-{p}", new_bin, p, releases["new"]) for p in ("ptrace", "systrap", "kvm")
                    if probes[releases["new"]][p].startswith("ok ")]
        res["configs"] = [c.name for c in configs]
        if DATA_DIR.exists():  # a crashed earlier run: clean it first
            log(f"cleaning leftovers of an earlier run in {DATA_DIR}")
            old = Rig(DATA_DIR, BASE_ROOTFS, configs)
            try:
                old.run(old.close())
            finally:
                old.loop.close()
            remove_data_dir(DATA_DIR)
        rig = Rig(DATA_DIR, BASE_ROOTFS, configs)
        build_sysbench(rig.tools / "bin" / "sysbench")
        res["host"] = host_syscalls(rig.tools / "bin" / "sysbench", 3 if args.quick else 7)
        rig.run(rig.setup())
        res["results"] = bench_all(rig, configs, args.quick)
        if any(v.get("errors") for v in res["results"].values()):
            rc = 1
    except (Exception, Interrupted):
        res.setdefault("errors", {})["main"] = traceback.format_exc()
        log(traceback.format_exc())
        rc = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # cleanup must not be interrupted half way
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if rig is not None:
            try:
                rig.run(rig.close())
            except Exception:  # noqa: BLE001
                log(f"cleanup: {traceback.format_exc()}")
                rc = 1
            rig.loop.close()
        remove_data_dir(DATA_DIR)
        res["meta"]["leftovers"] = leftovers(DATA_DIR)
        res["meta"]["data_dir_removed"] = not DATA_DIR.exists()
        log(f"cleanup: leftovers {res['meta']['leftovers']}, data dir removed: {res['meta']['data_dir_removed']}")
    res["meta"]["load_end"] = loadavg()
    res["meta"]["duration_s"] = time.monotonic() - t_start
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = "runsc-" + started.replace(":", "").replace("-", "") + ("-quick" if args.quick else "")
    (RESULTS / f"{tag}.json").write_text(json.dumps(res, indent=1, default=str))
    md = report(res)
    (RESULTS / f"{tag}.md").write_text(md + "\n")
    print(md)
    log(f"wrote {RESULTS / (tag + '.json')} and .md")
    return rc


if __name__ == "__main__":
    sys.exit(main())
