"""The ready-made `code-interpreter` template through the official e2b-code-interpreter SDK.

A server started with AGENTENV_BUILTIN_TEMPLATES=code-interpreter builds the template itself
(Jupyter wheels from the host's pip, installed inside the build sandbox); the SDK's default
template `code-interpreter-v1` then resolves to it and `run_code` talks to our in-sandbox server.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from serverproc import new_data_dir, remove_data_dir, shared_data_dir, start_extra_server

ci = pytest.importorskip("e2b_code_interpreter", reason="e2b-code-interpreter SDK not installed")

pytestmark = pytest.mark.timeout(900)


def wheelhouse() -> Path:
    """Jupyter wheels for the template, downloaded once per host with the host's pip."""
    d = shared_data_dir().parent / f"{shared_data_dir().name}-wheelhouse" / "code-interpreter"
    if not any(d.glob("ipykernel-*.whl")):
        d.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
                            "--python-version", "3.11", "--dest", str(d), "ipykernel", "jupyter_client"],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            pytest.skip(f"cannot download the Jupyter wheels with pip here: {r.stderr[-300:]}")
    return d


@pytest.fixture(scope="module")
def ci_server(server):
    d = new_data_dir("ci")
    srv = start_extra_server(d, env={"AGENTENV_BUILTIN_TEMPLATES": "code-interpreter",
                                     "AGENTENV_CODE_INTERPRETER_WHEELS": str(wheelhouse())})
    try:
        deadline = time.monotonic() + 600
        while True:
            r = requests.get(f"{srv.url}/templates/code-interpreter-v1", headers=srv.headers(), timeout=30)
            builds = r.json().get("builds", []) if r.status_code == 200 else []
            if builds and builds[-1]["status"] == "ready":
                break
            assert not builds or builds[-1]["status"] != "error", srv.log_tail(60)
            assert time.monotonic() < deadline, f"code-interpreter template not built in time\n{srv.log_tail(60)}"
            assert srv.alive(), srv.log_tail(60)
            time.sleep(1)
        yield srv
    finally:
        try:
            srv.stop()
        finally:
            remove_data_dir(d)


@pytest.fixture(scope="module")
def sbx(ci_server):
    s = ci.Sandbox.create(timeout=300, **ci_server.sdk_opts())  # the SDK's default: code-interpreter-v1
    try:
        yield s
    finally:
        s.kill()


def test_run_code_streams_stdout_stderr_and_results(sbx):
    out, err = [], []
    ex = sbx.run_code("import sys\nprint('hello')\nprint('oops', file=sys.stderr)\n21 * 2",
                      on_stdout=lambda m: out.append(m.line), on_stderr=lambda m: err.append(m.line))
    assert ex.error is None
    assert ex.logs.stdout == ["hello\n"] and ex.logs.stderr == ["oops\n"]
    assert out == ["hello\n"] and err == ["oops\n"]
    assert ex.text == "42" and ex.results[0].is_main_result
    assert ex.execution_count >= 1


def test_state_persists_and_errors_are_reported(sbx):
    sbx.run_code("counter = 10")
    assert sbx.run_code("counter += 5\ncounter").text == "15"
    ex = sbx.run_code("undefined_name + 1")
    assert ex.error is not None and ex.error.name == "NameError" and "undefined_name" in ex.error.value
    assert "Traceback" in ex.error.traceback or "NameError" in ex.error.traceback


def test_rich_results_and_env_vars(sbx):
    ex = sbx.run_code("from IPython.display import HTML, display\ndisplay(HTML('<b>bold</b>'))\n'done'")
    htmls = [r.html for r in ex.results if r.html]
    assert htmls == ["<b>bold</b>"] and ex.text == "'done'"
    ex = sbx.run_code("import os; os.environ.get('CI_TEST_VAR')", envs={"CI_TEST_VAR": "from-call"})
    assert ex.text == "'from-call'"
    # restored after that execution
    assert sbx.run_code("import os; str(os.environ.get('CI_TEST_VAR'))").text == "'None'"


def test_contexts_are_isolated(sbx):
    ctx = sbx.create_code_context(cwd="/tmp")
    assert ctx.cwd == "/tmp" and ctx.language == "python"
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "'/tmp'"
    sbx.run_code("only_here = 1", context=ctx)
    assert sbx.run_code("only_here", context=ctx).text == "1"
    assert sbx.run_code("'only_here' in globals()").text == "False"
    ids = {c.id for c in sbx.list_code_contexts()}
    assert ctx.id in ids
    sbx.restart_code_context(ctx)
    assert sbx.run_code("'only_here' in globals()", context=ctx).text == "False"
    sbx.remove_code_context(ctx)
    assert ctx.id not in {c.id for c in sbx.list_code_contexts()}


def test_kernel_was_started_by_the_template_not_by_the_sandbox(sbx):
    # The default kernel belongs to the restored snapshot: its process predates this sandbox's
    # first run_code and the server answered the first request without starting one.
    procs = sbx.commands.run("ps -eo pid,args").stdout
    assert "server.py --kernel" in procs and "/opt/agentenv-ci/server.py" in procs


def test_kernel_state_survives_pause_fork_and_snapshot(ci_server):
    """The Jupyter kernel (an epoll server holding its ZeroMQ sockets on loopback) is captured like any
    process: its variables are there after pause/resume, in each of 4 fork children, and in a sandbox
    created from a snapshot; the source keeps running."""
    s = ci.Sandbox.create(timeout=600, **ci_server.sdk_opts())
    made: list = [s]
    try:
        assert s.run_code("kept = 41").error is None
        assert s.pause() is True
        s = ci.Sandbox.connect(s.sandbox_id, timeout=600, **ci_server.sdk_opts())
        assert s.run_code("kept += 1\nkept").text == "42"
        children = s.fork(count=4, timeout=600)
        made += [c for c in children if not isinstance(c, Exception)]
        assert len(made) == 5, children
        for c in made[1:]:
            child = ci.Sandbox.connect(c.sandbox_id, **ci_server.sdk_opts())
            assert child.run_code("kept").text == "42"
        snap = s.create_snapshot()
        assert s.run_code("kept + 1").text == "43"  # the source runs on
        again = ci.Sandbox.create(snap.snapshot_id, timeout=300, **ci_server.sdk_opts())
        made.append(again)
        assert again.run_code("kept").text == "42"
    finally:
        for x in made:
            try:
                x.kill()
            except Exception:  # noqa: BLE001
                pass
