"""Ready-made templates the server can build itself (see docs/templates.md)."""
