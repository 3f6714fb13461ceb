"""State stores: where the control plane keeps sandboxes, templates and API keys.

`StateStore` is the seam; `SQLiteStateStore` is the embedded default. A networked store
(PostgreSQL) implements the same protocol for clusters.
"""

from agentenv.state.base import StateStore

__all__ = ["StateStore"]
