"""Never lose a sandbox (issue 12, item 3): captures that fail half-way, through the E2B SDK.

Faults injected, each against a real `agentenv serve`:
- runsc refuses the checkpoint (a wrapper around the real runsc, `AGENTENV_RUNSC_PATH`, answers
  `checkpoint` with an error while a trigger file exists; this server checkpoints through runsc's
  command, `runsc_checkpoint_via=runsc`, instead of the sandbox's control socket);
- runsc is SIGKILLed 50 ms into its checkpoint (same wrapper, another trigger file);
- runsc refuses the restore of a paused sandbox (same wrapper): the resume had already claimed the
  sandbox in the state store (RESUMING), and must give the claim back;
- the disk is full during a pause (a real ENOSPC: a 1 MiB tmpfs mounted on the pause image dir);
- the snapshot store (a real S3 server, rclone) is down during a snapshot publish and during a
  pause publish (the server runs with `publish_paused` on, as `agentenv node` does: a pause is
  sealed and uploaded to the store so any node can resume it);
- the server is killed (-9, its whole process group) mid-fork, while the source is frozen for its
  checkpoint, once the checkpoint is written and once the image is sealed, then restarted on the
  same data dir;
- the server that publishes its pauses is killed (-9) mid-publish of a pause, once its checkpoint is
  written and once its upper and image are sealed (the store down, so the upload waits), then
  restarted with the store back;
- (not a fault, but what the others rely on) a program that keeps renaming files it holds open:
  the image of a capture must match the disk it is restored on.
After every fault the sandbox is RUNNING (or PAUSED and resumable, after a crash), the process
started before the fault answers with its in-memory state intact, a file written before is there;
every server is stopped, `agentenv gc` run and nothing of its data dir may be left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from agentenv.orchestrator.livecapture import CAPTURE_BASE
from e2b import Sandbox, SandboxState

from lifecycle_util import WORK, WorkerState, ask_worker, assert_same_worker, setup_worker, start_detached
from s3server import S3Server, rclone_binary, start_s3
from serverproc import ExtraServer, new_api_key, new_data_dir, remove_data_dir, start_extra_server, stop_unchecked

TIMEOUT_S = 900
MARKER = "written before the fault\n"

# Execs the real runsc, except for `checkpoint` (and `restore`) while a trigger file exists in FAULTS.
WRAPPER_SH = r'''#!/bin/sh
FAULTS='{faults}'
REAL='{real}'
for a in "$@"; do
  if [ "$a" = checkpoint ]; then
    if [ -e "$FAULTS/refuse" ]; then
      echo "checkpoint failed: injected by the test" >&2
      exit 1
    fi
    if [ -e "$FAULTS/kill" ]; then
      "$REAL" "$@" &
      pid=$!
      sleep 0.05
      kill -KILL "$pid" 2>/dev/null
      wait "$pid"
      echo "runsc checkpoint killed by the test (rc=$?)" >&2
      exit 137
    fi
    break
  fi
  if [ "$a" = restore ]; then
    if [ -e "$FAULTS/refuse-restore" ]; then
      echo "restore failed: injected by the test" >&2
      exit 1
    fi
    break
  fi
done
exec "$REAL" "$@"
'''

# `agentenv` with publish_paused on, as `agentenv node` (cluster) runs it: a pause is sealed and
# published to the snapshot store. Everything else is the unmodified CLI.
PUBLISHING_AGENTENV = '''#!{python}
import sys

import agentenv.server as server

_build = server.build


async def build(settings, **kw):
    kw.setdefault("publish_paused", True)
    return await _build(settings, **kw)


server.build = build
from agentenv.cli import main

sys.exit(main())
'''


def _publishing_launcher(tmp: Path) -> Path:
    """The `agentenv` launcher with publish_paused on (PUBLISHING_AGENTENV), written under `tmp`."""
    launcher = tmp / "agentenv-publishing"
    launcher.write_text(PUBLISHING_AGENTENV.format(python=sys.executable))
    launcher.chmod(0o755)
    return launcher


def _s3_env(s3: S3Server, bucket: str) -> dict[str, str]:
    """A server's settings for `s3` as its snapshot store (no warm image: each test boots its own)."""
    return dict(AGENTENV_WARM_START="false", AGENTENV_SNAPSHOT_STORE="s3", AGENTENV_S3_BUCKET=bucket,
                AGENTENV_S3_PREFIX="agentenv/", AGENTENV_S3_ENDPOINT=s3.endpoint,
                AGENTENV_S3_ACCESS_KEY=s3.access_key, AGENTENV_S3_SECRET_KEY=s3.secret_key)


