"""gVisor platform choice (agentenv/runtimes/gvisor_platform.py) and doctor's runsc check, with the real runsc.

Fake runsc binaries are small shell scripts in the test's tmp_path (removed with it); the real
probes run `runsc do` in a temp dir that the module removes itself, which the tests check.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from agentenv import doctor
from agentenv.config import Settings
from agentenv.errors import RuntimeFailure
from agentenv.runtimes import gvisor_platform as gp

RUNSC = shutil.which("runsc")


def _needs_real_runsc(min_release: str = gp.SYSTRAP_SINCE) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (runsc do)")
    if RUNSC is None:
        pytest.skip("runsc not installed")
    release = gp.runsc_release(RUNSC)
    if release is None or release < min_release:
        pytest.skip(f"runsc {release} is older than {min_release} (scripts/setup.sh installs a current one)")


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _counting_wrapper(tmp_path: Path) -> tuple[Path, Path]:
    """A runsc that appends one line per invocation to a counter file, then execs the real runsc."""
    counter = tmp_path / "invocations"
    counter.write_text("")
    wrapper = _script(tmp_path / "runsc", f'echo "$*" >> {counter}\nexec {RUNSC} "$@"\n')
    return wrapper, counter


def _count(counter: Path) -> int:
    return len(counter.read_text().splitlines())


def _our_probe_dirs() -> set[str]:
    return {p.name for p in Path(os.environ.get("TMPDIR", "/tmp")).glob("agentenv-platform-*")}


# ------------------------------------------------------------------------------------ pure parsing


def test_parse_release_forms() -> None:
    assert gp.parse_release("runsc version 0.0~20240729.0\nspec: 1.0.2-dev\n") == "20240729"
    assert gp.parse_release("runsc version release-20250820.0\nspec: 1.1.0\n") == "20250820"
    assert gp.parse_release("runsc version VERSION_MISSING\nspec: 1.1.0-20230101\n") is None
    assert gp.parse_release("") is None


def test_supported_platforms_from_flags_text() -> None:
    new = '  -platform string\n    \tspecifies which platform to use: systrap (default), ptrace, kvm. (default "systrap")\n'
    old = '  -platform string\n    \tspecifies which platform to use: ptrace (default), kvm. (default "ptrace")\n'
    assert gp._supported(new, "20240729") == ["systrap", "ptrace", "kvm"]
    assert gp._supported(old, "20221219") == ["ptrace", "kvm"]
    # unparseable flags: decided by the release date
    assert "systrap" in gp._supported("", "20240729")
    assert "systrap" not in gp._supported("", "20221219")


# ------------------------------------------------------------------------------------ real runsc


async def test_auto_picks_systrap_here(tmp_path: Path) -> None:
    _needs_real_runsc()
    before = _our_probe_dirs()
    choice = await gp.choose_platform(RUNSC, "auto", tmp_path)
    assert choice.probed["systrap"] == "ok", choice
    assert choice.probed["ptrace"] == "ok", choice
    assert choice.runsc_version == gp.runsc_release(RUNSC)
    kvm_ok, _ = gp.kvm_usable()
    if kvm_ok and choice.probed.get("kvm") == "ok":
        assert choice.platform == "kvm"
    else:
        assert choice.platform == "systrap", choice
        assert choice.probed["kvm"] != "ok"
    # probes leave no temp dirs (others' concurrent probes may add their own: only ours must be gone)
    assert not (_our_probe_dirs() - before)


async def test_probe_removes_the_dirs_of_probes_whose_process_died(tmp_path: Path) -> None:
    """A server killed while it probed leaves `agentenv-platform-<pid>-*`: the next probe, by any
    process, removes it once that pid is gone, and leaves the dirs of probes still running."""
    _needs_real_runsc()
    gone = subprocess.Popen(["true"])
    gone.wait()
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    dead = tmp / f"agentenv-platform-{gone.pid}-leftover"
    (dead / "root").mkdir(parents=True)
    live = tmp / f"agentenv-platform-{os.getppid()}-running"
    live.mkdir()
    try:
        assert await gp.probe(RUNSC, "systrap") == "ok"
        assert not dead.exists(), "the dir of a probe whose process is gone was left"
        assert live.is_dir(), "the dir of a live process's probe was removed"
    finally:
        shutil.rmtree(dead, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)


async def test_explicit_platforms(tmp_path: Path) -> None:
    _needs_real_runsc()
    for platform in ("ptrace", "systrap"):
        choice = await gp.choose_platform(RUNSC, platform, tmp_path)
        assert choice.platform == platform
        assert choice.probed == {platform: "ok"}


async def test_bogus_platform_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RuntimeFailure, match="unknown gVisor platform 'bogus'"):
        await gp.choose_platform(RUNSC or "runsc", "bogus", tmp_path)
    assert not (tmp_path / gp.CACHE_FILE).exists()


async def test_platform_the_release_lacks_is_refused(tmp_path: Path) -> None:
    fake = _script(tmp_path / "runsc", """case "$1" in
  --version) echo "runsc version 0.0~20221219.0"; echo "spec: 1.0.2-dev";;
  flags) printf '  -platform string\\n    \\tspecifies which platform to use: ptrace (default), kvm. (default "ptrace")\\n';;
  *) exit 1;;
