"""The server container image, as an operator builds and runs it: the repo's `Dockerfile` built with
Debian's podman, inspected, then `agentenv serve` started from it (privileged) and driven by the E2B
SDK from the host: create a sandbox, run a command, write and read a file, kill it.

No registry is reachable from CI, so the image is built FROM a local import of the debootstrap base
image the test suite already builds (`images/base/rootfs`, any Debian 12 root filesystem works). The
engine's storage (base import + build layers) lives under the shared test data dir, so a CI run
after the first rebuilds only the layers whose inputs changed. See docs/packaging.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from e2b import Sandbox

from serverproc import free_port, new_api_key, new_data_dir, remove_data_dir, shared_data_dir

REPO = Path(__file__).resolve().parents[2]
IMAGE = "localhost/agentenv:test"
# The engine's own limits must not exceed the host's: raising RLIMIT_NOFILE/NPROC needs
# CAP_SYS_RESOURCE, which a host that is itself a container may lack (then podman's defaults fail).
ULIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=20000:20000"]

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a rootful engine, privileged container)"),
    pytest.mark.skipif(shutil.which("podman") is None or shutil.which("runc") is None,
                       reason="podman/runc not installed (scripts/setup.sh --test installs them)"),
    pytest.mark.timeout(900),
]


@dataclass
class Podman:
    root: Path  # storage (images, layers) and run state, under the shared test data dir

    def argv(self, *args: str) -> list[str]:
        # runc, not Debian 12's default crun 1.8: crun refuses hosts whose cgroup v2 hierarchy has
        # controllers next to v1 ("hybrid mode"); runc runs there and on pure v1/v2.
        return ["podman", "--root", str(self.root / "storage"), "--runroot", str(self.root / "run"),
                "--storage-driver", "overlay", "--runtime", "runc", *args]

    def __call__(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run(self.argv(*args), capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
        if check:
            assert p.returncode == 0, (args, p.returncode, p.stdout[-3000:], p.stderr[-3000:])
        return p


def _export_tree(dest: Path) -> Path:
    """The checkout's files (tracked + new, not ignored), as a release build sees them."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout
    for rel in filter(None, files.split("\0")):
        src = REPO / rel
        if src.is_file() and not src.is_symlink():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def _base_image(podman: Podman) -> str:
    """The suite's debootstrap base image as a local image, imported once per content version."""
    base = shared_data_dir() / "images" / "base"
    repo = "localhost/agentenv-build-base"
    tag = f"{repo}:" + hashlib.sha256((base / "manifest.json").read_bytes()).hexdigest()[:16]
    if podman("image", "exists", tag, check=False).returncode != 0:
        old = podman("images", "--format", "{{.Repository}}:{{.Tag}}", repo, check=False).stdout.split()
        if old:  # imports of earlier base images (~0.5 GB each)
            podman("rmi", "-f", *old, check=False)
        tar = subprocess.Popen(["tar", "-C", str(base / "rootfs"), "-c", "."], stdout=subprocess.PIPE)
        imp = subprocess.run(podman.argv("import", "-", tag), stdin=tar.stdout, capture_output=True, text=True,
                             timeout=600)
        tar.stdout.close()
        assert tar.wait(120) == 0 and imp.returncode == 0, imp.stderr[-2000:]
    return tag


def _build_trust(work: Path) -> list[str]:
    """This host's CA bundle for pip and npm in the build's RUN steps only (a build volume and the
    Dockerfile's PIP_CERT / NPM_CONFIG_CAFILE build args), so a build works behind a TLS-intercepting
    mirror as well as without one."""
    (work / "ca").mkdir()
    shutil.copy(Path("/etc/ssl/certs/ca-certificates.crt"), work / "ca" / "ca.crt")
    return ["-v", f"{work / 'ca'}:/run/agentenv-build:ro", "--build-arg", "PIP_CERT=/run/agentenv-build/ca.crt",
            "--build-arg", "NPM_CONFIG_CAFILE=/run/agentenv-build/ca.crt"]


@pytest.fixture(scope="module")
def built(server, tmp_path_factory) -> Iterator[tuple[Podman, dict]]:
    """The image built from this tree (`server`: the suite's images exist, the base among them)."""
    podman = Podman(shared_data_dir().parent / f"{shared_data_dir().name}-podman")
    podman.root.mkdir(exist_ok=True)
    work = tmp_path_factory.mktemp("image")
    src = _export_tree(work / "src")
    started = time.monotonic()
    base = _base_image(podman)
    build = podman("build", *ULIMITS, *_build_trust(work), "--build-arg", f"BASE_IMAGE={base}", "-t", IMAGE,
                   str(src), timeout=1200, check=False)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-3000:]
    print(f"\nimage built in {time.monotonic() - started:.1f}s")
    info = json.loads(podman("image", "inspect", IMAGE).stdout)[0]
    yield podman, info
    podman("image", "prune", "-f", check=False)  # dangling layers of earlier builds; the cache stays


