#!/usr/bin/env python3
"""Time-travel benchmark: checkpoints of a running sandbox, rollback, fork, next to raw runsc.

Usage (as root, from the repo):
    .venv/bin/python benchmarks/timetravel_bench.py [--steps 100] [--mib 256] [--delta-mib 4]

A sandbox whose process holds `--mib` MiB of random bytes changes `--delta-mib` MiB of them (and
writes a 64 KiB file) per step and is checkpointed after each step (POST /checkpoints, through
agentenv's client). Measured per step: the checkpoint call, how long the sandbox was frozen (the
server logs it per capture), and the bytes the data dir grew by (blocks actually allocated, hard
links once). Then: rollback to earlier steps (call → next command answers), a full snapshot of the
same sandbox for comparison, fork into 16 children (source frozen, all children answering), and
the raw baseline: `runsc checkpoint` of a bare container holding the same memory. Finally the
same fork and a checkpoint on a server whose captures stop the source (AGENTENV_CAPTURE_RUNNING=
false, the previous behaviour). Writes benchmarks/results/timetravel-<timestamp>.json + .md.

Disk: memory images are stored as deduplicated 4 KiB pages (agentenv/storage/pagestore.py), so a
step costs about the pages it changed plus its recipe (~0.4% of the image); the report gives the
bytes stored per step, the new pages each seal wrote, the time to rebuild an image for a rollback,
and what deleting all the checkpoints gave back. Before page storage a step stored its image twice
(≈ 2 x --mib). --steps scales the run down; per-step numbers extrapolate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as bench  # noqa: E402 - the shared server / raw harness

from agentenv.client.timetravel import TimeTravel  # noqa: E402

WORKER = r'''
import hashlib, json, os, random, sys, time
d, mib, delta = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = bytearray(os.urandom(mib << 20))
step = 0
rng = random.Random(7)
while True:
    req = os.path.join(d, "step.req")
    if os.path.exists(req):
        os.remove(req)
        step += 1
        for _ in range(delta):  # `delta` MiB, 1 MiB at a time, at random places
            off = rng.randrange(0, (mib - 1) << 20) & ~4095
            data[off:off + (1 << 20)] = os.urandom(1 << 20)
        with open(os.path.join(d, f"file-{step:03d}.bin"), "wb") as f:
            f.write(os.urandom(64 << 10))
        with open(os.path.join(d, "step.out.tmp"), "w") as f:
            f.write(str(step))
        os.replace(os.path.join(d, "step.out.tmp"), os.path.join(d, "step.out"))
    time.sleep(0.005)
'''
STEP_PY = r'''
import os, sys, time
d = sys.argv[1]
out = os.path.join(d, "step.out")
if os.path.exists(out):
    os.remove(out)
open(os.path.join(d, "step.req"), "w").close()
deadline = time.time() + 120
while not os.path.exists(out):
    if time.time() > deadline:
        sys.exit("the worker did not answer: " + open(os.path.join(d, "worker.log")).read()[-2000:])
    time.sleep(0.005)
print(open(out).read())
'''
D = "/home/user/ttb"


STORE: Path | None = None  # --s3: the rclone server's directory of the bucket's prefix


def disk_bytes(root: Path) -> int:
    """Blocks allocated under the data dir's artifact stores (each inode once), plus the S3 store's
    objects with --s3."""
    seen: set[int] = set()
    total = 0
    dirs = [root / sub for sub in ("memory", "layers", "cache", "snapshots", "pages")]
    for top in dirs + ([STORE] if STORE else []):
        for dirpath, _dirs, files in os.walk(top):
            for n in files:
                try:
                    st = os.lstat(os.path.join(dirpath, n))
                except OSError:
                    continue
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_blocks * 512
    return total


def store_dir(srv) -> Path:
    return STORE or srv.data_dir / "snapshots"


def store_bytes() -> dict[str, int]:
    """With --s3: bytes per blob kind in the S3 store."""
    out: dict[str, int] = {}
    for kind in ("layers", "memory", "pages", "pagemaps"):
        d = STORE / kind if STORE else None
        out[kind] = sum(p.stat().st_size for p in d.iterdir() if p.is_file()) if d and d.is_dir() else 0
    return out


def sealed_of(logtxt: str) -> list[tuple[float, float, float]]:
    """(image MiB, new pages MiB, seconds) of every memory image sealed."""
    return [(float(a), float(b), float(c)) for a, b, c in re.findall(
        r"sealed memory image \w+: (\d+) MiB, (\d+) MiB of it new pages, in ([0-9.]+)s", logtxt)]


def rebuilt_of(logtxt: str) -> list[float]:
    return [float(x) for x in re.findall(r"rebuilt memory image \w+ \(\d+ MiB\) from its pages in ([0-9.]+)s", logtxt)]


def frozen_of(logtxt: str) -> list[float]:
    return [float(x) for x in re.findall(r"without stopping it: frozen ([0-9.]+)s", logtxt)]


def start_worker(sbx, mib: int, delta: int) -> None:
    sbx.files.write(f"{D}/worker.py", WORKER)
    sbx.files.write(f"{D}/step.py", STEP_PY)
    sbx.commands.run(f"python3 {D}/worker.py {D} {mib} {delta} > {D}/worker.log 2>&1", background=True,
                     timeout=0).disconnect()  # no time limit: a 100-step run outlasts the default 60 s
    time.sleep(1)
    one_step(sbx)  # the worker is up (and its memory allocated) once it answers


def one_step(sbx) -> int:
    try:
        return int(sbx.commands.run(f"python3 {D}/step.py {D}", timeout=180).stdout.strip())
    except Exception:
        # what the sandbox looks like when its worker stopped answering
        diag = sbx.commands.run(f"ps -eo pid,stat,rss,vsz,wchan:20,cmd; free -m; ls -la {D} | tail -5; "
                                "for p in $(pgrep -f worker.py); do grep -E 'State|VmRSS|SigPnd|ShdPnd|SigBlk' "
                                "/proc/$p/status; done", timeout=60)
        bench.log("the worker stopped answering; in the sandbox:\n" + diag.stdout + diag.stderr)
        raise


def trajectory(srv, tt: TimeTravel, Sandbox, args) -> dict:
    sbx = Sandbox.create(timeout=3600)
    start_worker(sbx, args.mib, args.delta_mib)
    rows, ids = [], []
    try:
        for i in range(args.steps):
            one_step(sbx)
            before = disk_bytes(srv.data_dir)
            mark = srv.log_mark()
            t0 = time.monotonic()
            ck = tt.checkpoint(sbx, metadata={"step": str(i + 1)})
            call = time.monotonic() - t0
            logtxt = srv.log_since(mark)
            fr = frozen_of(logtxt)
            sealed = sealed_of(logtxt)
            grew = disk_bytes(srv.data_dir) - before
            ids.append(ck.checkpoint_id)
            rows.append({"step": i + 1, "checkpoint_call": call, "frozen": fr[0] if fr else None,
                         "stored_bytes": grew, "size_bytes": ck.size_bytes,
                         "store_bytes": store_bytes() if STORE else None,
                         "new_pages_mib": sealed[0][1] if sealed else None, "seal_s": sealed[0][2] if sealed else None})
            bench.log(f"step {i + 1}: checkpoint {call:.2f}s, frozen {rows[-1]['frozen']}, +{grew >> 20} MiB "
                      f"(new pages {rows[-1]['new_pages_mib']} MiB, sealed in {rows[-1]['seal_s']}s)")
        sharing = None
        if len(ids) >= 2:  # what a page-level store could share between the last two images
            mems = [json.loads((store_dir(srv) / "manifests" / f"{c}.json").read_text())["memory"]
                    for c in ids[-2:]]
            files = [srv.data_dir / "memory" / m / "pages.img" for m in mems]
            sharing = page_sharing(*files) if all(f.exists() for f in files) else None  # extracted copies dropped
            bench.log(f"pages shared by the last two memory images: {sharing}")
        rb = []
        mark = srv.log_mark()
        for k in range(min(8, len(ids))):
            target = ids[(k * 7) % len(ids)]
            t0 = time.monotonic()
            tt.rollback(sbx, target)
            sbx.commands.run("true")
            rb.append(time.monotonic() - t0)
        rebuilt = rebuilt_of(srv.log_since(mark))
        bench.log(f"rollback → first command: {bench.stats(rb)}; image rebuilt from pages: {bench.stats(rebuilt)}")
        mark = srv.log_mark()
        t0 = time.monotonic()
        snap = sbx.create_snapshot()
        snap_call = time.monotonic() - t0
        full = json.loads((store_dir(srv) / "manifests" / f"{snap.snapshot_id}.json").read_text())["sizeBytes"]
        Sandbox.delete_snapshot(snap.snapshot_id)
        held = disk_bytes(srv.data_dir)
        deletes = []
        for cid in ids:
            t0 = time.monotonic()
            tt.delete(cid)
            deletes.append(time.monotonic() - t0)
        deleted = ids[:]
        ids.clear()
        time.sleep(1)
        freed = held - disk_bytes(srv.data_dir)
        bench.log(f"deleting the {len(deleted)} checkpoints ({bench.stats(deletes)}) freed {freed >> 20} MiB "
                  f"of {held >> 20} MiB")
        return {"rows": rows, "rollback_to_first_command": bench.stats(rb), "snapshot_call": snap_call,
                "rollback_rebuild": bench.stats(rebuilt) if rebuilt else None,
                "deleted_all": {"held_bytes": held, "freed_bytes": freed, "delete_call": bench.stats(deletes)},
                "page_sharing": sharing,
                "full_snapshot_frozen": (frozen_of(srv.log_since(mark)) or [None])[0],
                "full_snapshot_size_bytes": full}
    finally:
        for cid in ids:
            try:
                tt.delete(cid)
            except Exception as e:  # noqa: BLE001
                bench.log(f"delete {cid}: {e}")
        bench._kill(sbx)


def fork16(srv, Sandbox, args, n: int = 16) -> dict:
    src = Sandbox.create(timeout=3600)
    kids = []
    try:
        start_worker(src, args.mib, args.delta_mib)
        mark = srv.log_mark()
        t0 = time.monotonic()
        res = src.fork(count=n, timeout=1800)
        t_call = time.monotonic() - t0
        kids = [k for k in res if not isinstance(k, Exception)]
        with bench.concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda k: k.commands.run("true"), kids))
        t_all = time.monotonic() - t0
        times = bench.capture_times(srv.log_since(mark))
        out = {"children_ok": len(kids), "fork_call": t_call, "all_answer": t_all,
               "source_unavailable": times[2] if times else None}
        bench.log(f"fork {n}: {out}")
        return out
    finally:
        with bench.concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(bench._kill, kids + [src]))


def raw_checkpoint(raw, mib: int, reps: int = 3) -> dict:
    out = []
    for _ in range(reps):
        sid, _ = raw.run(raw.start(mem_mb=mib))
        try:
            out.append(raw.run(raw.checkpoint(sid, raw.root / "ckpt-tt")))
        finally:
            raw.run(raw.destroy(sid))
    return bench.stats(out)


def page_sharing(older: Path, newer: Path) -> dict:
    """How much of a memory image (`pages.img`) a deduplicating store could take from its parent's:
    the share of `newer`'s 4 KiB pages and of its 64 KiB blocks found anywhere in `older`, and at the
    same offset. (Content-defined chunks of ~64 KiB fare like the blocks when pages move around.)"""
    import hashlib

    def digests(p: Path, size: int) -> list[bytes]:
        out = []
        with open(p, "rb") as f:
            while b := f.read(size):
                out.append(hashlib.blake2b(b, digest_size=16).digest())
        return out

    res = {}
    for size in (4096, 65536):
        a, b = digests(older, size), digests(newer, size)
        known = set(a)
        res[f"{size // 1024}KiB_anywhere"] = sum(h in known for h in b) / len(b)
        res[f"{size // 1024}KiB_same_offset"] = sum(i < len(a) and a[i] == h for i, h in enumerate(b)) / len(b)
    return res


def _mean(xs: list) -> str:
    xs = [x for x in xs if x is not None]
    return f"{sum(xs) / len(xs):.2f}" if xs else "-"


def report(res: dict, args) -> str:
    rows = res["running"]["trajectory"]["rows"]
    later = rows[1:] or rows
    per_step = sum(r["stored_bytes"] for r in later) / len(later)
    ck = bench.stats([r["checkpoint_call"] for r in rows])
    fr = bench.stats([r["frozen"] for r in rows if r["frozen"] is not None])
    raw = res["raw_checkpoint"]
    full = res["running"]["trajectory"]["full_snapshot_size_bytes"] or rows[-1]["size_bytes"]
    L = [f"# Time travel: {args.steps} checkpoints of a {args.mib} MiB sandbox changing {args.delta_mib} MiB/step",
         "", f"Run {res['meta']['started']}, load {res['meta']['load_start']} → {res['meta'].get('load_end')}.", "",
         "| | p50 | p95 |", "|---|---|---|",
         f"| checkpoint call | {bench.s_(ck['p50'])} | {bench.s_(ck['p95'])} |",
         f"| sandbox frozen per checkpoint | {bench.s_(fr['p50'])} | {bench.s_(fr['p95'])} |",
         f"| raw `runsc checkpoint` ({args.mib} MiB bare container) | {bench.s_(raw['p50'])} | {bench.s_(raw['p95'])} |",
         f"| rollback → first command | {bench.s_(res['running']['trajectory']['rollback_to_first_command']['p50'])} | "
         f"{bench.s_(res['running']['trajectory']['rollback_to_first_command']['p95'])} |",
         "", f"Stored bytes per checkpoint (data dir growth, steps 2+): {per_step / 2**20:.0f} MiB; a full snapshot "
         f"of the same sandbox: {full / 2**20:.0f} MiB (ratio {per_step / full:.2f}); changed per step: "
         f"{args.delta_mib} MiB of memory + 64 KiB of files. Before page storage a checkpoint stored its memory "
         f"image twice (≈ {2 * full / 2**20:.0f} MiB; ratio {per_step / (2 * full):.3f}).", "",
         f"New pages per seal (steps 2+): {_mean([r.get('new_pages_mib') for r in later])} MiB; seal "
         f"{_mean([r.get('seal_s') for r in rows])} s; image rebuilt for a rollback: "
         f"{bench.s_((res['running']['trajectory'].get('rollback_rebuild') or {}).get('p50'))} (p50); deleting all checkpoints freed "
         f"{res['running']['trajectory']['deleted_all']['freed_bytes'] / 2**20:.0f} MiB of "
         f"{res['running']['trajectory']['deleted_all']['held_bytes'] / 2**20:.0f} MiB (delete call p50 "
         f"{bench.s_(res['running']['trajectory']['deleted_all']['delete_call']['p50'])}, p95 "
         f"{bench.s_(res['running']['trajectory']['deleted_all']['delete_call']['p95'])}).", "",
         f"Pages of the last memory image found in its parent's: {res['running']['trajectory']['page_sharing']}", ""]
    if rows[-1].get("store_bytes"):
        kinds = rows[-1]["store_bytes"]
        L.append("S3 store after the last step: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in kinds.items())
                 + f" (the {len(rows)} memory images' logical size: {sum(r['size_bytes'] or 0 for r in rows) / 2**20:.0f} MiB)")
        L.append("")
    L.append("| step | checkpoint call | frozen | stored |")
    L.append("|---|---|---|---|")
    L += [f"| {r['step']} | {bench.s_(r['checkpoint_call'])} | {bench.s_(r['frozen'])} | {r['stored_bytes'] / 2**20:.0f} MiB |"
          for r in rows]
    L.append("")
    for mode in ("running", "stopping"):
        f = res.get(mode, {}).get("fork16")
        if f:
            L.append(f"Fork 16 ({mode}): all {f['children_ok']} answering in {bench.s_(f['all_answer'])}, source "
                     f"unavailable {bench.s_(f['source_unavailable'])} (raw checkpoint {bench.s_(raw['p50'])}).")
    return "\n".join(L)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--delta-mib", type=int, default=4)
    ap.add_argument("--skip-stopping", action="store_true", help="skip the run on a server whose captures stop")
    ap.add_argument("--skip-fork", action="store_true", help="no fork 16 (nor the stopping server)")
    ap.add_argument("--s3", action="store_true",
                    help="the server's snapshot store on S3 (a local rclone server): checkpoints upload their "
                         "page packs; stored bytes then count the store's objects too")
    ap.add_argument("--pages", nargs=2, metavar=("OLDER", "NEWER"),
                    help="only compare two pages.img files (how much a page-level store would share)")
    args = ap.parse_args()
    if args.pages:
        print(json.dumps(page_sharing(Path(args.pages[0]), Path(args.pages[1])), indent=1))
        return 0
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    res: dict = {"meta": {"started": started, "args": vars(args), "load_start": bench.loadavg(),
                          "hardware": bench.hardware()}}
    from e2b import Sandbox
    srv = bench.BenchServer(bench.BENCH_DIR)
    raw = None
    rc = 0
    s3 = None
    if args.s3:
        global STORE
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from s3server import start_s3
        import shutil
        shutil.rmtree(bench.BENCH_DIR / "s3", ignore_errors=True)
        s3 = start_s3(bench.BENCH_DIR / "s3" / "data")
        (s3.root / "bucket").mkdir()
        STORE = s3.root / "bucket" / "tt"
        os.environ.update(AGENTENV_SNAPSHOT_STORE="s3", AGENTENV_S3_BUCKET="bucket", AGENTENV_S3_PREFIX="tt/",
                          AGENTENV_S3_ENDPOINT=s3.endpoint, AGENTENV_S3_ACCESS_KEY=s3.access_key,
                          AGENTENV_S3_SECRET_KEY=s3.secret_key)
        res["meta"]["snapshot_store"] = "s3 (rclone serve s3 on loopback)"
    try:
        srv.prepare()
        srv.start()
        tt = TimeTravel(api_url=srv.url, api_key=srv.key)
        res["running"] = {"trajectory": trajectory(srv, tt, Sandbox, args)}
        if not args.skip_fork:
            res["running"]["fork16"] = fork16(srv, Sandbox, args)
        srv.stop()
        raw = bench.Raw(bench.BENCH_DIR)
        raw.run(raw.setup())
        res["raw_checkpoint"] = raw_checkpoint(raw, args.mib)
        if not (args.skip_stopping or args.skip_fork):
            os.environ["AGENTENV_CAPTURE_RUNNING"] = "false"
            srv.start()
            res["stopping"] = {"fork16": fork16(srv, Sandbox, args)}
    except Exception:  # noqa: BLE001
        res.setdefault("errors", []).append(traceback.format_exc())
        bench.log(traceback.format_exc())
        rc = 1
    finally:
        if raw is not None:
            raw.run(raw.close())
        if srv.proc is not None:
            srv.stop()
        res["meta"]["gc"] = srv.gc()
        if s3 is not None:
            s3.stop()
    res["meta"]["load_end"] = bench.loadavg()
    bench.RESULTS.mkdir(parents=True, exist_ok=True)
    tag = "timetravel-" + started.replace(":", "").replace("-", "")
    (bench.RESULTS / f"{tag}.json").write_text(json.dumps(res, indent=1, default=str))
    if not rc:
        md = report(res, args)
        (bench.RESULTS / f"{tag}.md").write_text(md + "\n")
        print(md)
    return rc


if __name__ == "__main__":
    sys.exit(main())
