"""Which gVisor platform (how the Sentry traps application syscalls) this host runs: proven, cached.

`auto` prefers, in order:
  kvm      only where /dev/kvm opens *and* the CPU has VT-x/AMD-V (on PVM hosts, whose /dev/kvm is
           software KVM, gVisor's kvm platform hangs at boot: measured, 20221219 and 20240729);
  systrap  where the runsc release has it (2023 and newer). Measured here (runsc 20240729, 2 cores;
           benchmarks/runsc_bench.py, docs/benchmarks.md): syscalls 11x (syscall(2) sites) to 74x
           (glibc wrappers, which systrap patches) cheaper than ptrace, open+close 21x, a Python
           loop 30x; fork+exec is ~3x dearer (14 vs 4.7 ms), envd starts 13 % faster;
  ptrace   everywhere else.
A platform counts only once a probe ran a real process under it:
`runsc do -cwd / /bin/sh -c 'echo <marker>; exit 3'` must print the marker and exit 3
(~0.2 s; `do` makes its own state dir under $TMPDIR, pointed at a temp dir removed afterwards;
`--ignore-cgroups` so a killed probe leaves no cgroup behind).

The choice is cached as JSON in `cache_dir`, keyed by the runsc binary (path, mtime, size), the
kernel release, whether /dev/kvm is usable and the requested platform, so a server start reuses it
without spawning runsc. Failures are never cached.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agentenv.errors import RuntimeFailure
from agentenv.proc import pid_exists, run_cmd

log = logging.getLogger(__name__)

MIN_RELEASE = "20240729"      # oldest runsc agentenv supports (doctor fails below it)
SYSTRAP_SINCE = "20230101"    # fallback when `runsc flags` does not list the platforms
PLATFORMS = ("kvm", "systrap", "ptrace")  # auto's order of preference
PROBE_TIMEOUT = 10.0
CACHE_FILE = "gvisor-platform.json"
_PROBE_MARKER = "agentenv-platform-probe"
_PROBE_EXIT = 3
_RELEASE_RE = re.compile(r"(20\d{6})")


@dataclass(frozen=True)
class PlatformChoice:
    platform: str                 # systrap | ptrace | kvm
    reason: str                   # one sentence: why this one
    runsc_version: str            # the release date, e.g. "20240729" ("" if runsc does not say)
    probed: dict[str, str] = field(default_factory=dict)  # platform -> "ok" | why not


def default_cache_dir(data_dir: Path) -> Path:
    """Where the server and `agentenv doctor` keep the cached choice: <data_dir>/cache."""
    return data_dir / "cache"


def parse_release(version_text: str) -> str | None:
    """The release date in `runsc --version` output ("runsc version 0.0~20240729.0", "release-20240729.0")."""
    first = version_text.strip().splitlines()[0] if version_text.strip() else ""
    m = _RELEASE_RE.search(first)
    return m.group(1) if m else None


def runsc_release(runsc: str) -> str | None:
    """The release date of `runsc` ("20240729"), or None if it cannot run or does not say."""
    path = shutil.which(runsc)
    if path is None:
        return None
    try:
        p = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_release(p.stdout) if p.returncode == 0 else None


def kvm_usable() -> tuple[bool, str]:
    """Whether gVisor's kvm platform can work here: /dev/kvm opens and the CPU has vmx/svm."""
    from agentenv.runtimes.select import detect_virt

    virt = detect_virt()
    if virt.kind == "hardware":
        return True, virt.detail
    if virt.kind == "none":
        return False, "no usable /dev/kvm"
    if virt.kind == "pvm":
        return False, "/dev/kvm is PVM (software KVM, no vmx/svm): gVisor's kvm platform hangs at boot on it"
    return False, "/dev/kvm without vmx/svm in /proc/cpuinfo: gVisor's kvm platform needs VT-x/AMD-V"