def test_image_metadata_and_cli(built):
    podman, info = built
    cfg = info["Config"]
    assert cfg["Entrypoint"] == ["agentenv"] and cfg["Cmd"] == ["serve"]
    assert "3000/tcp" in cfg["ExposedPorts"] and "/var/lib/agentenv" in cfg["Volumes"]
    assert "AGENTENV_DATA_DIR=/var/lib/agentenv" in cfg["Env"]
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    out = podman("run", "--rm", *ULIMITS, IMAGE, "--version").stdout
    assert out.strip() == f"agentenv, version {version}"
    # nothing of the build's trust settings stays in the image (at most the empty mount point)
    left = podman("run", "--rm", *ULIMITS, "--entrypoint", "sh", IMAGE, "-c",
                  "ls -A /run/agentenv-build 2>/dev/null; env | grep -E '^(PIP_CERT|NPM_CONFIG_CAFILE)=' || true")
    assert left.stdout.strip() == ""


def test_doctor_inside_a_privileged_container(built):
    podman, _ = built
    p = podman("run", "--rm", "--privileged", *ULIMITS, IMAGE, "doctor", "--json", check=False)
    checks = {c["name"]: c for c in json.loads(p.stdout)}
    failed = [c for c in checks.values() if c["status"] == "fail"]
    assert p.returncode == 0 and not failed, failed or p.stderr[-2000:]
    for name in ("root", "runsc (gVisor)", "network namespaces", "cgroups", "overlayfs", "nft"):
        assert checks[name]["status"] == "ok", checks[name]


@pytest.fixture
def container(built) -> Iterator[tuple[str, str]]:
    """`agentenv serve` in the image: privileged, the data dir a host directory (the suite's built
    images hard-linked in), the API on a free host port. Yields (url, api key)."""
    podman, _ = built
    data = new_data_dir("container")
    name = f"agentenv-test-{os.getpid()}-{data.name[-6:]}"
    port, key = free_port(), new_api_key()
    url = f"http://127.0.0.1:{port}"
    try:
        podman("run", "-d", "--name", name, "--privileged", *ULIMITS, "-v", f"{data}:/var/lib/agentenv",
               "-p", f"127.0.0.1:{port}:3000", "-e", f"AGENTENV_BOOTSTRAP_API_KEY={key}", IMAGE)
        deadline = time.monotonic() + 120
        while True:
            try:
                if requests.get(f"{url}/health", timeout=2).ok:
                    break
            except requests.RequestException:
                pass
            state = podman("inspect", "--format", "{{.State.Status}}", name, check=False).stdout.strip()
            assert state == "running" and time.monotonic() < deadline, \
                f"container {state}:\n{podman('logs', name, check=False).stderr[-4000:]}"
            time.sleep(0.5)
        yield url, key
    finally:
        logs = podman("logs", name, check=False)
        stop = podman("stop", "-t", "60", name, check=False, timeout=120)
        podman("rm", "-f", name, check=False)
        remove_data_dir(data)  # the container's mounts lived in its own mount namespace
        assert stop.returncode == 0, stop.stderr + logs.stderr[-3000:]


def test_sdk_drives_the_server_container(container):
    url, key = container
    opts = dict(api_key=key, api_url=url, sandbox_url=url)
    sbx = Sandbox.create(timeout=120, **opts)
    try:
        r = sbx.commands.run("cat /etc/debian_version && echo in-sandbox > /tmp/x && cat /tmp/x")
        assert r.exit_code == 0 and r.stdout.splitlines()[-1] == "in-sandbox", r
        sbx.files.write("/home/user/hello.txt", "hello from the host")
        assert sbx.files.read("/home/user/hello.txt") == "hello from the host"
        assert _listed(opts) == [sbx.sandbox_id]
    finally:
        sbx.kill()
    assert _listed(opts) == []


def _listed(opts: dict) -> list[str]:
    pages, ids = Sandbox.list(**opts), []
    while pages.has_next:
        ids += [s.sandbox_id for s in pages.next_items()]
    return ids
