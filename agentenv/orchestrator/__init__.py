"""The per-node orchestrator: every sandbox's lifecycle, from create to kill or expiry."""
