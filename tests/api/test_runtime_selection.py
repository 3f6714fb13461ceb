"""Runtime reporting and per-request runtime choice through the real server (spec-validated).

Every sandbox reports its runtime (`runtime` in detail and list). A create may ask for a runtime
with the metadata key `agentenv.runtime`; asking for one this node cannot serve is a 400 that
says why, never a sandbox on another runtime.
"""

from __future__ import annotations

import os
import secrets

import pytest

TEMPLATE = "base"
RUN = secrets.token_hex(4)


@pytest.fixture(scope="module")
def api(server, make_spec_client):
    return make_spec_client(server.api_url, server.api_key)


def create(api, **metadata):
    return api.request_sync("POST", "/v2/sandboxes", json={"templateID": TEMPLATE, "timeout": 120,
                                                           "metadata": {"run": RUN, **metadata}})


def ours(api) -> list[dict]:
    r = api.request_sync("GET", "/v2/sandboxes")
    assert r.status_code == 200
    return [s for s in r.json() if s.get("metadata", {}).get("run") == RUN]


def test_sandboxes_report_their_runtime_and_accept_their_own(api):
    r = create(api)
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    try:
        detail = api.request_sync("GET", f"/sandboxes/{sid}").json()
        runtime = detail["runtime"]
        assert runtime in ("gvisor", "firecracker", "qemu")
        assert [s["runtime"] for s in ours(api) if s["sandboxID"] == sid] == [runtime]
        # Asking for the node's own runtime (or auto) is honoured.
        for asked in (runtime, "auto"):
            r2 = create(api, **{"agentenv.runtime": asked})
            assert r2.status_code == 201, r2.text
            sid2 = r2.json()["sandboxID"]
            assert api.request_sync("GET", f"/sandboxes/{sid2}").json()["runtime"] == runtime
            assert api.request_sync("DELETE", f"/sandboxes/{sid2}").status_code == 204
    finally:
        api.request_sync("DELETE", f"/sandboxes/{sid}")


def test_asking_for_firecracker_without_hardware_virtualization_is_a_clear_400(api):
    with open("/proc/cpuinfo") as f:
        hardware = bool(set(next((line for line in f if line.startswith("flags")), "").split()) & {"vmx", "svm"})
    if hardware:
        pytest.skip("this host has VT-x/AMD-V: Firecracker's availability depends on other things here")
    before = {s["sandboxID"] for s in ours(api)}
    r = create(api, **{"agentenv.runtime": "firecracker"})
    assert r.status_code == 400, r.text
    msg = r.json()["message"]
    assert "runtime 'firecracker' was requested but cannot run on this host" in msg
    assert "no vmx/svm" in msg or "no usable /dev/kvm" in msg
    if os.path.exists("/sys/module/kvm_pvm"):
        assert "PVM" in msg
    assert {s["sandboxID"] for s in ours(api)} == before   # nothing was started instead


def test_unknown_runtime_is_400(api):
    r = create(api, **{"agentenv.runtime": "xen"})
    assert r.status_code == 400
    assert "unknown runtime 'xen'" in r.json()["message"]
