"""Wheel build step: put the web console's npm libraries into the wheel (metadata is in pyproject.toml).

`build_py` copies each file of `agentenv/console/libraries.py` from `agentenv/console/node_modules`
(plus each npm package's LICENSE) to `agentenv/console/lib/` in the build tree, running `npm ci`
there first when node_modules lacks them, so `pip install agentenv-*.whl` needs no npm.
AGENTENV_CONSOLE_NODE_MODULES names another node_modules to copy from.
"""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CONSOLE = ROOT / "agentenv" / "console"


def _libraries() -> tuple[dict[str, str], str]:
    ns = runpy.run_path(str(CONSOLE / "libraries.py"))
    return ns["LIBRARIES"], ns["VENDORED_DIR"]


def _node_modules(libraries: dict[str, str]) -> Path:
    env = os.environ.get("AGENTENV_CONSOLE_NODE_MODULES")
    nm = Path(env) if env else CONSOLE / "node_modules"
    if all((nm / rel).is_file() for rel in libraries.values()):
        return nm
    if env:
        raise SystemExit(f"AGENTENV_CONSOLE_NODE_MODULES={env} lacks the console's libraries")
    npm = shutil.which("npm")
    if npm is None:
        raise SystemExit("building the wheel needs the console's npm libraries: install npm "
                         "(or run scripts/setup.sh) so `npm ci` can run in agentenv/console")
    subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=CONSOLE, check=True)
    return nm


class BuildPyWithConsole(build_py):
    def finalize_options(self) -> None:
        super().finalize_options()
        self.force = True   # copy every module: a stale build/lib (mtimes from another clock) must not win

    def run(self) -> None:
        super().run()
        libraries, vendored = _libraries()
        nm = _node_modules(libraries)
        out = Path(self.build_lib) / "agentenv" / "console" / vendored
        out.mkdir(parents=True, exist_ok=True)
        for name, rel in libraries.items():
            shutil.copyfile(nm / rel, out / name)
        for package in sorted({rel.split("/", 1)[0] for rel in libraries.values()}):
            lic = nm / package / "LICENSE"
            if lic.is_file():
                shutil.copyfile(lic, out / f"LICENSE.{package}")


setup(cmdclass={"build_py": BuildPyWithConsole})
