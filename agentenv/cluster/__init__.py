"""Cluster roles: `node` (orchestrator + runtime per host), `scheduler` (placement, node liveness) and
`gateway` (public API and sandbox traffic, routed to the owning node). See docs/cluster.md."""
