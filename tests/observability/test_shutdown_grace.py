"""A stopping server gives the requests in flight `shutdown_grace_s`, then cuts them: an open
`/events` stream (or any stream) no longer holds a SIGTERM for aiohttp's own 60 s (twice: listener
and runner), which outlived the stop deadlines of process supervisors and of our tests."""

from __future__ import annotations

import threading
import time

import requests

from serverproc import new_data_dir, remove_data_dir, start_extra_server, stop_unchecked

GRACE_S = 2


def test_an_open_event_stream_does_not_hold_a_stop(server):  # `server`: the shared images exist
    d = new_data_dir("grace")
    srv = None
    try:
        # the Python listener: the stream's connection ends at aiohttp itself (behind HAProxy, the
        # proxy stops first and the stream ends at its next keep-alive write)
        srv = start_extra_server(d, env={"AGENTENV_SHUTDOWN_GRACE_S": str(GRACE_S), "AGENTENV_POOL_SIZE": "0",
                                         "AGENTENV_DATA_PLANE": "python"}, log_name="server-grace.log")
        ended = threading.Event()

        def follow() -> None:
            try:
                with requests.get(f"{srv.url}/events", stream=True, timeout=(10, 300),
                                  headers={**srv.headers(), "Accept": "text/event-stream"}) as r:
                    assert r.status_code == 200
                    for _ in r.iter_content(chunk_size=None):
                        pass
            except requests.RequestException:
                pass
            ended.set()

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        time.sleep(1.0)  # the stream is open and idle
        assert not ended.is_set(), "the event stream ended before the stop"
        t0 = time.monotonic()
        problems = srv.stop(timeout=40)
        took = time.monotonic() - t0
        assert not problems, problems
        # grace once for the listener (the rest of the stop is the server's own work, ~seconds)
        assert took < 20, f"the server took {took:.1f}s to stop with an open stream (grace {GRACE_S}s)"
        assert ended.wait(10), "the stream was not closed by the stop"
        assert "Traceback" not in srv.log_path.read_text(errors="replace")
    finally:
        stop_unchecked(srv)
        remove_data_dir(d)