def _start_publishing(launcher: Path, data_dir: Path, **kw) -> ExtraServer:
    """`start_extra_server` through `launcher` (the test binary swapped for the start only)."""
    old_bin = os.environ.get("AGENTENV_TEST_BIN")
    os.environ["AGENTENV_TEST_BIN"] = str(launcher)
    try:
        return start_extra_server(data_dir, **kw)
    finally:
        if old_bin is None:
            os.environ.pop("AGENTENV_TEST_BIN", None)
        else:
            os.environ["AGENTENV_TEST_BIN"] = old_bin


def _restart_s3(s3: S3Server) -> S3Server:
    """rclone again on the same address, keys and root (the store comes back)."""
    hostport = s3.endpoint.removeprefix("http://")
    host, port = hostport.rsplit(":", 1)
    log = open(s3.root.parent / f"rclone-{port}-again.log", "wb")
    proc = subprocess.Popen(
        [rclone_binary(), "serve", "s3", "--addr", hostport, "--auth-key", f"{s3.access_key},{s3.secret_key}",
         "--config", "/dev/null", str(s3.root)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=0.2):
                return S3Server(s3.endpoint, s3.access_key, s3.secret_key, s3.root, proc)
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("rclone did not come back on its port")
            time.sleep(0.05)


@dataclass
class Faulty:
    srv: ExtraServer
    faults: Path
    s3: S3Server

    def inject(self, kind: str) -> None:
        (self.faults / kind).touch()

    def clear(self) -> None:
        for p in self.faults.iterdir():
            p.unlink()


@pytest.fixture(scope="module")
def faulty(server) -> Iterator[Faulty]:
    """An extra server whose runsc is the fault-injecting wrapper, on a real S3 store, publishing pauses."""
    tmp = Path(tempfile.mkdtemp(prefix="agentenv-faults-", dir="/var/tmp"))
    faults = tmp / "faults"
    faults.mkdir()
    real = shutil.which("runsc")
    assert real, "runsc not installed"
    wrapper = tmp / "runsc"
    wrapper.write_text(WRAPPER_SH.format(faults=faults, real=real))
    wrapper.chmod(0o755)
    launcher = _publishing_launcher(tmp)
    s3 = start_s3(tmp / "s3root")
    # Its checkpoints go through runsc's command (where the wrapper injects the faults), not the
    # control socket (`runsc_checkpoint_via`; that path's refusals: tests/runtime, test_e2e_tmp_dir).
    env = dict(_s3_env(s3, "faults"), AGENTENV_RUNSC_PATH=str(wrapper), AGENTENV_RUNSC_CHECKPOINT_VIA="runsc")
    d = new_data_dir("faults")
    srv = None
    holder = Faulty(None, faults, s3)  # type: ignore[arg-type]
    try:
        srv = _start_publishing(launcher, d, env=env)
        holder.srv = srv
        yield holder
        holder.clear()
        if holder.s3.proc.poll() is not None:  # a test stopped the store: its shutdown and gc need it
            holder.s3 = _restart_s3(holder.s3)
        problems = srv.stop()
        assert not problems, problems
    finally:
        if srv is not None and not srv.stopped:
            try:
                if holder.s3.proc.poll() is not None:
                    holder.s3 = _restart_s3(holder.s3)
                srv.stop(check_leftovers=False)
            except Exception:  # noqa: BLE001
                pass
        holder.s3.stop()
        remove_data_dir(d)
        shutil.rmtree(tmp, ignore_errors=True)


def _prepare(srv: ExtraServer, mib: int = 16) -> tuple[Sandbox, WorkerState]:
    sbx = Sandbox.create(timeout=TIMEOUT_S, **srv.sdk_opts())
    srv.known_ids.add(sbx.sandbox_id)
    sbx.files.write(f"{WORK}/before.txt", MARKER)
    before = setup_worker(sbx, mib)
    return sbx, before


def _assert_intact(srv: ExtraServer, sbx: Sandbox, before: WorkerState, where: str,
                   state: SandboxState = SandboxState.RUNNING) -> None:
    """Never LOST: listed in `state`, and (once running) the same worker with its memory, the same file."""
    info = Sandbox.get_info(sbx.sandbox_id, **srv.sdk_opts())
    assert info.state == state, f"{where}: sandbox is {info.state}, expected {state}\n{srv.log_tail(30)}"
    if state == SandboxState.RUNNING:
        try:
            got = ask_worker(sbx)
        except Exception as e:  # noqa: BLE001 - say what the sandbox and the server saw
            try:
                seen = sbx.commands.run(f"tail -5 {WORK}/worker.log; cat {WORK}/state.json; ls -la --time-style=+%T.%N "
                                        f"{WORK}; python3 {WORK}/find_worker.py; date +%T.%N").stdout
            except Exception as e2:  # noqa: BLE001
                seen = repr(e2)
            pytest.fail(f"{where}: the worker did not answer ({e!r})\n--- in the sandbox ---\n{seen}\n"
                        f"--- server ---\n{srv.log_tail(40)}")
        assert_same_worker(got, before, where)
        assert sbx.files.read(f"{WORK}/before.txt") == MARKER, f"{where}: file written before is gone"


def _raw_pause(srv: ExtraServer, sid: str) -> requests.Response:
    return requests.post(f"{srv.url}/sandboxes/{sid}/pause", headers=srv.headers(), timeout=300)


def _pause_resume_works(srv: ExtraServer, sbx: Sandbox, before: WorkerState, where: str) -> None:
    """With the fault gone, a pause succeeds and the resume continues the very same worker."""
    assert sbx.pause() is True, f"{where}: pause refused after the fault was removed"
    _assert_intact(srv, sbx, before, f"{where}: paused", SandboxState.PAUSED)
    again = Sandbox.connect(sbx.sandbox_id, timeout=TIMEOUT_S, **srv.sdk_opts())
    _assert_intact(srv, again, before, f"{where}: resumed")


def _kill(srv: ExtraServer, sid: str) -> None:
    try:
        Sandbox.kill(sid, **srv.sdk_opts())
    except Exception:  # noqa: BLE001
        pass


def _status(e: BaseException) -> int | None:
    return getattr(e, "status_code", None)


@pytest.mark.timeout(300)
def test_refused_checkpoint_leaves_sandbox_running(faulty):
    srv = faulty.srv
    sbx, before = _prepare(srv)
    try:
        faulty.inject("refuse")
        r = _raw_pause(srv, sbx.sandbox_id)
        assert r.status_code == 503, (r.status_code, r.text)
        body = r.json()
        assert body.get("error_code") == "capture_failed" and "injected" in body["message"], body
        _assert_intact(srv, sbx, before, "after a refused pause (HTTP)")

        with pytest.raises(Exception) as ei:
            sbx.pause()
        assert "injected" in str(ei.value), repr(ei.value)
        _assert_intact(srv, sbx, before, "after a refused pause (SDK)")

        with pytest.raises(Exception) as ei:
            sbx.fork(count=2)
        assert "injected" in str(ei.value), repr(ei.value)
        _assert_intact(srv, sbx, before, "after a refused fork")

        with pytest.raises(Exception) as ei:
            sbx.create_snapshot()
        assert "injected" in str(ei.value), repr(ei.value)
        _assert_intact(srv, sbx, before, "after a refused snapshot")
        assert not Sandbox.list_snapshots(**srv.sdk_opts()).next_items(), "a refused snapshot was recorded"

        faulty.clear()
        _pause_resume_works(srv, sbx, before, "refused checkpoint")
    finally:
        faulty.clear()
        _kill(srv, sbx.sandbox_id)


@pytest.mark.timeout(300)
def test_runsc_killed_mid_checkpoint_leaves_sandbox_running(faulty):
    srv = faulty.srv
    sbx, before = _prepare(srv, mib=64)
    try:
        faulty.inject("kill")
        for op in ("pause", "fork", "snapshot"):
            t0 = time.monotonic()
            try:
                if op == "pause":
                    done = sbx.pause()
                elif op == "fork":
                    done = sbx.fork(count=2)
                else:
                    done = sbx.create_snapshot()
            except Exception as e:  # noqa: BLE001 - the expected outcome: refused, sandbox untouched
                assert _status(e) == 503, f"{op}: {e!r}\n{srv.log_tail(30)}"
                assert "killed by the test" in str(e), f"{op}: the reason is not in the error: {e!r}"
                print(f"{op} with runsc killed mid-checkpoint: refused in {time.monotonic() - t0:.1f}s: "
                      f"{str(e)[:200]}")
            else:  # the checkpoint finished anyway: also fine, as long as nothing is lost
                print(f"{op} with runsc killed mid-checkpoint: succeeded ({done!r})")
                if op == "pause":
                    sbx = Sandbox.connect(sbx.sandbox_id, timeout=TIMEOUT_S, **srv.sdk_opts())
                elif op == "fork":
                    for c in done:
                        if isinstance(c, Sandbox):
                            _kill(srv, c.sandbox_id)
            _assert_intact(srv, sbx, before, f"after a {op} whose runsc checkpoint was killed")
        faulty.clear()
        _pause_resume_works(srv, sbx, before, "runsc killed mid-checkpoint")
    finally:
        faulty.clear()
        _kill(srv, sbx.sandbox_id)
        for s in Sandbox.list_snapshots(**srv.sdk_opts()).next_items():
            Sandbox.delete_snapshot(s.snapshot_id, **srv.sdk_opts())


def _stored(srv: ExtraServer, sid: str) -> tuple[str, str | None]:
    """The sandbox's state and pause image as the server's state store (SQLite) has them."""
    with sqlite3.connect(srv.data_dir / "state.db") as db:
        row = db.execute("SELECT state, memory_digest FROM sandboxes WHERE sandbox_id = ?", (sid,)).fetchone()
    assert row is not None, f"sandbox {sid} is not in the state store"
    return row[0], row[1]


@pytest.mark.timeout(300)
def test_refused_restore_leaves_sandbox_paused_and_resumable(faulty):
    """A resume claims the sandbox first (RESUMING in the store: in a cluster no other node adopts it
    from then on). When the restore then fails, the claim is given back: PAUSED in the store as well,
    the pause image kept, and the next resume continues the same worker."""
    srv = faulty.srv
    sbx, before = _prepare(srv)
    sid = sbx.sandbox_id
    try:
        assert sbx.pause() is True
        state, image = _stored(srv, sid)
        assert state == "paused" and image, (state, image)
        blob = faulty.s3.root / "faults" / "agentenv" / "memory" / image
        assert blob.exists(), f"the pause image is not in the store: {sorted(faulty.s3.root.rglob('*'))[:20]}"
        faulty.inject("refuse-restore")
        for attempt in range(2):  # a second resume claims it again: the first one left nothing behind
            with pytest.raises(Exception) as ei:
                Sandbox.connect(sid, timeout=TIMEOUT_S, **srv.sdk_opts())
            assert "injected" in str(ei.value), f"attempt {attempt}: {ei.value!r}\n{srv.log_tail(30)}"
            _assert_intact(srv, sbx, before, f"after refused restore {attempt}", SandboxState.PAUSED)
            assert _stored(srv, sid) == ("paused", image), f"attempt {attempt}: the store kept the claim"
            assert blob.exists(), f"attempt {attempt}: a failed resume deleted the pause image"
        faulty.clear()
        again = Sandbox.connect(sid, timeout=TIMEOUT_S, **srv.sdk_opts())
        _assert_intact(srv, again, before, "resumed after refused restores")
        assert _stored(srv, sid) == ("running", None)
        deadline = time.monotonic() + 10  # the image goes once RUNNING is stored
        while blob.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not blob.exists(), "the pause image was not deleted after the resume"
    finally:
        faulty.clear()
        _kill(srv, sid)


@pytest.mark.timeout(300)
def test_disk_full_during_pause_leaves_sandbox_running(faulty):
    srv = faulty.srv
    sbx, before = _prepare(srv)
    ckpt = srv.data_dir / "sandboxes" / sbx.sandbox_id / "checkpoint"
    mounted = False
    try:
        ckpt.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "agentenv-test-full", str(ckpt)], check=True)
        mounted = True
        r = _raw_pause(srv, sbx.sandbox_id)
        assert r.status_code == 503, (r.status_code, r.text)
        body = r.json()
        assert body.get("error_code") == "capture_failed", body
        assert "no space left on device" in body["message"].lower(), body
        assert os.path.ismount(ckpt), "the pause removed the full file system's mount point"
        _assert_intact(srv, sbx, before, "after a pause that hit ENOSPC")
        subprocess.run(["umount", str(ckpt)], check=True)
        mounted = False
        _pause_resume_works(srv, sbx, before, "disk full during pause")
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(ckpt)], check=False)
        _kill(srv, sbx.sandbox_id)


