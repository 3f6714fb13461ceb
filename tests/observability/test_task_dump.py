"""SIGUSR1 makes a running server log every asyncio task and where it waits (`observability/taskdump.py`),
and the server goes on serving: the tool for a process that is up but whose calls hang."""

from __future__ import annotations

import os
import re
import signal
import time

import requests


def test_sigusr1_logs_the_tasks_and_the_server_goes_on(server):
    since = server.log_path.stat().st_size
    os.kill(server.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 20
    text = ""
    while time.monotonic() < deadline:
        with open(server.log_path, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        if "ttl-reaper" in text:
            break
        time.sleep(0.2)
    m = re.search(r"SIGUSR1: (\d+) asyncio task\(s\)", text)
    assert m and int(m.group(1)) >= 2, f"no task dump in the log after SIGUSR1:\n{text[-2000:]}"
    # each task with its name and the frame it is suspended in
    assert "task ttl-reaper" in text and "Stack for" in text, text[-3000:]
    assert server.proc.poll() is None, "SIGUSR1 ended the server"
    r = requests.get(f"{server.api_url}/health", timeout=10)
    assert r.status_code == 200
