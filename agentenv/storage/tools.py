"""The tools layer: a self-contained Python + envd tree mounted read-only at TOOLS_MOUNT in every sandbox.

Why self-contained: envd must run whatever the user did to their rootfs (deleted python3, an
Alpine template, another glibc). So the layer carries Debian's CPython, its stdlib, every shared
library they need *including the dynamic loader*, envd's wheels and the `agentenv` subset envd imports.
envd is started through the layer's own loader:

    /.agentenv/lib/ld-linux-x86-64.so.2 --library-path /.agentenv/lib /.agentenv/bin/python3 -I -u -m agentenv.envd

`--library-path` also covers dlopen() of extension modules but is not inherited by envd's children,
and `-I` ignores PYTHON* variables, so nothing has to be put into envd's environment that could leak
into user processes. CPython's getpath finds the stdlib from the executable's location
(`<prefix>/bin/python3` -> landmark `<prefix>/lib/python3.X/os.py`), so sys.prefix == TOOLS_MOUNT, and
Debian's site.py adds `<prefix>/lib/python3/dist-packages`, where the wheels and `agentenv` go.

Layout of `<data_dir>/images/tools/<hash>/`:
    bin/python3                      Debian's interpreter (from the base image)
    lib/ld-linux-x86-64.so.2, lib/*.so*   loader + shared libraries, flat
    lib/python3.X/                   stdlib (+ lib-dynload), minus tests/GUI
    lib/python3/dist-packages/       ENVD_REQUIREMENTS wheels + agentenv/{__init__,constants}.py + agentenv/envd/
    tools.json                       hash, python version, installed requirements, created
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import agentenv
from agentenv import constants
from agentenv.storage._util import CommandError, file_lock, run

if TYPE_CHECKING:
    from agentenv.storage.images import ImageStore, ProgressFn

DEFAULT_REQUIREMENTS = ["aiohttp"]
SITE_DIR = "lib/python3/dist-packages"
LOADERS = {"x86_64": "ld-linux-x86-64.so.2", "aarch64": "ld-linux-aarch64.so.1"}
# Loaded with dlopen() by glibc itself (thread cancellation/unwinding), so never in DT_NEEDED.
EXTRA_LIBS = ["libgcc_s.so.1"]
STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "dist-packages",
               "sitecustomize.py", "EXTERNALLY-MANAGED", "__phello__"}
DYNLOAD_SKIP = re.compile(r"^(_test|xxlimited|_xxtestfuzz|_ctypes_test|_tkinter)")
PIP_TIMEOUT = 15 * 60
CMD_TIMEOUT = 120


def loader_name() -> str:
    try:
        return LOADERS[platform.machine()]
    except KeyError:
        raise RuntimeError(f"no tools layer support for architecture {platform.machine()}") from None


def envd_argv() -> list[str]:
    m = constants.TOOLS_MOUNT
    return [f"{m}/lib/{loader_name()}", "--library-path", f"{m}/lib", f"{m}/bin/python3",
            "-I", "-u", "-m", "agentenv.envd"]


def envd_env() -> dict[str, str]:
    # -I makes CPython ignore PYTHON*; the loader flag replaces LD_LIBRARY_PATH. Only neutral vars here.
    return {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


def host_argv(tools_dir: Path) -> list[str]:
    """The same command for running the layer's interpreter on the host (build checks, tests)."""
    return [str(tools_dir / "lib" / loader_name()), "--library-path", str(tools_dir / "lib"),
            str(tools_dir / "bin/python3"), "-I"]


def envd_requirements() -> list[str]:
    """ENVD_REQUIREMENTS from agentenv/envd/__init__.py, read without importing envd."""
    init = Path(agentenv.__file__).parent / "envd" / "__init__.py"
    try:
        tree = ast.parse(init.read_text())
    except OSError:
        return list(DEFAULT_REQUIREMENTS)
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "ENVD_REQUIREMENTS" for t in targets) and node.value:
                return [str(r) for r in ast.literal_eval(node.value)]
    return list(DEFAULT_REQUIREMENTS)


def _agentenv_sources() -> list[tuple[str, Path]]:
    """(path inside the package, file) for the agentenv subset envd may import."""
    pkg = Path(agentenv.__file__).parent
    files = [("agentenv/__init__.py", pkg / "__init__.py"), ("agentenv/constants.py", pkg / "constants.py")]
    envd = pkg / "envd"
    if envd.is_dir():
        for f in sorted(envd.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".pyc", ".pyo"):
                files.append((f"agentenv/envd/{f.relative_to(envd).as_posix()}", f))
    return files


_hash_cache: dict[tuple, str] = {}


def layer_hash(base_rootfs: Path, python_bin: Path) -> str:
    """Identity of a tools layer: envd sources + requirements + interpreter + this builder.

    Memoised on the files' (path, size, mtime) so the per-sandbox call is a few stat()s.
    """
    files = [f for _, f in _agentenv_sources()] + [python_bin, Path(__file__)]
    key = tuple((str(f), st.st_size, st.st_mtime_ns) for f in files for st in [f.stat()])
    if key not in _hash_cache:
        _hash_cache.clear()
        _hash_cache[key] = _compute_hash(python_bin)
    return _hash_cache[key]