CHURN_PY = r"""
import os, time
d = "/home/user/churn"
os.makedirs(d, exist_ok=True)
n = 0
while True:
    n += 1
    tmp = os.path.join(d, f"f{n}.tmp")
    with open(tmp, "w") as f:
        f.write(str(n))
        time.sleep(0.01)
    os.replace(tmp, os.path.join(d, "current"))
"""


@pytest.mark.timeout(300)
def test_capture_image_matches_the_disk_while_files_churn(faulty):
    """A program that keeps opening, holding and renaming files: the source must come back from its
    capture, and a fork child too (the image and the disk must describe the same instant)."""
    srv = faulty.srv
    sbx, before = _prepare(srv)
    try:
        sbx.files.write("/home/user/churn.py", CHURN_PY)
        start_detached(sbx, "python3 /home/user/churn.py >/dev/null 2>&1")
        time.sleep(0.5)
        for i in range(4):
            try:
                kids = sbx.fork(count=1)
            except Exception as e:  # noqa: BLE001
                pytest.fail(f"fork {i} with churning files: {e!r}\n{srv.log_tail(20)}")
            _assert_intact(srv, sbx, before, f"source after fork {i} with churning files")
            for k in kids:
                assert isinstance(k, Sandbox), f"fork {i}: child failed: {k!r}"
                _kill(srv, k.sandbox_id)
    finally:
        _kill(srv, sbx.sandbox_id)


