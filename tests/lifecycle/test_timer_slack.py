"""A gVisor sandbox's host threads run with the configured timer slack (`sandbox_timer_slack_us`).

runsc 20240729's Sentry wakes every 400 µs however idle its sandbox is; a coarser host timer makes
those wake-ups fewer (`runtimes/cgroups.set_timer_slack`). What is checked, from the host's side
(`/proc/<tid>/timerslack_ns` of every thread in the sandbox's cgroup): a created sandbox, the
threads and processes it makes later (they inherit the slack), and a resumed one (a restore starts
new processes). One extra server with the setting on: the default (0) leaves the kernel's slack.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2b import Sandbox

from serverproc import new_data_dir, remove_data_dir, run_gc, start_extra_server

pytestmark = pytest.mark.timeout(600)

CGROUP = Path("/sys/fs/cgroup")
SLACK_US = 5000
SLACK_NS = SLACK_US * 1000

# A process inside the sandbox with 8 threads of its own that sleep: new host threads (systrap stubs).
THREADS = ("nohup python3 -c 'import threading, time; "
           "[threading.Thread(target=time.sleep, args=(600,)).start() for _ in range(8)]; time.sleep(600)' "
           ">/dev/null 2>&1 &")


def _slacks(sid: str) -> dict[int, int]:
    """Thread id -> timer slack (ns) of every host thread in the sandbox's cgroup."""
    for threads in (CGROUP / "cpuacct" / "agentenv" / sid / "tasks", CGROUP / "agentenv" / sid / "cgroup.threads"):
        if threads.exists():
            out = {}
            for tid in threads.read_text().split():
                try:
                    out[int(tid)] = int(Path(f"/proc/{tid}/timerslack_ns").read_text())
                except OSError:  # the thread ended meanwhile
                    pass
            return out
    pytest.skip(f"no thread list of sandbox {sid}'s cgroup on this host")


@pytest.fixture(scope="module")
def slack_server():
    d = new_data_dir("slack")
    srv = start_extra_server(d, env={"AGENTENV_SANDBOX_TIMER_SLACK_US": str(SLACK_US)})
    try:
        yield srv
    finally:
        if not srv.stopped:
            srv.stop()  # and nothing of it left on the host
        run_gc(d, srv.env)
        remove_data_dir(d)


def test_a_sandboxes_host_threads_run_with_the_timer_slack_also_those_made_later_and_after_resume(slack_server):
    srv = slack_server
    sbx = Sandbox.create(timeout=300, **srv.sdk_opts())
    srv.known_ids.add(sbx.sandbox_id)
    try:
        _check(srv, sbx)
    finally:
        Sandbox.kill(sbx.sandbox_id, **srv.sdk_opts())


def _check(srv, sbx: Sandbox) -> None:
    sbx.commands.run("true")
    first = _slacks(sbx.sandbox_id)
    assert len(first) >= 5, first  # Sentry, gofer and their Go threads
    assert set(first.values()) == {SLACK_NS}, f"threads without the slack: {first}"

    sbx.commands.run(THREADS)
    sbx.commands.run("for i in $(seq 50); do [ $(ls /proc/$(pgrep -f threading | head -1)/task | wc -l) -ge 9 ] "
                     "&& exit 0; sleep 0.1; done; exit 1")
    later = _slacks(sbx.sandbox_id)
    assert set(later) - set(first), "the sandbox's new threads made no host thread"
    assert set(later.values()) == {SLACK_NS}, f"threads made later without the slack: {later}"

    sbx.pause()
    resumed = Sandbox.connect(sbx.sandbox_id, **srv.sdk_opts())
    assert "threading" in resumed.commands.run("ps -eo args").stdout  # the process came back with it
    after = _slacks(sbx.sandbox_id)
    assert after and not set(after) & set(later), "a resume restores into new host processes"
    assert set(after.values()) == {SLACK_NS}, f"threads of the resumed sandbox without the slack: {after}"
