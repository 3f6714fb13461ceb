"""Random concurrent lifecycle operations against the session server (`tests/soak.py`). Two bugs this
found by hand: a source killed while its fork's children restored failed every child (their image
lived in the source's dir), and a fork's capture that froze envd still holding the pre-capture
check's connection left children whose envd never answered.
"""

from __future__ import annotations

import pytest

from soak import Soak


@pytest.mark.timeout(600)
def test_concurrent_random_operations_keep_every_sandbox_and_its_data(server, tracker):
    soak = Soak(server.api_url, server.api_key, tracker.ids.add, seed=20261205)
    soak.run()
    print("operations done:", soak.done)
    soak.assert_clean(server.log_tail(30), logs={"server": server.log_path})
