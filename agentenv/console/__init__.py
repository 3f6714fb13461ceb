"""The read-only web console, served by the server at `/console`.

Plain HTML + one script, no build chain: the page asks for an API key (kept in the browser's
localStorage) and reads everything from the JSON API with `X-API-Key`, so it can show nothing the
key could not read anyway. Libraries come from npm (`package.json` next to this file, installed by
`scripts/setup.sh` with `npm ci`) and are served straight from their `dist` files:
uPlot (time-series charts) and Cytoscape.js with the dagre layout (the lineage tree).
"""

from __future__ import annotations

import os
from pathlib import Path

from aiohttp import web

HERE = Path(__file__).resolve().parent
STATIC = HERE / "static"
# What the page loads from /console/lib/<name>: a fixed list, never a path from the request.
LIBRARIES = {
    "uplot.js": "uplot/dist/uPlot.iife.min.js",
    "uplot.css": "uplot/dist/uPlot.min.css",
    "cytoscape.js": "cytoscape/dist/cytoscape.min.js",
    "cytoscape-dagre.js": "cytoscape-dagre/dist/cytoscape-dagre.min.js",
}
_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".svg": "image/svg+xml"}


def node_modules() -> Path:
    return Path(os.environ.get("AGENTENV_CONSOLE_NODE_MODULES") or HERE / "node_modules")


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
        rel = LIBRARIES.get(request.match_info["name"])
        if rel is None:
            raise web.HTTPNotFound()
        return _file(node_modules() / rel)

    app.router.add_get(prefix, index)
    app.router.add_get(prefix + "/", index)
    app.router.add_get(prefix + "/static/{name}", static)
    app.router.add_get(prefix + "/lib/{name}", lib)
