"""Per-sandbox network namespaces ("slots") with identical in-sandbox addressing."""
