"""envd: the in-sandbox daemon speaking E2B's envd protocol (Connect-RPC JSON + plain HTTP) on port 49983.

It runs as root (PID 1 inside gVisor) from the read-only tools layer, so it may only import the stdlib,
the packages listed in ENVD_REQUIREMENTS, `agentenv.constants` and `agentenv.envd.*`.
"""

# Third-party packages envd imports; the tools-layer builder installs exactly these.
ENVD_REQUIREMENTS = [
    "aiohttp>=3.9,<4",  # HTTP/1.1 server with streaming request and response bodies
    "asyncinotify>=4.0",  # pure-Python (ctypes) inotify binding for WatchDir / watchers
]
