"""OCI images as template bases: import from a local OCI layout / `docker save` tarball, or a registry.

An imported image becomes an ordinary read-only image under `<data>/images/<name>/rootfs` (layers
applied in order, whiteouts honoured) plus a `manifest.json` carrying the image config (Env,
WorkingDir, User). Fix-ups make any distribution run envd: the tools layer brings its own loader and
libc, so only a mount point, a `user` account, resolver files and the sudo shim are added.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from agentenv.errors import BadRequest

# `e2bdev/base` is what the E2B SDK sends when a template names no base image.
BASE_IMAGE_REFS = frozenset({"e2bdev/base", "e2bdev/base:latest", "base", "agentenv/base"})


def normalize_ref(ref: str) -> str:
    """'alpine' -> 'docker.io/library/alpine:latest' (docker's defaults), digests kept."""
    ref = ref.strip()
    name, tag = ref, None
    if "@" in ref:
        name, digest = ref.split("@", 1)
        tag = "@" + digest
    else:
        head, sep, t = ref.rpartition(":")
        if sep and "/" not in t:
            name, tag = head, ":" + t
    first = name.split("/", 1)[0]
    if "/" not in name or ("." not in first and ":" not in first and first != "localhost"):
        name = "docker.io/" + (name if "/" in name else "library/" + name)
    return name + (tag or ":latest")


def local_name(ref: str) -> str:
    """The image-store name an image reference is kept under (readable, collision-free)."""
    full = normalize_ref(ref)
    short = re.sub(r"[^A-Za-z0-9_.-]+", "-", full.split("/", 1)[1] if full.startswith("docker.io/") else full)
    return f"oci-{short.strip('-.')[:80]}-{hashlib.sha256(full.encode()).hexdigest()[:8]}"


# ---------------------------------------------------------------------------------------------- import

class ImageFormatError(BadRequest):
    pass


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ImageFormatError(f"cannot read {path.name}: {e}") from None


def _blob(root: Path, digest: str) -> Path:
    algo, _, hexd = digest.partition(":")
    if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hexd):
        raise ImageFormatError(f"unsupported digest {digest!r}")
    p = root / "blobs" / algo / hexd
    if not p.is_file():
        raise ImageFormatError(f"blob {digest[:19]} is missing from the image")
    return p


def _oci_layout(root: Path, ref: str | None) -> tuple[list[Path], dict]:
    """Layer files (bottom first) and the image config of an OCI image layout directory."""
    index = _read_json(root / "index.json")
    manifests = index.get("manifests") or []
    if not manifests:
        raise ImageFormatError("index.json lists no manifests")
    chosen = manifests[0]
    if ref is not None:
        for m in manifests:
            name = (m.get("annotations") or {}).get("org.opencontainers.image.ref.name")
            if name and (ref.endswith(":" + name) or ref == name):
                chosen = m
    manifest = _read_json(_blob(root, chosen["digest"]))
    while "manifests" in manifest:  # an image index: take the linux/amd64 entry
        entries = manifest["manifests"]
        pick = next((e for e in entries if (e.get("platform") or {}).get("architecture") in ("amd64", None)
                     and (e.get("platform") or {}).get("os", "linux") == "linux"), entries[0])
        manifest = _read_json(_blob(root, pick["digest"]))
    config = _read_json(_blob(root, manifest["config"]["digest"]))
    return [_blob(root, layer["digest"]) for layer in manifest.get("layers", [])], config


def _docker_save(root: Path) -> tuple[list[Path], dict]:
    """Layer files and config of a `docker save` tree (manifest.json + config + layer tars)."""
    entries = json.loads((root / "manifest.json").read_text())
    if not entries:
        raise ImageFormatError("manifest.json lists no image")
    entry = entries[0]
    config = _read_json(root / entry["Config"])
    layers = []
    for rel in entry.get("Layers", []):
        p = (root / rel).resolve()
        if not p.is_file() or root.resolve() not in p.parents:
            raise ImageFormatError(f"layer {rel} is missing from the archive")
        layers.append(p)
    return layers, config