esac
""")
    with pytest.raises(RuntimeFailure, match="has no 'systrap' platform"):
        await gp.choose_platform(str(fake), "systrap", tmp_path)


async def test_failing_probe_is_an_error_and_not_cached(tmp_path: Path) -> None:
    """An explicit platform whose probe fails raises with runsc's message; nothing is cached."""
    _needs_real_runsc()
    fake = _script(tmp_path / "runsc", f"""for a in "$@"; do [ "$a" = do ] && {{ echo "boom: platform broken" >&2; exit 1; }}; done
exec {RUNSC} "$@"
""")
    with pytest.raises(RuntimeFailure, match="'ptrace' does not work on this host: rc=1: boom: platform broken"):
        await gp.choose_platform(str(fake), "ptrace", tmp_path)
    assert not (tmp_path / gp.CACHE_FILE).exists()


async def test_cache_is_reused_without_spawning_runsc(tmp_path: Path) -> None:
    _needs_real_runsc()
    wrapper, counter = _counting_wrapper(tmp_path)
    cache = tmp_path / "cache"
    first = await gp.choose_platform(str(wrapper), "auto", cache)
    spawned = _count(counter)
    assert spawned >= 4  # --version, flags, one probe per platform (systrap, ptrace)
    assert sum(" do " in line for line in counter.read_text().splitlines()) >= 2
    t0 = time.monotonic()
    second = await gp.choose_platform(str(wrapper), "auto", cache)
    assert time.monotonic() - t0 < 0.5
    assert _count(counter) == spawned, "a cached choice must not run runsc"
    assert second == first
    # another requested platform is its own entry
    await gp.choose_platform(str(wrapper), "ptrace", cache)
    after_ptrace = _count(counter)
    assert after_ptrace > spawned
    # fresh=True probes again
    await gp.choose_platform(str(wrapper), "auto", cache, fresh=True)
    assert _count(counter) > after_ptrace
    # a changed runsc binary (size/mtime) invalidates the entry
    n = _count(counter)
    with open(wrapper, "a") as f:
        f.write("# upgraded\n")
    await gp.choose_platform(str(wrapper), "auto", cache)
    assert _count(counter) > n


async def test_hung_probe_is_killed_and_cleaned_up(tmp_path: Path) -> None:
    """A probe that never answers times out; its helper processes and temp dir are gone afterwards."""
    pidfile, tmpfile = tmp_path / "helper.pid", tmp_path / "tmpdir"
    # Like runsc-sandbox: a detached helper whose command line names the state dir under $TMPDIR.
    fake = _script(tmp_path / "runsc", f"""echo "$TMPDIR" > {tmpfile}
mkdir -p "$TMPDIR/runsc-do1"
setsid bash -c 'exec -a "runsc-sandbox --root=$TMPDIR/runsc-do1" sleep 300' </dev/null >/dev/null 2>&1 &
echo $! > {pidfile}
exec sleep 300
""")
    if shutil.which("bash") is None or shutil.which("setsid") is None:
        pytest.skip("needs bash and setsid")
    t0 = time.monotonic()
    result = await gp.probe(str(fake), "ptrace", timeout=2)
    assert result.startswith("no answer within 2s"), result
    assert time.monotonic() - t0 < 10
    helper = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(helper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(helper), f"probe helper {helper} survived"
    assert not Path(tmpfile.read_text().strip()).exists()


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# ------------------------------------------------------------------------------------ doctor


def test_doctor_fails_on_old_runsc(tmp_path: Path) -> None:
    fake = _script(tmp_path / "runsc", 'echo "runsc version 0.0~20221219.0"; echo "spec: 1.0.2-dev"\n')
    check = doctor.check_runsc(Settings(data_dir=tmp_path / "data", runsc_path=str(fake), runsc_platform="auto"))
    assert check.status == "fail", check
    assert str(fake) in check.detail and "20221219" in check.detail and gp.MIN_RELEASE in check.detail
    assert check.fix and "bash scripts/setup.sh" in check.fix and "bookworm-backports" in check.fix
    assert "gVisor's release" in check.fix


def test_doctor_reports_release_and_platform(tmp_path: Path) -> None:
    _needs_real_runsc(gp.MIN_RELEASE)
    check = doctor.check_runsc(Settings(data_dir=tmp_path / "data", runsc_path=RUNSC, runsc_platform="auto"))
    assert check.status == "ok", check
    choice_line = check.detail
    assert RUNSC in choice_line and gp.runsc_release(RUNSC) in choice_line
    expected = "kvm" if gp.kvm_usable()[0] and "kvm=ok" in choice_line else "systrap"
    assert f"platform {expected}" in choice_line
    # doctor refreshed the cache the server reads
    assert (gp.default_cache_dir(tmp_path / "data") / gp.CACHE_FILE).exists()


def test_doctor_fails_on_a_platform_that_does_not_work(tmp_path: Path) -> None:
    """A current runsc whose requested platform cannot run a process: doctor fails and says what to set."""
    _needs_real_runsc(gp.MIN_RELEASE)
    fake = _script(tmp_path / "runsc", f"""for a in "$@"; do [ "$a" = do ] && {{ echo "platform exploded" >&2; exit 1; }}; done
exec {RUNSC} "$@"
""")
    check = doctor.check_runsc(Settings(data_dir=tmp_path / "data", runsc_path=str(fake), runsc_platform="ptrace"))
    assert check.status == "fail", check
    assert "'ptrace' does not work" in check.detail and "platform exploded" in check.detail
    assert check.fix and "AGENTENV_GVISOR_PLATFORM=auto" in check.fix
