"""Runtimes: what actually runs a sandbox (gVisor now; Firecracker and QEMU microVMs later)."""
