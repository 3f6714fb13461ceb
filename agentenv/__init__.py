"""agentenv: self-hosted, E2B-compatible, forkable sandboxes for AI agents and agentic RL."""

__version__ = "0.1.0"
