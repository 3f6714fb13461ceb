"""A command's timeout counts the time the sandbox ran, not the time it was away (agentenv/envd/lifetime.py).

envd is stopped with SIGSTOP while the host's monotonic clock runs on: on SIGCONT its kill timers are
as late as a restored gVisor sandbox's, whose clock moved on by its time on disk. The host then says
how long it was away (`/init` `agentenvAwayMs`), or says nothing (a sandbox merely starved of CPU).
Everything else goes through the real E2B SDK against a real envd.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests
from e2b import Sandbox

from agentenv.envd import lifetime
from agentenv.envd.state import HOST_TOKEN_HEADER

TIMEOUT_S = 2
AWAY_S = 5.0  # longer than TIMEOUT_S + LATE_S: the kill timer fires that late on SIGCONT


def fresh_envd(envd_factory):
    """An envd of this test's own (it is stopped), its commands run as root."""
    envd = envd_factory()
    r = requests.post(envd.url + "/init", json={"defaultUser": "root"}, timeout=10)
    assert r.status_code == 204, r.text
    return envd


def running(sbx: Sandbox, pid: int) -> bool:
    return any(p.pid == pid for p in sbx.commands.list())


def start_and_stop_away(envd, sbx: Sandbox) -> tuple[int, float]:
    """A `sleep` with a TIMEOUT_S timeout, then envd stopped AWAY_S; its pid and the time of SIGCONT."""
    handle = sbx.commands.run("sleep 120", background=True, timeout=TIMEOUT_S)
    handle.disconnect()
    started = time.monotonic()
    os.kill(envd.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(AWAY_S)
    finally:
        os.kill(envd.proc.pid, signal.SIGCONT)
    assert time.monotonic() - started - TIMEOUT_S > lifetime.LATE_S  # the premise: its timer is that late
    return handle.pid, time.monotonic()


def gone_after(sbx: Sandbox, pid: int, since: float, limit: float) -> float:
    """Seconds from `since` (time.monotonic) until the process is gone; fails `limit` s after `since`."""
    while running(sbx, pid):
        assert time.monotonic() - since < limit, f"pid {pid} still runs {limit:.0f}s on"
        time.sleep(0.2)
    return time.monotonic() - since


@pytest.mark.timeout(60)
def test_a_command_keeps_the_rest_of_its_timeout_when_the_host_says_the_sandbox_was_away(envd_factory, sandbox_for):
    envd = fresh_envd(envd_factory)
    sbx = sandbox_for(envd)
    pid, resumed = start_and_stop_away(envd, sbx)
    r = requests.post(envd.url + "/init", json={"agentenvAwayMs": round(AWAY_S * 1000)},
                      headers={HOST_TOKEN_HEADER: envd.host_token}, timeout=10)
    assert r.status_code == 204, r.text
    # Its timer fired on SIGCONT, late by more than LATE_S; the host's word moved its deadline back
    # by the time away, so it keeps the rest of its two seconds.
    assert running(sbx, pid), envd.log_tail()
    gone = gone_after(sbx, pid, resumed, 15)
    assert gone < TIMEOUT_S + 3, f"killed {gone:.1f}s after SIGCONT, its timeout is {TIMEOUT_S}s\n{envd.log_tail()}"
    assert "moved" in envd.log_tail(), envd.log_tail()


@pytest.mark.timeout(60)
def test_an_init_the_host_sends_again_moves_the_deadlines_once(envd_factory, sandbox_for):
    # The bring-up sends its /init until envd answers (`envd_client.init`): an /init
    # whose answer was lost arrives twice, the same body each time.
    envd = fresh_envd(envd_factory)
    sbx = sandbox_for(envd)
    pid, resumed = start_and_stop_away(envd, sbx)
    body = {"agentenvAwayMs": round(AWAY_S * 1000), "timestamp": "2026-12-07T16:00:00.000Z"}
    for _ in range(2):
        r = requests.post(envd.url + "/init", json=body, headers={HOST_TOKEN_HEADER: envd.host_token}, timeout=10)
        assert r.status_code == 204, r.text
    assert running(sbx, pid), envd.log_tail()
    # moved back once, it has the rest of its two seconds; moved twice, it would run AWAY_S more
    gone = gone_after(sbx, pid, resumed, 20)
    assert gone < TIMEOUT_S + 3, f"killed {gone:.1f}s after SIGCONT, its timeout is {TIMEOUT_S}s\n{envd.log_tail()}"


@pytest.mark.timeout(60)
def test_a_late_kill_without_word_from_the_host_waits_only_the_hold(envd_factory, sandbox_for):
    envd = fresh_envd(envd_factory)
    sbx = sandbox_for(envd)
    pid, resumed = start_and_stop_away(envd, sbx)
    time.sleep(1)
    assert running(sbx, pid), envd.log_tail()  # held for the host's word
    gone = gone_after(sbx, pid, resumed, lifetime.HOLD_S + 10)
    assert gone > lifetime.HOLD_S - 1, f"killed {gone:.1f}s after SIGCONT, before its hold ended"


@pytest.mark.timeout(60)
def test_an_on_time_timeout_still_kills_at_once_and_a_bad_time_away_is_refused(envd_factory, sandbox_for):
    envd = fresh_envd(envd_factory)
    sbx = sandbox_for(envd)
    for bad in (-1, "5000", True, [1]):
        r = requests.post(envd.url + "/init", json={"agentenvAwayMs": bad},
                          headers={HOST_TOKEN_HEADER: envd.host_token}, timeout=10)
        assert r.status_code == 400 and "agentenvAwayMs" in r.json()["message"], (bad, r.text)
    handle = sbx.commands.run("sleep 120", background=True, timeout=TIMEOUT_S)
    handle.disconnect()
    started = time.monotonic()
    gone = gone_after(sbx, handle.pid, started, 15)
    assert gone < TIMEOUT_S + 2, f"killed {gone:.1f}s after its start, its timeout is {TIMEOUT_S}s"
