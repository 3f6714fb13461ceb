"""Build recipe of the ready-made `code-interpreter` template (aliases `code-interpreter-v1`, the
e2b-code-interpreter SDK's default template, and `code-interpreter`).

Sandboxes cannot reach the host's package indexes, so the host's pip downloads the wheels of
ipykernel + jupyter_client (for the base image's Python 3.11) and the build COPYs them in and
installs them with `pip --no-index` into /opt/agentenv-ci/venv. The server (server.py) is the
last COPY, so changing it rebuilds only the steps after the (cached) pip install.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import sys
import tarfile
from importlib import resources
from pathlib import Path

NAME = "code-interpreter-v1"
ALIASES = ["code-interpreter-v1", "code-interpreter"]
PACKAGES = ["ipykernel", "jupyter_client"]
PYTHON_VERSION = "3.11"  # the base image's python3 (Debian bookworm)
PREFIX = "/opt/agentenv-ci"
READY_FILE = "/home/user/.agentenv-ci/ready"


def wheelhouse(settings) -> Path:
    return Path(settings.code_interpreter_wheels or settings.data_dir / "wheelhouse" / "code-interpreter")


async def ensure_wheels(settings, log) -> Path:
    d = wheelhouse(settings)
    if any(d.glob("ipykernel-*.whl")) and any(d.glob("jupyter_client-*.whl")):
        return d
    if settings.code_interpreter_wheels:
        raise FileNotFoundError(f"no ipykernel/jupyter_client wheels in {d}")
    d.mkdir(parents=True, exist_ok=True)
    log(f"downloading wheels of {', '.join(PACKAGES)} for Python {PYTHON_VERSION} with the host's pip")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--only-binary=:all:",
        "--python-version", PYTHON_VERSION, "--dest", str(d), *PACKAGES,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"pip download failed: {out.decode(errors='replace')[-600:]}")
    return d


def _tar(entries: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        dirs = sorted({str(Path(n).parent) for n, _ in entries if str(Path(n).parent) != "."})
        for dname in dirs:
            ti = tarfile.TarInfo(dname)
            ti.type, ti.mode = tarfile.DIRTYPE, 0o755
            tf.addfile(ti)
        for name, data in sorted(entries):
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode = len(data), 0o644
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def recipe(wheels: Path) -> tuple[dict, dict[str, bytes]]:
    """(build spec, {files hash: tar bytes}) of the template."""
    server = resources.files("agentenv.templates.code_interpreter").joinpath("server.py").read_bytes()
    wheel_tar = _tar([(f"wheels/{p.name}", p.read_bytes()) for p in sorted(wheels.glob("*.whl"))])
    server_tar = _tar([("server.py", server)])
    h_wheels, h_server = hashlib.sha256(wheel_tar).hexdigest(), hashlib.sha256(server_tar).hexdigest()
    install = (f"python3 -m venv {PREFIX}/venv && {PREFIX}/venv/bin/pip install -q --no-index "
               f"--find-links {PREFIX}/wheels {' '.join(PACKAGES)} && rm -rf {PREFIX}/wheels")
    spec = {
        "fromImage": "base",
        "steps": [
            {"type": "COPY", "args": ["wheels", f"{PREFIX}/wheels", "root", ""], "filesHash": h_wheels},
            {"type": "RUN", "args": [install, "root"]},
            {"type": "COPY", "args": ["server.py", f"{PREFIX}/server.py", "root", "0644"], "filesHash": h_server},
            {"type": "ENV", "args": ["CODE_INTERPRETER_READY_FILE", READY_FILE]},
        ],
        "startCmd": f"{PREFIX}/venv/bin/python {PREFIX}/server.py",
        "readyCmd": f"test -f {READY_FILE}",
    }
    spec["recipe"] = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
    return spec, {h_wheels: wheel_tar, h_server: server_tar}
