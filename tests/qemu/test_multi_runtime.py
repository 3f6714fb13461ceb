"""One node serving two runtimes (AGENTENV_RUNTIME=qemu, AGENTENV_EXTRA_RUNTIMES=gvisor): the runtime
of a sandbox comes from its create request (metadata `agentenv.runtime`), else its template, else
the node default; a snapshot's memory image restores only under the runtime that made it; a
runtime the host cannot run is a 400 with the host's reason, never a substitution.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import requests
from e2b import Sandbox
from e2b.exceptions import SandboxException

from serverproc import agentenv_executable

REQ = 300
RUNTIME_KEY = "agentenv.runtime"
GVISOR_KERNEL = "4.4.0"  # what gVisor's sentry reports; the QEMU guest runs Debian's 6.1 kernel


def _runtime(srv, sandbox_id: str) -> str:
    r = requests.get(f"{srv.url}/sandboxes/{sandbox_id}", headers=srv.headers(), timeout=30)
    r.raise_for_status()
    return r.json()["runtime"]


def _cli(srv, *args: str) -> str:
    env = dict(os.environ)
    env.update(srv.env)
    r = subprocess.run([agentenv_executable(), *args, "--data-dir", str(srv.data_dir)], env=env, capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"agentenv {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


@pytest.mark.timeout(900)
def test_runtime_per_request_per_template_and_per_snapshot(qemu_server):
    srv = qemu_server
    made: list[Sandbox] = []
    try:
        # per request: the node default is qemu; this one asks for gVisor
        g = Sandbox.create(metadata={RUNTIME_KEY: "gvisor"}, timeout=600, request_timeout=REQ, **srv.sdk_opts())
        made.append(g)
        assert _runtime(srv, g.sandbox_id) == "gvisor"
        assert g.commands.run("uname -r", request_timeout=REQ).stdout.strip() == GVISOR_KERNEL

        # per template: an operator-made template whose sandboxes run under gVisor without asking
        _cli(srv, "templates", "create", "base-gvisor", "--runtime", "gvisor")
        listed = json.loads(_cli(srv, "templates", "list", "--json"))
        assert [t["runtime"] for t in listed if "base-gvisor" in t["aliases"]] == ["gvisor"]
        t = Sandbox.create("base-gvisor", timeout=600, request_timeout=REQ, **srv.sdk_opts())
        made.append(t)
        assert _runtime(srv, t.sandbox_id) == "gvisor"
        listed = requests.get(f"{srv.url}/templates", headers=srv.headers(), timeout=30).json()
        assert {x["runtime"] for x in listed if "base-gvisor" in x["aliases"]} == {"gvisor"}

        # a snapshot of a gVisor sandbox on this qemu-default node restores under gVisor ...
        t.files.write("/home/user/mark.txt", "from gvisor", request_timeout=REQ)
        snap = t.create_snapshot(request_timeout=REQ)
        s = Sandbox.create(snap.snapshot_id, timeout=600, request_timeout=REQ, **srv.sdk_opts())
        made.append(s)
        assert _runtime(srv, s.sandbox_id) == "gvisor"
        assert s.files.read("/home/user/mark.txt", request_timeout=REQ) == "from gvisor"
        # ... and asking for another runtime for it is refused with the reason
        with pytest.raises(SandboxException, match="400: .*made by the gvisor runtime"):
            Sandbox.create(snap.snapshot_id, metadata={RUNTIME_KEY: "qemu"}, timeout=600, request_timeout=REQ,
                           **srv.sdk_opts())

        # a fork child keeps its parent's runtime
        r = requests.post(f"{srv.url}/sandboxes/{g.sandbox_id}/fork", json={"count": 1}, headers=srv.headers(),
                          timeout=REQ)
        assert r.status_code == 201, r.text
        (result,) = r.json()
        assert "sandbox" in result, result
        child_id = result["sandbox"]["sandboxID"]
        made.append(Sandbox.connect(child_id, request_timeout=REQ, **srv.sdk_opts()))
        assert _runtime(srv, child_id) == "gvisor"

        # a runtime this host cannot run (Firecracker on PVM, no hardware virtualization) is a 400
        with pytest.raises(SandboxException, match="400: .*firecracker"):
            Sandbox.create(metadata={RUNTIME_KEY: "firecracker"}, timeout=600, request_timeout=REQ, **srv.sdk_opts())
    finally:
        for sbx in made:
            try:
                sbx.kill(request_timeout=REQ)
            except Exception:  # noqa: BLE001
                pass
