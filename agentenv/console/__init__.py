"""The read-only web console, served by the server at `/console`.

Plain HTML + one script, no build chain: the page asks for an API key (kept in the browser's
localStorage) and reads everything from the JSON API with `X-API-Key`, so it can show nothing the
key could not read anyway. Libraries come from npm (`package.json` next to this file) and are served
straight from their `dist` files: uPlot (time-series charts) and Cytoscape.js with the dagre layout
(the lineage tree). In a source checkout `scripts/setup.sh` installs them with `npm ci`; a wheel
carries copies made at build time (`setup.py`) in `agentenv/console/lib/`, so no npm runs at install.
"""

from __future__ import annotations

import os
from pathlib import Path

from aiohttp import web

from .libraries import LIBRARIES, VENDORED_DIR

HERE = Path(__file__).resolve().parent
STATIC = HERE / "static"
_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".svg": "image/svg+xml"}


def node_modules() -> Path:
    return Path(os.environ.get("AGENTENV_CONSOLE_NODE_MODULES") or HERE / "node_modules")


def library_file(name: str) -> Path | None:
    """The file served as /console/lib/<name>: the wheel's copy unless AGENTENV_CONSOLE_NODE_MODULES
    points elsewhere, else node_modules (a source checkout); None for a name not in LIBRARIES."""
    rel = LIBRARIES.get(name)
    if rel is None:
        return None
    vendored = HERE / VENDORED_DIR / name
    if not os.environ.get("AGENTENV_CONSOLE_NODE_MODULES") and vendored.is_file():
        return vendored
    return node_modules() / rel


def _file(path: Path) -> web.StreamResponse:
    if not path.is_file():
        return web.json_response({"code": 404, "message": f"{path.name} is missing: run scripts/setup.sh "
                                  "(npm ci in agentenv/console)"}, status=404)
    return web.FileResponse(path, headers={"Content-Type": _TYPES.get(path.suffix, "application/octet-stream"),
                                           "Cache-Control": "no-cache"})


def mount_console(app: web.Application, prefix: str = "/console") -> None:
    async def index(request: web.Request) -> web.StreamResponse:
        if request.path == prefix:
            raise web.HTTPFound(prefix + "/")
        return _file(STATIC / "index.html")

    async def static(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in {"console.js", "console.css"}:
            raise web.HTTPNotFound()
        return _file(STATIC / name)

    async def lib(request: web.Request) -> web.StreamResponse:
        path = library_file(request.match_info["name"])
        if path is None:
            raise web.HTTPNotFound()
        return _file(path)

    app.router.add_get(prefix, index)
    app.router.add_get(prefix + "/", index)
    app.router.add_get(prefix + "/static/{name}", static)
    app.router.add_get(prefix + "/lib/{name}", lib)
