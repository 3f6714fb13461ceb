"""OCI images as template bases: import from a local OCI layout / `docker save` tarball, or a registry.

An imported image becomes an ordinary read-only image under `<data>/images/<name>/rootfs` (layers
applied in order, whiteouts honoured) plus a `manifest.json` carrying the image config (Env,
WorkingDir, User). Fix-ups make any distribution run envd: the tools layer brings its own loader and
libc, so only a mount point, a `user` account, resolver files and the sudo/compat shims are added.
"""

from __future__ import annotations

import hashlib
import re

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


async def pull(images, ref: str, *, registry: dict | None = None, progress=None) -> str:
    raise BadRequest(f"image {ref!r} is not imported on this node and registry pulls are not available; "
                     "import it with `agentenv image import`")