@pytest.mark.timeout(420)
def test_s3_down_during_snapshot_and_pause_publish(faulty):
    """Last on the shared server: the store goes down, then comes back on the same address."""
    srv = faulty.srv
    sbx, before = _prepare(srv)
    try:
        faulty.s3.stop()
        t0 = time.monotonic()
        with pytest.raises(Exception) as ei:
            sbx.create_snapshot()
        print(f"snapshot with S3 down: {time.monotonic() - t0:.1f}s: {str(ei.value)[:300]}")
        assert _status(ei.value) == 503, repr(ei.value)
        assert "snapshot store" in str(ei.value), repr(ei.value)
        _assert_intact(srv, sbx, before, "after a snapshot whose publish failed")

        t0 = time.monotonic()
        r = _raw_pause(srv, sbx.sandbox_id)
        print(f"pause with S3 down: {time.monotonic() - t0:.1f}s: {r.status_code} {r.text[:300]}")
        assert r.status_code == 503, (r.status_code, r.text)
        assert r.json().get("error_code") == "snapshot_store_unavailable", r.text
        _assert_intact(srv, sbx, before, "after a pause whose publish failed")

        faulty.s3 = _restart_s3(faulty.s3)
        assert not Sandbox.list_snapshots(**srv.sdk_opts()).next_items(), "an unpublished snapshot is listed"
        snap = sbx.create_snapshot()
        _assert_intact(srv, sbx, before, "after a snapshot with the store back")
        Sandbox.delete_snapshot(snap.snapshot_id, **srv.sdk_opts())
        _pause_resume_works(srv, sbx, before, "S3 back")
    finally:
        _kill(srv, sbx.sandbox_id)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _image_written(image_dir: Path) -> bool:
    """The capture's memory image dir holds files (its checkpoint wrote them)."""
    try:
        return any(image_dir.iterdir())
    except OSError:
        return False