def _compute_hash(python_bin: Path) -> str:
    h = hashlib.sha256()
    for rel, f in _agentenv_sources():
        h.update(rel.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(json.dumps(envd_requirements()).encode())
    h.update(hashlib.sha256(python_bin.read_bytes()).digest())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()[:16]


def _base_python(base_rootfs: Path) -> Path:
    """The versioned interpreter binary of the base image (python3 -> python3.X)."""
    link = base_rootfs / "usr/bin/python3"
    target = os.readlink(link) if link.is_symlink() else "python3"
    p = base_rootfs / "usr/bin" / os.path.basename(target)
    if not p.is_file():
        raise RuntimeError(f"base image has no python3 interpreter at {p}")
    return p


async def ensure_tools(store: "ImageStore", progress: "ProgressFn | None" = None) -> Path:
    base = await store.ensure_base(progress)
    python_bin = _base_python(base)
    tools_root = store.images_dir / "tools"
    digest = await asyncio.to_thread(layer_hash, base, python_bin)
    target = tools_root / digest
    if (target / "tools.json").is_file():
        return target
    tools_root.mkdir(parents=True, exist_ok=True)
    async with file_lock(store.images_dir / ".tools.lock"):
        if not (target / "tools.json").is_file():
            for stale in tools_root.glob(".tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            if target.exists():
                shutil.rmtree(target)
            tmp = tools_root / f".tmp-{uuid.uuid4().hex[:8]}"
            logfile = store.images_dir / "tools.log"
            logfile.write_text(f"# tools layer {digest} build started {datetime.now(timezone.utc).isoformat()}\n")
            try:
                await _build(tmp, base, python_bin, digest, logfile, progress)
                os.rename(tmp, target)
            except BaseException as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                if isinstance(exc, (CommandError, RuntimeError, OSError)):
                    from agentenv.storage.images import ImageBuildError

                    raise ImageBuildError(f"building the tools layer failed: {exc} (log: {logfile})") from exc
                raise
        await asyncio.to_thread(_prune_old, tools_root, keep=digest)
    if progress:
        progress("tools layer ready", 1.0)
    return target


async def _build(tmp: Path, base: Path, python_bin: Path, digest: str, logfile: Path,
                 progress: "ProgressFn | None") -> None:
    def step(msg: str, frac: float) -> None:
        if progress:
            progress(f"tools layer: {msg}", frac)

    (tmp / "bin").mkdir(parents=True)
    lib = tmp / "lib"
    lib.mkdir()
    pyver = python_bin.name.removeprefix("python")  # "3.11"
    stdlib_src = base / "usr/lib" / f"python{pyver}"
    stdlib_dst = lib / f"python{pyver}"

    step("copying interpreter and stdlib", 0.1)
    shutil.copy2(python_bin, tmp / "bin/python3")
    await asyncio.to_thread(_copy_stdlib, stdlib_src, stdlib_dst)

    step("collecting shared libraries", 0.3)
    elves = [f"/usr/bin/{python_bin.name}"] + [
        "/" + p.relative_to(base).as_posix() for p in sorted((stdlib_src / "lib-dynload").glob("*.so"))
        if not DYNLOAD_SKIP.match(p.name)
    ]
    await _copy_libs(base, elves, lib, logfile)

    step("installing envd requirements", 0.5)
    site = tmp / SITE_DIR
    site.mkdir(parents=True)
    info = json.loads(await run(host_argv(tmp) + ["-c", _PROBE], timeout=CMD_TIMEOUT))
    reqs = envd_requirements()
    with tempfile.NamedTemporaryFile("w", suffix=".txt", dir=tmp, delete=False) as rf:
        rf.write("\n".join(reqs) + "\n")
    platforms = _manylinux_tags(info["libc"], info["machine"])
    await run(
        [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--no-compile",
         "--target", str(site), "--only-binary=:all:", "--implementation", "cp",
         "--python-version", info["version"], "--abi", f"cp{info['version'].replace('.', '')}",
         *(a for tag in platforms for a in ("--platform", tag)), "-r", rf.name],
        timeout=PIP_TIMEOUT, log=logfile,
    )
    os.unlink(rf.name)
    shutil.rmtree(site / "bin", ignore_errors=True)  # console scripts point at the host's python

    step("copying envd", 0.8)
    for rel, src in _agentenv_sources():
        dst = site / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)

    step("byte-compiling and checking", 0.9)
    # The layer is read-only in sandboxes: compile now, with paths as seen inside (/.agentenv/...).
    await run(host_argv(tmp) + ["-m", "compileall", "-q", "-j", "0", "-s", str(tmp), "-p", constants.TOOLS_MOUNT,
                                str(site)], timeout=CMD_TIMEOUT * 5, log=logfile)
    check = json.loads(await run(host_argv(tmp) + ["-c", _CHECK], timeout=CMD_TIMEOUT))
    if os.path.realpath(check["prefix"]) != os.path.realpath(tmp):
        raise RuntimeError(f"tools interpreter picked prefix {check['prefix']}, expected {tmp}")
    installed = check["dists"]
    manifest = {
        "hash": digest, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": info["full_version"], "glibc": info["libc"], "requirements": reqs, "installed": installed,
        "envd_argv": envd_argv(),
    }
    (tmp / "tools.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for p in [tmp, *tmp.rglob("*")]:  # world-readable: envd may drop privileges
        if not p.is_symlink():
            p.chmod(p.stat().st_mode | 0o444 | (0o111 if p.is_dir() else 0))


def _manylinux_tags(glibc: str, machine: str) -> list[str]:
    """Every manylinux tag the layer's glibc satisfies, newest first (pip does not expand them itself)."""
    major, minor = (int(x) for x in glibc.split(".")[:2])
    tags = [f"manylinux_{major}_{m}_{machine}" for m in range(minor, 4, -1)]
    return tags + [f"manylinux2014_{machine}", f"manylinux2010_{machine}", f"manylinux1_{machine}"]


_PROBE = """
import json, platform, sys
print(json.dumps({"version": "%d.%d" % sys.version_info[:2], "full_version": sys.version.split()[0],
                  "libc": platform.libc_ver()[1], "machine": platform.machine()}))
"""

_CHECK = """
import json, sys, ssl, ctypes, importlib.metadata as md
print(json.dumps({"prefix": sys.prefix, "path": sys.path,
                  "dists": sorted(f"{d.metadata['Name']}=={d.version}" for d in md.distributions())}))
"""


def _copy_stdlib(src: Path, dst: Path) -> None:
    def ignore(directory: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n in STDLIB_SKIP} if directory == str(src) else set()
        if directory.endswith("lib-dynload"):
            skip |= {n for n in names if DYNLOAD_SKIP.match(n)}
        return skip

    shutil.copytree(src, dst, symlinks=True, ignore=ignore)
    for p in dst.rglob("*"):
        if p.is_symlink() and os.path.isabs(os.readlink(p)):
            p.unlink()  # absolute links would resolve in the user's rootfs inside the sandbox


async def _copy_libs(base: Path, elves: list[str], lib: Path, logfile: Path) -> None:
    """Ask the base image's own loader (in a chroot) what each ELF needs; copy those files flat."""
    loader = "/lib64/" + loader_name() if platform.machine() == "x86_64" else "/lib/" + loader_name()
    needed: dict[str, str] = {}  # soname -> path inside base
    for i in range(0, len(elves), 1):
        out = await run(["chroot", str(base), loader, "--list", elves[i]], timeout=CMD_TIMEOUT)
        for line in out.splitlines():
            m = re.match(r"\s*(\S+) => (/\S+) \(", line)
            if m:
                needed[m.group(1)] = m.group(2)
            elif "not found" in line:
                raise RuntimeError(f"{elves[i]} in the base image needs a missing library: {line.strip()}")
    needed[loader_name()] = loader
    for extra in EXTRA_LIBS:
        for d in ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib", "usr/lib"):
            if (base / d / extra).exists():
                needed[extra] = f"/{d}/{extra}"
                break
    for soname, path in sorted(needed.items()):
        real = _resolve_in(base, path)
        shutil.copy2(real, lib / soname)
    with open(logfile, "a") as f:
        f.write("# libraries: " + " ".join(sorted(needed)) + "\n")


def _resolve_in(root: Path, path: str) -> Path:
    """Resolve symlinks of `path` as if `root` were /, never escaping it."""
    cur = root / path.lstrip("/")
    for _ in range(40):
        if not cur.is_symlink():
            return cur
        target = os.readlink(cur)
        cur = (root / target.lstrip("/")) if os.path.isabs(target) else (cur.parent / target)
        cur = Path(os.path.normpath(cur))
        if not str(cur).startswith(str(root)):
            raise RuntimeError(f"symlink {path} escapes the image")
    raise RuntimeError(f"too many symlinks resolving {path}")


def _in_use(d: Path) -> bool:
    """True if any process holds the dir as a mount, root, cwd or open file (e.g. a runsc gofer)."""
    needle = str(d)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        base = f"/proc/{pid}"
        try:
            for link in ("root", "cwd"):
                if os.readlink(f"{base}/{link}").startswith(needle):
                    return True
            for fd in os.listdir(f"{base}/fd"):
                try:
                    if os.readlink(f"{base}/fd/{fd}").startswith(needle):
                        return True
                except OSError:
                    continue
            with open(f"{base}/mountinfo", errors="replace") as f:
                if f"tools/{d.name}" in f.read():
                    return True
        except OSError:
            continue
    return False


def _prune_old(tools_root: Path, keep: str) -> None:
    """Keep the newest layer; delete older ones nothing uses any more."""
    for d in tools_root.iterdir():
        if d.name == keep or d.name.startswith(".") or not d.is_dir():
            continue
        if not _in_use(d):
            shutil.rmtree(d, ignore_errors=True)
