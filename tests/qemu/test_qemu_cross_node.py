"""A QEMU snapshot taken on one node restores on another through an S3 snapshot store (rclone).

The guest kernel inside a memory image has blocks of its read-only drives (root and tools ext4)
cached, and every node builds those drives byte-differently; so the image names the exact drives it
needs (by digest), they travel through the store with it, and the second node restores on them.
Node A is stopped and its data dir deleted before node B restores: nothing of A is reachable.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import requests
from e2b import Sandbox

from s3server import start_s3
from serverproc import new_api_key, new_data_dir, remove_data_dir, start_extra_server

REQ = 300


@pytest.mark.timeout(1500)
def test_qemu_snapshot_restores_on_another_node_through_s3(guest_image, qemu_env):
    tmp = Path(tempfile.mkdtemp(prefix="agentenv-qemu-s3-", dir="/var/tmp"))
    s3 = start_s3(tmp / "root")
    env = dict(qemu_env, AGENTENV_WARM_START="false", AGENTENV_SNAPSHOT_STORE="s3",
               AGENTENV_S3_BUCKET=f"qx-{secrets.token_hex(3)}", AGENTENV_S3_PREFIX="agentenv/",
               AGENTENV_S3_ENDPOINT=s3.endpoint, AGENTENV_S3_ACCESS_KEY=s3.access_key,
               AGENTENV_S3_SECRET_KEY=s3.secret_key)
    key = new_api_key()
    da, db = new_data_dir("qxa"), new_data_dir("qxb")
    a = b = None
    try:
        a = start_extra_server(da, api_key=key, env=env, log_name="server-a.log")
        src = Sandbox.create(timeout=1800, request_timeout=REQ, **a.sdk_opts())
        a.known_ids.add(src.sandbox_id)
        src.files.write("/home/user/travel.txt", "made on node A", request_timeout=REQ)
        src.commands.run("nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.2; done' "
                         ">/dev/null 2>&1 &", timeout=60, request_timeout=REQ)
        time.sleep(2)
        pid = src.commands.run("pgrep -f 'while true' | head -1", timeout=60, request_timeout=REQ).stdout.strip()
        before = int(src.files.read("/tmp/counter", request_timeout=REQ))
        snap = src.create_snapshot(request_timeout=REQ)
        src.kill(request_timeout=REQ)
        a.stop(timeout=120)
        remove_data_dir(da)  # node A and its drives are gone

        b = start_extra_server(db, api_key=key, env=env, log_name="server-b.log")
        assert not (db / "drives").exists()
        t0 = time.monotonic()
        dst = Sandbox.create(snap.snapshot_id, timeout=1800, request_timeout=REQ, **b.sdk_opts())
        print(f"restore on node B (incl. pulling memory image and drives): {time.monotonic() - t0:.1f}s")
        b.known_ids.add(dst.sandbox_id)
        info = requests.get(f"{b.url}/sandboxes/{dst.sandbox_id}", headers=b.headers(), timeout=30).json()
        assert info["runtime"] == "qemu"
        assert dst.files.read("/home/user/travel.txt", request_timeout=REQ) == "made on node A"
        assert dst.commands.run("pgrep -f 'while true' | head -1", timeout=60,
                                request_timeout=REQ).stdout.strip() == pid, "the process did not come along"
        time.sleep(1.5)
        assert int(dst.files.read("/tmp/counter", request_timeout=REQ)) > before  # and it keeps counting
        pulled = sorted(p.name for p in (db / "drives").iterdir())
        assert len(pulled) == 2, pulled  # root + tools drive, by digest
        # the restored VM can be captured again on node B (its drives are now B's pulled copies)
        again = dst.create_snapshot(request_timeout=REQ)
        assert again.snapshot_id != snap.snapshot_id
        dst.kill(request_timeout=REQ)
    finally:
        for srv, d in ((a, da), (b, db)):
            if srv is not None and not srv.stopped:
                try:
                    srv.stop(timeout=120)
                except Exception:  # noqa: BLE001
                    pass
            if d.exists():
                remove_data_dir(d)
        s3.stop()
        shutil.rmtree(tmp, ignore_errors=True)
