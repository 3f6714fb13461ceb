"""Tiny HTTP/1.1 keep-alive server run inside test sandboxes.

Never closes a connection first (the client does), so no TIME_WAIT endpoint is left inside the
sandbox to block a checkpoint. Holds an in-memory counter to prove state survives restore.
"""

import json
import socket
import socketserver
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

COUNTER = 0


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        global COUNTER
        url = urlparse(self.path)
        q = parse_qs(url.query)
        if url.path == "/count":
            COUNTER += 1
            body = {"count": COUNTER}
        elif url.path == "/meminfo":
            with open("/proc/meminfo") as f:
                body = {"meminfo": f.read()}
        elif url.path == "/whoami":
            body = {"local": self.connection.getsockname()[0], "hostname": socket.gethostname()}
        elif url.path == "/connect":
            # Outbound probe from inside the sandbox (used by the isolation test).
            s = socket.socket()
            s.settimeout(float(q.get("timeout", ["1"])[0]))
            try:
                s.connect((q["host"][0], int(q["port"][0])))
                body = {"connected": True}
            except OSError as e:
                body = {"connected": False, "error": str(e)}
            finally:
                s.close()
        elif url.path == "/write":
            try:
                with open(q["path"][0], "w") as f:
                    f.write("x")
                body = {"written": True}
            except OSError as e:
                body = {"written": False, "error": str(e)}
        elif url.path == "/burn":
            # CPU-bound children for `seconds` (the CPU weight test): answered at once, they spin on.
            import os
            import time
            pids = []
            for _ in range(int(q.get("procs", ["1"])[0])):
                pid = os.fork()
                if pid == 0:
                    end = time.monotonic() + float(q.get("seconds", ["5"])[0])
                    while time.monotonic() < end:
                        pass
                    os._exit(0)
                pids.append(pid)
            body = {"pids": pids}
        elif url.path == "/file":
            with open(q["path"][0]) as f:
                body = {"content": f.read()}
        else:
            body = {"ok": True}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def server_bind(self):
        # HTTPServer.server_bind() does a reverse DNS lookup (getfqdn), which stalls for the
        # resolver timeout in a sandbox without internet access.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = "sandbox", self.server_address[1]


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 49983
    Server(("0.0.0.0", port), Handler).serve_forever()