def _supported(flags_text: str, release: str | None) -> list[str]:
    """Platforms this runsc knows, from `runsc flags` ("...platform to use: systrap (default), ptrace, kvm.")."""
    m = re.search(r"platform to use:([^.\n]*)", flags_text)
    if m:
        names = [n for n in re.findall(r"[a-z][a-z0-9]*", m.group(1)) if n != "default"]
        if names:
            return list(dict.fromkeys(names))
    names = ["ptrace", "kvm"]
    if release is not None and release >= SYSTRAP_SINCE:
        names.append("systrap")
    return names


# ------------------------------------------------------------------------------------------ probe


def _kill_leftovers(marker: str) -> None:
    """SIGKILL runsc processes (sandbox, gofer) whose command line names the probe's temp dir."""
    needle = marker.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


_PROBE_DIR_PREFIX = "agentenv-platform-"


def _sweep_probe_dirs() -> None:
    """Remove probe dirs (`agentenv-platform-<pid>-*`) of processes that are gone: a server killed
    while it probed leaves its dir behind."""
    for d in Path(tempfile.gettempdir()).glob(f"{_PROBE_DIR_PREFIX}*-*"):
        pid = d.name[len(_PROBE_DIR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not pid_exists(int(pid)):
            _kill_leftovers(str(d))  # its runsc, if that outlived the server too
            shutil.rmtree(d, ignore_errors=True)


async def probe(runsc: str, platform: str, timeout: float = PROBE_TIMEOUT) -> str:
    """Run one process under `platform`: "ok", or why it did not work. Leaves nothing behind."""
    await asyncio.to_thread(_sweep_probe_dirs)
    tmp = tempfile.mkdtemp(prefix=f"{_PROBE_DIR_PREFIX}{os.getpid()}-")
    argv = ["env", f"TMPDIR={tmp}", runsc, f"--root={tmp}/root", f"--platform={platform}",
            "--network=none", "--ignore-cgroups", "do", "-cwd", "/",
            "/bin/sh", "-c", f"echo {_PROBE_MARKER}; exit {_PROBE_EXIT}"]
    try:
        res = await run_cmd(argv, timeout=timeout, check=False, what=f"runsc probe of {platform}")
    except RuntimeFailure:
        return f"no answer within {timeout:.0f}s (runsc hung: killed)"
    finally:
        await asyncio.to_thread(_kill_leftovers, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
    if res.returncode == _PROBE_EXIT and _PROBE_MARKER in res.stdout:
        return "ok"
    detail = (res.stderr.strip() or res.stdout.strip()).splitlines()
    return f"rc={res.returncode}: {detail[-1][:300] if detail else 'no output'}"


# ------------------------------------------------------------------------------------------ cache


def _cache_key(runsc_path: str, requested: str, kvm_ok: bool) -> str:
    st = os.stat(runsc_path)
    return json.dumps([os.path.realpath(runsc_path), st.st_mtime_ns, st.st_size, os.uname().release,
                       requested, kvm_ok])


def _cache_load(cache_dir: Path) -> dict[str, dict]:
    try:
        data = json.loads((cache_dir / CACHE_FILE).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _cache_store(cache_dir: Path, key: str, choice: PlatformChoice) -> None:
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        data = _cache_load(cache_dir)
        data[key] = asdict(choice)
        tmp = cache_dir / f".{CACHE_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(cache_dir / CACHE_FILE)
    except OSError as e:  # a cache that cannot be written only costs a probe next time
        log.warning("cannot write the gVisor platform cache in %s: %s", cache_dir, e)


def _from_cache(entry: object) -> PlatformChoice | None:
    try:
        c = PlatformChoice(**entry)  # type: ignore[arg-type]
    except TypeError:
        return None
    return c if c.platform in PLATFORMS and isinstance(c.probed, dict) else None


# ------------------------------------------------------------------------------------------ choice


async def _release_and_platforms(runsc_path: str) -> tuple[str | None, list[str]]:
    ver, flags = await asyncio.gather(
        run_cmd([runsc_path, "--version"], timeout=20, check=False, what="runsc --version"),
        run_cmd([runsc_path, "flags"], timeout=20, check=False, what="runsc flags"))
    if ver.returncode != 0:
        raise RuntimeFailure(f"{runsc_path} --version failed (rc={ver.returncode}): "
                             f"{(ver.stderr or ver.stdout).strip()[-300:]}")
    release = parse_release(ver.stdout)
    return release, _supported(flags.stdout + flags.stderr, release)


async def _probe_all(runsc_path: str, candidates: list[str], skipped: dict[str, str]) -> dict[str, str]:
    results = await asyncio.gather(*(probe(runsc_path, p) for p in candidates))
    return {**skipped, **dict(zip(candidates, results))}


async def choose_platform(runsc: str, requested: str, cache_dir: Path, *, fresh: bool = False) -> PlatformChoice:
    """The gVisor platform to run sandboxes on: `requested` ("auto", "systrap", "ptrace", "kvm") proven by a probe.

    Raises RuntimeFailure when runsc is missing, an explicit platform does not work here, or none does.
    `fresh=True` probes again even if the cache has an answer (and refreshes it).
    """
    requested = requested.strip().lower()
    if requested != "auto" and requested not in PLATFORMS:
        raise RuntimeFailure(f"unknown gVisor platform {requested!r}: use auto, {', '.join(PLATFORMS)}")
    runsc_path = shutil.which(runsc)
    if runsc_path is None:
        raise RuntimeFailure(f"runsc not found ({runsc!r}): bash scripts/setup.sh installs it")
    kvm_ok, kvm_why = kvm_usable()
    key = _cache_key(runsc_path, requested, kvm_ok)
    if not fresh:
        cached = _from_cache(_cache_load(cache_dir).get(key))
        if cached is not None:
            return cached

    release, supported = await _release_and_platforms(runsc_path)
    version = release or ""
    if requested != "auto":
        if requested not in supported:
            raise RuntimeFailure(f"runsc {version or runsc_path} has no {requested!r} platform "
                                 f"(it has: {', '.join(supported)}); set AGENTENV_GVISOR_PLATFORM=auto")
        result = await probe(runsc_path, requested)
        if result != "ok":
            hint = f"; {kvm_why}" if requested == "kvm" and not kvm_ok else ""
            raise RuntimeFailure(f"gVisor platform {requested!r} does not work on this host: {result}{hint}; "
                                 "set AGENTENV_GVISOR_PLATFORM=auto to pick one that does")
        choice = PlatformChoice(requested, "requested explicitly; probe ok", version, {requested: "ok"})
    else:
        choice = await _auto(runsc_path, version, supported, kvm_ok, kvm_why)
    _cache_store(cache_dir, key, choice)
    log.info("gVisor platform %s (runsc %s): %s", choice.platform, version or "?", choice.reason)
    return choice


async def _auto(runsc_path: str, version: str, supported: list[str], kvm_ok: bool, kvm_why: str) -> PlatformChoice:
    skipped: dict[str, str] = {}
    for p in PLATFORMS:
        if p not in supported:
            skipped[p] = f"not in runsc {version or '?'}"
    if "kvm" in supported and not kvm_ok:
        skipped["kvm"] = f"skipped: {kvm_why}"
    candidates = [p for p in PLATFORMS if p not in skipped]
    probed = await _probe_all(runsc_path, candidates, skipped)
    for p in PLATFORMS:
        if probed.get(p) == "ok":
            return PlatformChoice(p, _why(p, probed), version, probed)
    raise RuntimeFailure("no gVisor platform works on this host: "
                         + "; ".join(f"{p}: {probed.get(p, 'not probed')}" for p in PLATFORMS))


def _why(platform: str, probed: dict[str, str]) -> str:
    if platform == "kvm":
        return "hardware virtualization and the kvm probe works (fastest platform)"
    if platform == "systrap":
        return ("systrap works (measured: syscalls 11-74x cheaper than ptrace, fork+exec ~3x dearer); "
                f"kvm: {probed.get('kvm', 'not probed')}")
    return (f"fallback: systrap: {probed.get('systrap', 'not probed')}; "
            f"kvm: {probed.get('kvm', 'not probed')}")
