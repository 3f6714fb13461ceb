#!/usr/bin/env python3
"""Can fork children under gVisor share memory through KSM? (issue 13, item 6)

A source sandbox holds `--mib` MiB of random bytes in a process; it is forked into `--children`
children, all idle. The PSS of every sandbox's runsc processes is measured, then the kernel's
samepage merging runs (every runsc process of the server is in `PR_SET_MEMORY_MERGE` mode: the
server runs runsc through a wrapper that sets it, inherited by the sandbox processes) for
`--scans` full scans, and everything is measured again: the PSS, the pages KSM merged in total
and in each process.

KSM settings of the host are restored afterwards (merged pages are split again: run=2).

    .venv/bin/python benchmarks/ksm_bench.py [--mib 100] [--children 4] [--scans 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as bench  # noqa: E402

KSM = Path("/sys/kernel/mm/ksm")
PR_SET_MEMORY_MERGE = 67
WRAPPER = f"""#!{sys.executable}
import ctypes, os, sys
if ctypes.CDLL(None, use_errno=True).prctl({PR_SET_MEMORY_MERGE}, 1, 0, 0, 0) != 0:
    sys.exit("prctl(PR_SET_MEMORY_MERGE) failed: errno %d" % ctypes.get_errno())
os.execvp("runsc", ["runsc"] + sys.argv[1:])
"""


def ksm_counts() -> dict[str, int]:
    return {k: int((KSM / k).read_text()) for k in ("pages_shared", "pages_sharing", "full_scans")}


def merging_pages(sandbox_id: str) -> dict[str, object]:
    """Pages KSM merged in the sandbox's processes, and whether all of them are in merge-any mode."""
    merged, modes = 0, set()
    for pid in bench.procs_of(sandbox_id):
        try:
            stat = dict(line.split(None, 1) for line in Path(f"/proc/{pid}/ksm_stat").read_text().splitlines())
        except (OSError, ValueError):
            continue
        merged += int(stat.get("ksm_merging_pages", "0"))
        modes.add(stat.get("ksm_merge_any:", "?").strip())
    return {"merging_mib": round(merged * 4 / 1024, 1), "merge_any": sorted(modes)}


def pss_parts(sandbox_id: str) -> dict[str, float]:
    """PSS of the sandbox's processes by kind: anonymous (what KSM can merge) and shmem (memfds, which
    it never scans: gVisor keeps the sandbox's memory in one)."""
    parts = {"Pss_Anon:": 0, "Pss_Shmem:": 0, "Pss_File:": 0}
    for pid in bench.procs_of(sandbox_id):
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                key, _, rest = line.partition(" ")
                if key in parts:
                    parts[key] += int(rest.split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return {f"{k[4:-1].lower()}_mib": round(v / 1024, 1) for k, v in parts.items()}


def measure(ids: dict[str, str]) -> dict[str, dict]:
    return {role: {"pss_mib": round(bench.sandbox_pss_mb(sid)[0], 1), **pss_parts(sid), **merging_pages(sid)}
            for role, sid in ids.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=100)
    ap.add_argument("--children", type=int, default=4)
    ap.add_argument("--scans", type=int, default=3)
    args = ap.parse_args()
    if not (KSM / "run").exists():
        print("no KSM in this kernel (/sys/kernel/mm/ksm)")
        return 1
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    res: dict = {"meta": {"started": started, "args": vars(args), "hardware": bench.hardware()}}
    saved = {k: (KSM / k).read_text().strip() for k in ("run", "pages_to_scan", "sleep_millisecs")}
    from e2b import Sandbox
    bench.BENCH_DIR.mkdir(parents=True, exist_ok=True)
    wrapper = bench.BENCH_DIR / "runsc-merge"
    wrapper.write_text(WRAPPER)
    wrapper.chmod(0o755)
    srv = bench.BenchServer(bench.BENCH_DIR)
    rc = 0
    try:
        srv.prepare()
        srv.start(env={"AGENTENV_RUNSC_PATH": str(wrapper)})
        src = Sandbox.create(timeout=900)
        src.commands.run(f"python3 -c \"import os; open('/tmp/blob','wb').write(os.urandom({args.mib}<<20))\"")
        src.commands.run("python3 -c \"import time; b=open('/tmp/blob','rb').read(); time.sleep(10**6)\"",
                         background=True)
        time.sleep(3)
        kids = src.fork(count=args.children, timeout=900)
        time.sleep(5)
        ids = {"source": src.sandbox_id, **{f"child{i}": k.sandbox_id for i, k in enumerate(kids)}}
        res["before"] = {"sandboxes": measure(ids), "ksm": ksm_counts()}
        (KSM / "pages_to_scan").write_text("20000")
        (KSM / "sleep_millisecs").write_text("10")
        (KSM / "run").write_text("1")
        start, t0 = ksm_counts()["full_scans"], time.monotonic()
        while ksm_counts()["full_scans"] < start + args.scans and time.monotonic() < t0 + 300:
            time.sleep(1)
        res["after"] = {"sandboxes": measure(ids), "ksm": ksm_counts(), "seconds": round(time.monotonic() - t0, 1)}
        for s in kids + [src]:
            s.kill()
    except Exception:  # noqa: BLE001
        res.setdefault("errors", []).append(traceback.format_exc())
        bench.log(traceback.format_exc())
        rc = 1
    finally:
        if (KSM / "run").read_text().strip() != saved["run"]:
            (KSM / "run").write_text("2")  # split every merged page again
            (KSM / "run").write_text(saved["run"])
        for k in ("pages_to_scan", "sleep_millisecs"):
            (KSM / k).write_text(saved[k])
        if srv.proc is not None:
            srv.stop()
        res["meta"]["gc"] = srv.gc()
    bench.RESULTS.mkdir(parents=True, exist_ok=True)
    tag = "ksm-" + started.replace(":", "").replace("-", "")
    (bench.RESULTS / f"{tag}.json").write_text(json.dumps(res, indent=1, default=str))
    for when in ("before", "after"):
        for role, m in (res.get(when) or {}).get("sandboxes", {}).items():
            print(f"{when:6} {role:7} PSS {m['pss_mib']:6.1f} MiB (anon {m['anon_mib']}, shmem {m['shmem_mib']}, "
                  f"file {m['file_mib']}); KSM merged {m['merging_mib']} MiB; merge-any {m['merge_any']}")
        print(f"{when:6} KSM {(res.get(when) or {}).get('ksm')}")
    for e in res.get("errors", []):
        print(e)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
