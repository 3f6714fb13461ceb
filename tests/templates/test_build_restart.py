"""A build that a crashed server left running ends as `error` with a reason after the restart
(its sandboxes are garbage-collected like any other), instead of staying `building` forever."""

from __future__ import annotations

import time

import pytest
from e2b import Template

from serverproc import new_data_dir, remove_data_dir, start_extra_server

pytestmark = pytest.mark.timeout(600)


def test_build_interrupted_by_a_crash_ends_in_error(server):
    d = new_data_dir("tbuild")
    srv = start_extra_server(d, log_name="server-1.log")
    srv2 = None
    try:
        opts = srv.sdk_opts()
        t = Template().from_base_image().run_cmd("sleep 600")
        info = Template.build_in_background(t, "crashing", **opts)
        deadline = time.monotonic() + 120
        while not any(e.message.startswith("[1/1] RUN sleep 600")
                      for e in Template.get_build_status(info, logs_offset=0, **opts).log_entries):
            assert time.monotonic() < deadline, srv.log_tail(30)
            time.sleep(0.5)
        time.sleep(1)  # the build sandbox runs the step
        srv.kill9()
        srv2 = start_extra_server(d, api_key=srv.api_key, log_name="server-2.log")
        st = Template.get_build_status(info, **srv2.sdk_opts())
        assert st.status.value == "error"
        assert st.reason is not None and "restarted" in st.reason.message
    finally:
        if srv2 is not None:
            srv2.stop()
        else:
            srv.stop()
        remove_data_dir(d)
