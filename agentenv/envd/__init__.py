"""envd: the in-sandbox daemon speaking E2B's envd protocol (Connect-RPC JSON + plain HTTP) on port 49983.

Started inside each sandbox as root (PID 1) by the tools layer's interpreter::

    python -m agentenv.envd [--host 0.0.0.0] [--port 49983] [--subreaper] [--log-level INFO]

Environment read at start:
  AGENTENV_ENVD_HOST_TOKEN  lets the host re-`/init` (e.g. restored fork children) without the current token
  AGENTENV_ENVD_MAX_UPLOAD  upload limit in bytes for POST /files (413 above it); unset = unlimited

Because it runs from the read-only tools layer, envd imports only the stdlib, ENVD_REQUIREMENTS,
`agentenv.constants` and `agentenv.envd.*` (tests/envd/test_imports.py enforces this). It never closes a
TCP connection first (gVisor refuses to checkpoint with TIME_WAIT endpoints): see `agentenv.envd.server`.
"""

# Third-party packages envd imports; the tools-layer builder installs exactly these (plus their deps).
ENVD_REQUIREMENTS = [
    "aiohttp>=3.9,<4",  # HTTP/1.1 server with streaming request and response bodies
    "asyncinotify>=4.0",  # pure-Python (ctypes) inotify binding for WatchDir / watchers
]
