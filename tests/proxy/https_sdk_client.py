"""Run by test_proxy_https.py under the test resolver: the Python SDK with E2B_DOMAIN only.

No E2B_API_URL / E2B_SANDBOX_URL: the SDK reaches https://api.<domain> and envd at
https://49983-<id>.<domain> by name, trusting the server's CA through SSL_CERT_FILE. Prints one
JSON line; the sandbox is left running for the test (which kills it).
"""

from __future__ import annotations

import json
import os
import time

from e2b import Sandbox
from e2b.sandbox.commands.command_handle import PtySize

assert "E2B_SANDBOX_URL" not in os.environ and "E2B_API_URL" not in os.environ

sbx = Sandbox.create(timeout=600, metadata={"suite": "proxy-https"})
out: dict = {"id": sbx.sandbox_id, "host": sbx.get_host(8000)}
out["stdout"] = sbx.commands.run("echo hello-$((40+2))").stdout

sbx.files.write("/home/user/a.txt", "data-over-tls")
out["read"] = sbx.files.read("/home/user/a.txt")

sbx.files.make_dir("/home/user/w")
watch = sbx.files.watch_dir("/home/user/w")
sbx.files.write("/home/user/w/new.txt", "x")
events: list = []
deadline = time.monotonic() + 20
while time.monotonic() < deadline and not any(e.name == "new.txt" for e in events):
    events += watch.get_new_events()
    time.sleep(0.2)
watch.stop()
out["watched"] = sorted({e.name for e in events})

pty_out = bytearray()
pty = sbx.pty.create(PtySize(rows=24, cols=80))
sbx.pty.send_stdin(pty.pid, b"echo pty-$((6*7)); exit\n")
pty.wait(on_pty=lambda data: pty_out.extend(data))
out["pty"] = pty_out.decode(errors="replace")

out["download_url"] = sbx.download_url("/home/user/a.txt")
out["upload_url"] = sbx.upload_url("/home/user/uploaded.txt")
print(json.dumps(out))