def _runsc_running(sid: str, command: str) -> bool:
    """A `runsc <command> ... <sid>` process is running."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"runsc") and command.encode() in argv and sid.encode() in argv:
            return True
    return False


def _runsc_status(data_dir: Path, sid: str) -> str | None:
    res = subprocess.run(["runsc", f"--root={data_dir / 'run' / 'runsc'}", "state", sid],
                         capture_output=True, text=True, timeout=20)
    if res.returncode != 0:
        return None
    return json.loads(res.stdout).get("status")


def _kill_server_when(srv: ExtraServer, call, landed, what: str) -> None:
    """Run `call` in a thread and kill -9 the server's process group as soon as `landed()` names
    the moment (polled, up to 60 s); fail if it never did."""
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["ok"] = call()
        except Exception as e:  # noqa: BLE001 - the server dies under it
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    moment = None
    while time.monotonic() < t0 + 60 and moment is None and t.is_alive():
        moment = landed()
        if moment is None:
            time.sleep(0.005)
    _kill_group(srv.pid)
    srv.proc.wait(timeout=30)
    srv.stopped = True
    took = time.monotonic() - t0
    assert moment, f"the fault did not land ({what}) within {took:.1f}s: {result}\n{srv.log_tail(30)}"
    print(f"killed the server group {took:.2f}s into the {what}: {moment}")
    t.join(timeout=120)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("when", ["frozen", "journaled", "sealed", "frozen-running", "checkpointing-running",
                                  "sealing-running"])
def test_server_killed_mid_fork_keeps_source(server, when):
    """kill -9 of the server's process group mid-fork: `frozen` while the source is frozen for its
    checkpoint, `journaled` once the checkpoint is written (the source is stopped, its capture
    journal names the image), `sealed` once the image is sealed and the source is being restored
    from it (these three on the capture that stops the source: AGENTENV_CAPTURE_RUNNING=false);
    on the capture that leaves the source running: `frozen-running` once its freeze (through the
    control socket, `gvisor_control`) saved it as paused, `checkpointing-running` while the Sentry
    writes its image (`--leave-running`, asked through the same socket), `sealing-running` once
    it is thawed and its capture is sealed or its children restore from its image (CI's kills landed around the first, 0.04 s in, while the
    last one's landing test did not look at the image; a runsc killed saving its state file lost
    the source: test_restart_after_runsc_was_killed_saving_the_state). After a
    restart the source is RUNNING or PAUSED with its state, and no capture journal (or scratch
    copy) is left to resurrect an old image later."""
    d = new_data_dir(f"forkcrash-{when}")
    key = new_api_key()
    env = dict(AGENTENV_WARM_START="false")
    if not when.endswith("-running"):
        env["AGENTENV_CAPTURE_RUNNING"] = "false"
    first = second = None
    pgid = None
    try:
        first = start_extra_server(d, api_key=key, env=env, log_name="server-1.log")
        sbx, before = _prepare(first, mib=200)
        sid = sbx.sandbox_id
        sdir = d / "sandboxes" / sid

        def kept_images() -> list[Path]:  # a fork's image for its children, outside the source's dir
            return list((d / "fork-images").glob(f"{sid}-*"))

        def landed() -> str | None:
            if when == "frozen" and _runsc_status(d, sid) == "paused":
                return "source frozen for its checkpoint"
            if when == "journaled" and (sdir / "capture.json").exists():
                return "checkpoint written (capture journal present)"
            if when == "sealed" and '"memory"' in _read(sdir / "capture.json"):
                return "image sealed, source being restored (journal names the memory image)"
            if when == "frozen-running" and _runsc_status(d, sid) == "paused":
                return "source frozen for its image"
            if when == "checkpointing-running" and (_runsc_running(sid, "checkpoint") or (
                    _image_written(sdir / "capture") and not (sdir / "capture-upper").exists()
                    and _runsc_status(d, sid) == "paused")):
                return "the checkpoint of the source (leaving it running) under way"
            if when == "sealing-running" \
                    and any(_image_written(p) for p in [sdir / "capture", *kept_images()]) \
                    and not (sdir / "capture-upper").exists() and not _runsc_running(sid, "checkpoint") \
                    and _runsc_status(d, sid) == "running":
                return "source thawed, its capture being sealed or its children restored from its image"
            return None

        pgid = first.pid
        _kill_server_when(first, lambda: sbx.fork(count=4, timeout=600, request_timeout=300), landed, f"fork ({when})")
        # what a kill between a write and its rename leaves (the journal's, the capture base's): the
        # kill above lands there only by chance, so both are planted as such a kill leaves them
        for half in ("capture.tmp", "capture-base.tmp"):
            (sdir / half).write_text('{"cut": ')

        second = start_extra_server(d, api_key=key, env=env, log_name="server-2.log")
        second.known_ids |= first.known_ids
        o2 = second.sdk_opts()
        for info in Sandbox.list(**o2).next_items():
            second.known_ids.add(info.sandbox_id)
        try:
            info = Sandbox.get_info(sid, **o2)
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"source {sid} LOST by a server crash mid-fork ({when}): {e!r}\n--- first server ---\n"
                        f"{first.log_tail(25)}\n--- restarted server ---\n{second.log_tail(40)}")
        print(f"source after the restart: {info.state}")
        assert info.state in (SandboxState.RUNNING, SandboxState.PAUSED), info.state
        if when == "journaled":
            assert info.state == SandboxState.PAUSED, "a source stopped after its checkpoint must come back paused"
        if when.endswith("-running"):
            assert info.state == SandboxState.RUNNING, "a source left running by its capture must run on"
            scratch = [p.name for p in [*sdir.glob("capture*"), *kept_images()]
                       if p.name != CAPTURE_BASE]  # the base of its next capture's delta stays
            assert not scratch, "a capture's scratch copy outlived the restart"
        assert not (sdir / "capture.json").exists(), "the capture journal outlived the recovery"
        assert not list(sdir.glob("*.tmp")), "a half-written file outlived the recovery"
        again = Sandbox.connect(sid, timeout=TIMEOUT_S, **o2)
        _assert_intact(second, again, before, f"source after a server crash mid-fork ({when})")
        children = [i.sandbox_id for i in Sandbox.list(**o2).next_items() if i.sandbox_id != sid]
        print(f"children that survived: {children}")
        for cid in children + [sid]:
            _kill(second, cid)
        problems = second.stop()
        second = None
        assert not problems, problems
    finally:
        stop_unchecked(second, first)
        if pgid is not None:
            _kill_group(pgid)
        remove_data_dir(d)


@pytest.mark.timeout(300)
def test_restart_after_runsc_was_killed_saving_the_state(server):
    """A runsc command killed while it saved the container's state (a crash with the server's whole
    cgroup, a timeout) leaves runsc's state file empty, and runsc refuses every command on the live
    sandbox. The restarted server used to drop it; now it puts back the state it expected and the
    sandbox runs on with its memory and files."""
    d = new_data_dir("cut-state")
    key = new_api_key()
    first = second = None
    try:
        first = start_extra_server(d, api_key=key, log_name="server-1.log")
        sbx, before = _prepare(first)
        sid = sbx.sandbox_id
        first.known_ids.add(sbx.fork(count=1, timeout=TIMEOUT_S)[0].sandbox_id)  # a capture: pause, resume
        _kill_group(first.pid)
        first.proc.wait(timeout=30)
        first.stopped = True
        state_file, = (d / "run" / "runsc").glob(f"{sid}_sandbox:*.state")
        state_file.write_bytes(b"")  # what the kill inside runsc's truncate-then-write leaves
        assert _runsc_status(d, sid) is None
        second = start_extra_server(d, api_key=key, log_name="server-2.log")
        second.known_ids |= first.known_ids
        again = Sandbox.connect(sid, timeout=TIMEOUT_S, **second.sdk_opts())
        _assert_intact(second, again, before, "after a restart that found runsc's state file cut")
        assert "was cut short" in second.log_tail(60)
        for cid in list(second.known_ids):
            _kill(second, cid)
        problems = second.stop()
        second = None
        assert not problems, problems
    finally:
        stop_unchecked(second, first)
        remove_data_dir(d)



@pytest.mark.timeout(360)
@pytest.mark.parametrize("when", ["journaled", "sealed"])
def test_server_killed_mid_pause_publish_keeps_sandbox(server, when):
    """kill -9 of a server that publishes its pauses (as a cluster node does) while a pause uploads
    to the snapshot store (a real S3 server, stopped so that the upload waits on its retries):
    `journaled` as soon as the checkpoint is written (the sandbox is stopped; the pause's journal
    names the image), `sealed` once its upper and image are sealed into artifacts. The restarted
    server (with the store back) finds the sandbox PAUSED, publishes it, and the resume continues
    the very same worker with its files; no journal is left."""
    tmp = Path(tempfile.mkdtemp(prefix="agentenv-pausecrash-", dir="/var/tmp"))
    launcher = _publishing_launcher(tmp)
    s3 = start_s3(tmp / "s3root")
    env = _s3_env(s3, "pausecrash")
    d = new_data_dir(f"pausecrash-{when}")
    key = new_api_key()
    first = second = None
    try:
        first = _start_publishing(launcher, d, api_key=key, env=env, log_name="server-1.log")
        sbx, before = _prepare(first)
        sid = sbx.sandbox_id
        journal = d / "sandboxes" / sid / "capture.json"
        s3.stop()  # the pause's upload now waits on the store client's retries

        def landed() -> str | None:
            text = _read(journal)
            if when == "journaled" and text and '"memory"' not in text:
                return "checkpoint written (the pause's journal names the image)"
            if when == "sealed" and '"memory"' in text:
                return "upper and image sealed, the upload waiting on the store"
            return None

        _kill_server_when(first, lambda: _raw_pause(first, sid), landed, f"pause ({when})")
        s3 = _restart_s3(s3)

        second = _start_publishing(launcher, d, api_key=key, env=env, log_name="server-2.log")
        second.known_ids |= first.known_ids
        o2 = second.sdk_opts()
        try:
            info = Sandbox.get_info(sid, **o2)
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"sandbox {sid} LOST by a server crash mid-pause ({when}): {e!r}\n--- first server ---\n"
                        f"{first.log_tail(25)}\n--- restarted server ---\n{second.log_tail(40)}")
        assert info.state == SandboxState.PAUSED, f"{info.state}\n{second.log_tail(30)}"
        assert not journal.exists(), "the pause's journal outlived the recovery"
        stored = sorted(p.name for p in (s3.root / "pausecrash" / "agentenv" / "memory").glob("*"))
        assert stored, f"the recovered pause was not published\n{second.log_tail(30)}"
        again = Sandbox.connect(sid, timeout=TIMEOUT_S, **o2)
        _assert_intact(second, again, before, f"resumed after a server crash mid-pause ({when})")
        _kill(second, sid)
        problems = second.stop()
        second = None
        assert not problems, problems
    finally:
        stop_unchecked(second, first)
        if first is not None:
            _kill_group(first.pid)
        s3.stop()
        remove_data_dir(d)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.timeout(300)
def test_autopause_that_cannot_pause_keeps_running_and_retries(faulty):
    """autoPause on timeout while checkpoints fail: the sandbox keeps running with its worker, a
    `failed` pause event says why, and once the fault is gone a retry pauses it with its full state."""
    srv = faulty.srv
    since = requests.get(f"{srv.url}/events?tail=1", headers=srv.headers(), timeout=30).json()["lastSeq"]
    faulty.inject("refuse")
    sbx = Sandbox.create(timeout=TIMEOUT_S, lifecycle={"on_timeout": "pause"}, **srv.sdk_opts())
    srv.known_ids.add(sbx.sandbox_id)
    try:
        sbx.files.write(f"{WORK}/before.txt", MARKER)
        before = setup_worker(sbx, 16)
        sbx.set_timeout(2)  # expires now: the reaper tries to pause it, and the checkpoint is refused
        deadline = time.monotonic() + 90
        failed: list[dict] = []
        while not failed:
            assert time.monotonic() < deadline, f"no failed pause event\n{srv.log_tail(30)}"
            time.sleep(1)
            evs = requests.get(f"{srv.url}/events?since={since}&sandboxID={sbx.sandbox_id}", headers=srv.headers(),
                               timeout=30).json()["events"]
            failed = [e for e in evs if e["type"] == "failed" and e.get("operation") == "pause"]
        assert "injected" in failed[0].get("message", ""), failed[0]
        _assert_intact(srv, sbx, before, "after a refused autoPause")
        faulty.clear()
        deadline = time.monotonic() + 90
        while Sandbox.get_info(sbx.sandbox_id, **srv.sdk_opts()).state != SandboxState.PAUSED:
            assert time.monotonic() < deadline, f"autoPause was not retried\n{srv.log_tail(30)}"
            time.sleep(1)
        again = Sandbox.connect(sbx.sandbox_id, timeout=TIMEOUT_S, **srv.sdk_opts())
        _assert_intact(srv, again, before, "resumed after the retried autoPause")
    finally:
        faulty.clear()
        _kill(srv, sbx.sandbox_id)
