"""Fixtures of the snapshot-store tests: a real S3 server (rclone) per module, and each store."""

from __future__ import annotations

import os

import pytest

from agentenv.storage.snapshots import LocalSnapshotStore, S3SnapshotStore
from s3server import start_s3


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    srv = start_s3(tmp_path_factory.mktemp("s3") / "data")
    (srv.root / "bucket").mkdir()
    yield srv
    srv.stop()


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path, s3):
    if request.param == "local":
        return LocalSnapshotStore(tmp_path / "store")
    return S3SnapshotStore(bucket="bucket", prefix=f"t{os.getpid()}-{tmp_path.name}/", endpoint_url=s3.endpoint,
                           access_key=s3.access_key, secret_key=s3.secret_key)