def _apply_layer(layer: Path, rootfs: Path) -> None:
    """Apply one layer tar (any compression tar reads) onto `rootfs`, honouring OCI whiteouts."""
    with tarfile.open(layer, "r:*") as tf:
        names = tf.getnames()
    for name in names:
        norm = os.path.normpath(name).lstrip("/")
        if norm.startswith(".."):
            raise ImageFormatError(f"layer entry escapes the root: {name}")
        base = os.path.basename(norm)
        parent = rootfs / os.path.dirname(norm)
        if base == ".wh..wh..opq":  # opaque directory: hide what lower layers put there
            if parent.is_dir() and not parent.is_symlink():
                for child in parent.iterdir():
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child)
                    else:
                        child.unlink()
        elif base.startswith(".wh."):
            target = parent / base[len(".wh."):]
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
    # GNU tar: owners, modes, xattrs, device nodes, hard links; refuses '..' members by default.
    res = subprocess.run(["tar", "--extract", "--numeric-owner", "--same-owner", "--same-permissions",
                          "--xattrs", "--xattrs-include=*", "--exclude=.wh.*", "--exclude=*/.wh.*",
                          "-C", str(rootfs), "-f", str(layer)], capture_output=True, text=True)
    if res.returncode != 0:
        raise ImageFormatError(f"extracting layer {layer.name[:19]} failed: {res.stderr.strip()[-300:]}")


