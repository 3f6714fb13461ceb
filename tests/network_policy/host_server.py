"""A stand-in internet host, run inside a test network namespace (not collected by pytest).

    python3 host_server.py CERT KEY ADDR [ADDR ...]

Serves on every ADDR: HTTP on port 80 and HTTPS (the given self-signed cert) on port 443.
`/bytes/<n>` answers n zero bytes; every other path one JSON line {"server": <addr it was reached
at>, "host": <Host header>, "tls": bool, "sni": <server name the client sent, or null>}. The server
closes the connection after the response.
"""

from __future__ import annotations

import http.server
import json
import socketserver
import ssl
import sys
import threading


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.startswith("/bytes/"):  # /bytes/<n>: n zero bytes (throughput benchmarks)
            n = int(self.path.split("/")[2])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            chunk = bytes(65536)
            while n > 0:
                self.wfile.write(chunk[:min(n, len(chunk))])
                n -= len(chunk)
            return
        tls = isinstance(self.connection, ssl.SSLSocket)
        body = json.dumps({"server": self.connection.getsockname()[0], "host": self.headers.get("Host"),
                           "tls": tls, "sni": getattr(self.connection, "sni", None)}).encode() + b"\n"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def server_bind(self) -> None:
        # HTTPServer's own looks its address up in DNS (socket.getfqdn): the test host's namespace has
        # no resolver, and each of the six binds waited ~10 s for the lookup to time out.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


def main() -> None:
    cert, key, *addrs = sys.argv[1:]
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)

    def remember_sni(sock, name, _ctx) -> None:
        sock.sni = name

    ctx.sni_callback = remember_sni
    servers = []
    for addr in addrs:
        servers.append(Server((addr, 80), Handler))
        tls = Server((addr, 443), Handler)
        tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
        servers.append(tls)
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
