"""The npm files the web console serves at /console/lib/<name>: a fixed list, never a path from a request.

Kept free of imports so the wheel build (`setup.py`) can read it without the package's dependencies:
the build copies each `dist` file (and its package's LICENSE) into `agentenv/console/lib/` of the
wheel, so an installed wheel serves the console without npm.
"""

# served name -> path under node_modules
LIBRARIES: dict[str, str] = {
    "uplot.js": "uplot/dist/uPlot.iife.min.js",
    "uplot.css": "uplot/dist/uPlot.min.css",
    "cytoscape.js": "cytoscape/dist/cytoscape.min.js",
    "cytoscape-dagre.js": "cytoscape-dagre/dist/cytoscape-dagre.min.js",
}
# Directory of the copies inside an installed wheel (relative to agentenv/console).
VENDORED_DIR = "lib"
