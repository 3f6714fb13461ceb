"""A user's web app, run *inside* a sandbox by the proxy tests (standard library only).

Uploaded as a file and started with the sandbox's own `python3`. A threading HTTP/1.1 server
(poll-based, so gVisor can checkpoint it: see docs/limitations.md) with keep-alive and:

  GET  /hello                 JSON: pid, a per-process request counter, the client's address, the headers
  POST /upload                streams the body (chunked or Content-Length) into sha256; JSON size+hash
  GET  /download?size=N       N bytes of `pattern()` with Content-Length, written 1 MiB at a time
  POST /echo                  chunked response: every request chunk is echoed back as soon as it is read
  GET  /sse?n=N&key=K         text/event-stream; event i+1 is sent only after GET /ack?key=K&i=i
  GET  /ack?key=K&i=I         releases the next event of /sse stream K
  GET  /ws                    WebSocket echo (text and binary), answers pings, echoes the close code
"""

import base64
import hashlib
import json
import os
import struct
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

MIB = 1 << 20
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_lock = threading.Lock()
_count = 0
_acks: dict = {}


def pattern(size):
    """Deterministic, non-repeating data in 1 MiB blocks (the tests compute the same)."""
    block, i = 0, 0
    while i < size:
        seed = hashlib.sha256(block.to_bytes(8, "big")).digest()
        chunk = (seed * (MIB // len(seed)))[: min(MIB, size - i)]
        yield chunk
        i += len(chunk)
        block += 1


def ack_event(key, i):
    with _lock:
        ev = _acks.setdefault((key, i), threading.Event())
    return ev


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    # -------------------------------------------------------------- helpers

    def body_chunks(self):
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return
                left = size
                while left:
                    data = self.rfile.read(min(left, MIB))
                    if not data:
                        raise EOFError("body ended early")
                    left -= len(data)
                    yield data
                self.rfile.readline()
        else:
            left = int(self.headers.get("Content-Length") or 0)
            while left:
                data = self.rfile.read(min(left, MIB))
                if not data:
                    raise EOFError("body ended early")
                left -= len(data)
                yield data

    def send_json(self, obj, status=200):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    # -------------------------------------------------------------- routes

    def do_GET(self):
        global _count
        url = urlsplit(self.path)
        q = {k: v[0] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        if url.path == "/hello":
            with _lock:
                _count += 1
                n = _count
            self.send_json({"pid": os.getpid(), "count": n, "path": self.path, "peer": list(self.client_address),
                            "headers": [[k, v] for k, v in self.headers.items()]})
        elif url.path == "/download":
            size = int(q["size"])
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.end_headers()
            for c in pattern(size):
                self.wfile.write(c)
        elif url.path == "/sse":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(int(q["n"])):
                if i and not ack_event(q["key"], i - 1).wait(60):
                    break
                self.chunk(f"id: {i}\nevent: tick\ndata: {{\"i\": {i}}}\n\n".encode())
            self.chunk(b"")
        elif url.path == "/ack":
            ack_event(q["key"], int(q["i"])).set()
            self.send_json({"ok": True})
        elif url.path == "/ws":
            self.websocket()
        else:
            self.send_json({"error": "no such path"}, 404)

    def do_POST(self):
        url = urlsplit(self.path)
        if url.path == "/upload":
            h, size = hashlib.sha256(), 0
            for data in self.body_chunks():
                h.update(data)
                size += len(data)
            self.send_json({"size": size, "sha256": h.hexdigest(),
                            "transfer_encoding": self.headers.get("Transfer-Encoding")})
        elif url.path == "/echo":
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for data in self.body_chunks():
                self.chunk(data)
            self.chunk(b"")
        else:
            self.send_json({"error": "no such path"}, 404)

    # -------------------------------------------------------------- WebSocket (RFC 6455)

    def websocket(self):
        key = self.headers.get("Sec-WebSocket-Key", "")
        accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True
        while True:
            head = self.rfile.read(2)
            if len(head) < 2:
                return
            opcode, n = head[0] & 0x0F, head[1] & 0x7F
            if n == 126:
                n = struct.unpack(">H", self.rfile.read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self.rfile.read(8))[0]
            mask = self.rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
            data = bytearray(self.rfile.read(n))
            for i in range(len(data)):
                data[i] ^= mask[i % 4]
            if opcode == 0x9:  # ping -> pong
                self.ws_send(0xA, bytes(data))
            elif opcode == 0x8:  # close: echo it and end
                self.ws_send(0x8, bytes(data))
                return
            elif opcode in (0x1, 0x2):
                self.ws_send(opcode, bytes(data) if opcode == 0x2 else b"echo:" + bytes(data))

    def ws_send(self, opcode, payload):
        n = len(payload)
        if n < 126:
            head = struct.pack(">BB", 0x80 | opcode, n)
        elif n < 1 << 16:
            head = struct.pack(">BBH", 0x80 | opcode, 126, n)
        else:
            head = struct.pack(">BBQ", 0x80 | opcode, 127, n)
        self.wfile.write(head + payload)
        self.wfile.flush()


if __name__ == "__main__":
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Handler).serve_forever()
