"""Code-interpreter server inside a sandbox: the HTTP protocol of the e2b-code-interpreter SDK on
port 49999, backed by Jupyter kernels (jupyter_client + ipykernel).

  POST /execute                 {code, context_id?, language?, env_vars?} -> NDJSON stream
  POST /contexts                {language?, cwd?} -> {id, language, cwd}
  GET  /contexts                -> [{id, language, cwd}]
  DELETE /contexts/{id}         -> 200
  POST /contexts/{id}/restart   -> 200
  GET  /health                  -> 200

Written for gVisor checkpoints (the template is a memory snapshot with this server and its default
kernel running): the HTTP server is the standard library's threading server, which waits with
poll(2) rather than epoll, and kernels talk ZeroMQ over Unix sockets (`ipc` transport), never TCP.
Responses are HTTP/1.1 with chunked bodies and keep-alive, so the client closes connections first
and no TIME_WAIT endpoint is left inside the sandbox.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
import traceback
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

RUNTIME_DIR = os.environ.get("CODE_INTERPRETER_RUNTIME_DIR", "/home/user/.agentenv-ci")
KERNEL_NAME = "agentenv-python3"


def run_kernel() -> None:
    """`server.py --kernel -f <connection file>`: ipykernel without its TCP listener.

    ipykernel always binds a ZeroMQ socket on tcp://127.0.0.1 (output of forked child processes);
    a listening TCP socket watched by epoll makes a gVisor checkpoint fail. Without that pipe,
    output printed by forked children (multiprocessing) is not relayed; everything else is.
    """
    from ipykernel import iostream, kernelapp

    init = iostream.IOPubThread.__init__

    def no_pipe(self, socket, pipe=False, session=False):
        init(self, socket, pipe=False, session=session)

    iostream.IOPubThread.__init__ = no_pipe
    sys.argv = [sys.argv[0]] + sys.argv[2:]
    kernelapp.launch_new_instance()


def install_kernelspec() -> None:
    d = os.path.join(RUNTIME_DIR, "kernels", KERNEL_NAME)
    os.makedirs(d, exist_ok=True)
    spec = {"argv": [sys.executable, os.path.abspath(__file__), "--kernel", "-f", "{connection_file}"],
            "display_name": "Python 3", "language": "python"}
    with open(os.path.join(d, "kernel.json"), "w") as f:
        json.dump(spec, f)
    os.environ["JUPYTER_PATH"] = RUNTIME_DIR


if __name__ == "__main__" and sys.argv[1:2] == ["--kernel"]:
    run_kernel()
    sys.exit(0)

install_kernelspec()
from jupyter_client.manager import KernelManager  # noqa: E402 - after JUPYTER_PATH is set

PORT = int(os.environ.get("CODE_INTERPRETER_PORT", "49999"))
DEFAULT_CWD = os.environ.get("CODE_INTERPRETER_CWD", "/home/user")
READY_FILE = os.environ.get("CODE_INTERPRETER_READY_FILE", "")
KEEPALIVE_S = 5.0
LANGUAGES = {"python": KERNEL_NAME}
MIME_KEYS = {
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
    "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
    "application/json": "json", "application/javascript": "javascript",
}


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class Context:
    """One kernel; executions on it run one at a time."""

    def __init__(self, language: str, cwd: str) -> None:
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.lock = threading.Lock()
        os.makedirs(RUNTIME_DIR, exist_ok=True)
        self.km = KernelManager(kernel_name=LANGUAGES[language], transport="ipc",
                                ip=os.path.join(RUNTIME_DIR, f"k-{self.id[:8]}"))
        self.km.start_kernel(cwd=cwd, env={**os.environ, "PYDEVD_DISABLE_FILE_VALIDATION": "1"})
        self.kc = self.km.blocking_client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def info(self) -> dict:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def restart(self) -> None:
        with self.lock:
            self.km.restart_kernel(now=True)
            self.kc.stop_channels()
            self.kc = self.km.blocking_client()
            self.kc.start_channels()
            self.kc.wait_for_ready(timeout=60)

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)

    def _silent(self, code: str) -> None:
        msg_id = self.kc.execute(code, silent=True, store_history=False)
        self._drain(msg_id, None)

    def _drain(self, msg_id: str, emit) -> None:
        """Forward iopub messages of `msg_id` to `emit` until the kernel goes idle."""
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=KEEPALIVE_S)
            except queue.Empty:
                if emit is not None:
                    emit({"type": "keepalive"})
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content.get("execution_state") == "idle":
                return
            if emit is None:
                continue
            if kind == "execute_input":
                emit({"type": "number_of_executions", "execution_count": content.get("execution_count")})
            elif kind == "stream":
                emit({"type": "stdout" if content.get("name") == "stdout" else "stderr",
                      "text": content.get("text", ""), "timestamp": now()})
            elif kind in ("execute_result", "display_data"):
                emit(result_line(content.get("data") or {}, kind == "execute_result"))
            elif kind == "error":
                emit({"type": "error", "name": content.get("ename", ""), "value": content.get("evalue", ""),
                      "traceback": "\n".join(content.get("traceback") or [])})

    def execute(self, code: str, env_vars: dict | None, emit) -> None:
        with self.lock:
            if env_vars:
                self._silent("import os as __ae_os\n__ae_saved = {k: __ae_os.environ.get(k) for k in %r}\n"
                             "__ae_os.environ.update(%r)" % (list(env_vars), {str(k): str(v) for k, v in env_vars.items()}))
            try:
                msg_id = self.kc.execute(code, store_history=True, allow_stdin=False)
                self._drain(msg_id, emit)
            except BrokenPipeError:
                self.km.interrupt_kernel()  # the client went away: stop what it started
                raise
            finally:
                if env_vars:
                    self._silent("for __k, __v in __ae_saved.items():\n"
                                 "    (__ae_os.environ.pop(__k, None) if __v is None else "
                                 "__ae_os.environ.__setitem__(__k, __v))\n")


def result_line(data: dict, main: bool) -> dict:
    out: dict = {"type": "result", "is_main_result": main}
    extra = {}
    for mime, value in data.items():
        key = MIME_KEYS.get(mime)
        if key:
            out[key] = value
        elif mime in ("application/vnd.e2b.data+json", "e2b/data"):
            out["data"] = value
        elif mime in ("application/vnd.e2b.chart+json", "e2b/chart"):
            out["chart"] = value
        else:
            extra[mime] = value
    if extra:
        out["extra"] = extra
    return out


class Contexts:
    def __init__(self) -> None:
        self.by_id: dict[str, Context] = {}
        self.default: dict[str, Context] = {}
        self.lock = threading.Lock()

    def create(self, language: str, cwd: str) -> Context:
        ctx = Context(language, cwd)
        with self.lock:
            self.by_id[ctx.id] = ctx
        return ctx

    def default_for(self, language: str) -> Context:
        with self.lock:
            ctx = self.default.get(language)
        if ctx is None:
            ctx = self.create(language, DEFAULT_CWD)
            with self.lock:
                ctx = self.default.setdefault(language, ctx)
        return ctx


CONTEXTS = Contexts()


def normalize_language(lang):
    if lang in (None, "", "python", "python3"):
        return "python"
    return {"js": "javascript", "ts": "typescript"}.get(lang, lang)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "agentenv-code-interpreter"

    def log_message(self, fmt, *args):  # quiet: the SDK polls nothing, but keep stderr clean
        pass

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return {}
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("body must be a JSON object")
        return data

    def _send(self, status: int, body, ctype: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else (json.dumps(body) if ctype == "application/json"
                                                      else str(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_GET(self):
        if self.path == "/health":
            return self._send(200, {"status": "ok"})
        if self.path == "/contexts":
            return self._send(200, [c.info() for c in list(CONTEXTS.by_id.values())])
        self._send(404, "not found", "text/plain")

    def do_DELETE(self):
        parts = self.path.strip("/").split("/")
        if len(parts) == 2 and parts[0] == "contexts":
            ctx = CONTEXTS.by_id.pop(parts[1], None)
            if ctx is None:
                return self._send(404, f"context {parts[1]} not found", "text/plain")
            for lang, c in list(CONTEXTS.default.items()):
                if c is ctx:
                    CONTEXTS.default.pop(lang, None)
            ctx.shutdown()
            return self._send(200, {})
        self._send(404, "not found", "text/plain")

    def do_POST(self):
        try:
            body = self._body()
        except ValueError as e:
            return self._send(400, f"invalid request body: {e}", "text/plain")
        parts = self.path.strip("/").split("/")
        try:
            if self.path == "/execute":
                return self._execute(body)
            if self.path == "/contexts":
                lang = normalize_language(body.get("language"))
                if lang not in LANGUAGES:
                    return self._send(400, f"language {lang!r} is not available in this template", "text/plain")
                ctx = CONTEXTS.create(lang, body.get("cwd") or DEFAULT_CWD)
                return self._send(200, ctx.info())
            if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
                ctx = CONTEXTS.by_id.get(parts[1])
                if ctx is None:
                    return self._send(404, f"context {parts[1]} not found", "text/plain")
                ctx.restart()
                return self._send(200, {})
        except Exception as e:  # noqa: BLE001 - report, keep serving
            traceback.print_exc()
            return self._send(500, f"{type(e).__name__}: {e}", "text/plain")
        self._send(404, "not found", "text/plain")

    def _execute(self, body: dict) -> None:
        code = body.get("code")
        if not isinstance(code, str):
            return self._send(400, "code (a string) is required", "text/plain")
        if body.get("context_id") and body.get("language"):
            return self._send(400, "context_id and language are mutually exclusive", "text/plain")
        if body.get("context_id"):
            ctx = CONTEXTS.by_id.get(body["context_id"])
            if ctx is None:
                return self._send(404, f"context {body['context_id']} not found", "text/plain")
        else:
            lang = normalize_language(body.get("language"))
            if lang not in LANGUAGES:
                return self._send(400, f"language {lang!r} is not available in this template", "text/plain")
            ctx = CONTEXTS.default_for(lang)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def emit(obj: dict) -> None:
            self._chunk((json.dumps(obj) + "\n").encode())

        try:
            ctx.execute(code, body.get("env_vars") or None, emit)
            emit({"type": "end_of_execution"})
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


def main() -> None:
    t0 = time.monotonic()
    CONTEXTS.default_for("python")  # warm: the template's snapshot holds a ready kernel
    server = ThreadingHTTPServer(("0.0.0.0", PORT), Handler)
    server.daemon_threads = True
    if READY_FILE:
        with open(READY_FILE, "w") as f:
            f.write(f"{time.monotonic() - t0:.2f}\n")
    print(f"code interpreter listening on :{PORT}", file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