def _fix_up(rootfs: Path) -> dict:
    """What envd needs in any distribution: tools mount point, `user` (1000), resolver, shims."""
    from agentenv import constants
    from agentenv.storage.images import HOSTNAME, NAMESERVERS, ensure_sudo_shim

    info = {}
    osr = rootfs / "etc/os-release"
    if osr.is_file() or osr.is_symlink():
        try:
            for line in (rootfs / "etc/os-release").read_text().splitlines():
                k, _, v = line.partition("=")
                if k in ("ID", "PRETTY_NAME", "VERSION_ID"):
                    info[k.lower()] = v.strip('"')
        except OSError:
            pass
    (rootfs / constants.TOOLS_MOUNT.lstrip("/")).mkdir(mode=0o755, exist_ok=True)
    for d, mode in (("tmp", 0o1777), ("etc", 0o755), ("root", 0o700), ("home", 0o755)):
        p = rootfs / d
        if not p.exists():
            p.mkdir(mode=mode)
            p.chmod(mode)
    passwd, group = rootfs / "etc/passwd", rootfs / "etc/group"
    if not passwd.exists():
        passwd.write_text("root:x:0:0:root:/root:/bin/sh\n")
    if not group.exists():
        group.write_text("root:x:0:\n")
    user, home = constants.DEFAULT_USER, constants.DEFAULT_HOME
    shell = "/bin/bash" if (rootfs / "bin/bash").exists() else "/bin/sh"
    if not any(line.split(":")[0] == user for line in passwd.read_text().splitlines()):
        taken = {line.split(":")[2] for line in passwd.read_text().splitlines() if line.count(":") >= 3}
        uid = "1000" if "1000" not in taken else "1001"
        with open(passwd, "a") as f:
            f.write(f"{user}:x:{uid}:{uid}::{home}:{shell}\n")
        with open(group, "a") as f:
            f.write(f"{user}:x:{uid}:\n")
        h = rootfs / home.lstrip("/")
        h.mkdir(parents=True, exist_ok=True)
        os.chown(h, int(uid), int(uid))
    for name in ("hostname", "hosts", "resolv.conf"):
        p = rootfs / "etc" / name
        if p.is_symlink():
            p.unlink()
    (rootfs / "etc/hostname").write_text(HOSTNAME + "\n")
    (rootfs / "etc/hosts").write_text(f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n::1\tlocalhost\n")
    (rootfs / "etc/resolv.conf").write_text("".join(f"nameserver {ns}\n" for ns in NAMESERVERS))
    ensure_sudo_shim(rootfs)
    return info


def import_image(images, source: Path, ref: str, progress=None) -> str:
    """Import an OCI layout dir, an OCI archive or a `docker save` tarball as image `ref`.

    Returns the image-store name. Blocking (run it in a thread from async code).
    """
    name = local_name(ref)
    dest = images.images_dir / name
    images.images_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=images.images_dir))
    try:
        if source.is_dir():
            root = source
        else:
            root = work / "archive"
            root.mkdir()
            if progress:
                progress(f"unpacking {source.name}", None)
            with tarfile.open(source, "r:*") as tf:
                for m in tf.getmembers():
                    if m.name.startswith("/") or ".." in Path(m.name).parts or not (m.isfile() or m.isdir()):
                        raise ImageFormatError(f"unexpected entry in the image archive: {m.name}")
                tf.extractall(root)
        if (root / "manifest.json").is_file():
            layers, config = _docker_save(root)
        elif (root / "index.json").is_file():
            layers, config = _oci_layout(root, ref)
        else:
            raise ImageFormatError("not an OCI layout or docker save archive (no index.json / manifest.json)")
        rootfs = work / "image" / "rootfs"
        rootfs.mkdir(parents=True)
        digest = hashlib.sha256()
        for i, layer in enumerate(layers):
            if progress:
                progress(f"applying layer {i + 1}/{len(layers)}", (i + 1) / max(len(layers), 1))
            _apply_layer(layer, rootfs)
            digest.update(layer.name.encode())
        osinfo = _fix_up(rootfs)
        cfg = config.get("config") or {}
        manifest = {"name": name, "ref": normalize_ref(ref), "source": "oci",
                    "digest": "sha256:" + digest.hexdigest(),
                    "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "os": osinfo, "env": cfg.get("Env") or [], "workdir": cfg.get("WorkingDir") or "",
                    "user": cfg.get("User") or "", "cmd": cfg.get("Cmd"), "entrypoint": cfg.get("Entrypoint")}
        (work / "image" / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if dest.exists():
            old = work / "old"
            os.rename(dest, old)
        os.rename(work / "image", dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return name


async def pull(images, ref: str, *, registry: dict | None = None, progress=None) -> str:
    """Pull `ref` from its registry (the `oras` client) into an OCI layout, then import it."""
    try:
        import oras.provider  # noqa: F401
    except ImportError:
        raise BadRequest(f"image {ref!r} is not imported on this node and no registry client is installed; "
                         "import it with `agentenv image import`") from None
    return await asyncio.to_thread(_pull_sync, images, ref, registry, progress)


def _pull_sync(images, ref: str, registry: dict | None, progress) -> str:
    import oras.container
    import oras.provider

    import socket

    full = normalize_ref(ref)
    host, _, rest = full.partition("/")
    if host == "docker.io":
        host = "registry-1.docker.io"
    name, _, port = host.partition(":")
    try:  # fail fast: the client's own retries take minutes against an unreachable host
        socket.create_connection((name, int(port or 443)), timeout=5).close()
    except OSError as e:
        raise BadRequest(f"image {ref!r} is not imported on this node and its registry {host} is not "
                         f"reachable ({e}); import it with `agentenv image import`") from None
    reg = oras.provider.Registry(hostname=host, insecure=False)
    if registry and registry.get("username"):
        reg.set_basic_auth(registry["username"], registry.get("password", ""))
    container = oras.container.Container(f"{host}/{rest}")
    layout = Path(tempfile.mkdtemp(prefix=".pull-", dir=images.images_dir))
    try:
        try:
            manifest = reg.get_manifest(container)
        except Exception as e:  # noqa: BLE001 - network/auth errors of any kind
            raise BadRequest(f"cannot pull {ref!r} from {host}: {e}") from None
        blobs = layout / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        if "manifests" in manifest:  # an index: the linux/amd64 image
            entry = next((m for m in manifest["manifests"] if (m.get("platform") or {}).get("architecture") == "amd64"
                          and (m.get("platform") or {}).get("os") == "linux"), manifest["manifests"][0])
            container = oras.container.Container(f"{host}/{rest.split(':')[0].split('@')[0]}@{entry['digest']}")
            manifest = reg.get_manifest(container)
        raw = json.dumps(manifest).encode()
        mdigest = hashlib.sha256(raw).hexdigest()
        (blobs / mdigest).write_bytes(raw)
        for i, desc in enumerate([manifest["config"], *manifest.get("layers", [])]):
            if progress:
                progress(f"pulling {desc['digest'][:19]}", None)
            reg.download_blob(container, desc["digest"], str(blobs / desc["digest"].split(":", 1)[1]))
        (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": f"sha256:{mdigest}",
             "size": len(raw)}]}))
        (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        return import_image(images, layout, ref, progress)
    finally:
        shutil.rmtree(layout, ignore_errors=True)
