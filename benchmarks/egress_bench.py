"""Cost of the egress policy: proxied (domain rule) vs direct connections, and live rule changes.

    E2B_API_URL=... E2B_API_KEY=... sudo .venv/bin/python benchmarks/egress_bench.py [--rounds 40]

Needs a running agentenv server (the environment the E2B SDK reads) on this host and root (the
test hosts are network namespaces, as in tests/network_policy: nothing leaves the machine).
Measured inside the sandbox (Python, one fresh connection per request, closed with a reset):
HTTP and HTTPS request latency to the same test host, directly (default policy) and through the
egress proxy (allowOut: [name], denyOut: [0.0.0.0/0]); 64 MiB download throughput both ways; and
the latency of PUT /sandboxes/{id}/network seen by the SDK. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "network_policy"))

from e2b import Sandbox  # noqa: E402

from netpolicy_util import add_hosts, running_test_hosts  # noqa: E402

CLIENT = r'''
import json, socket, ssl, struct, sys, time
host, rounds, big = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
def get(tls, path):
    t0 = time.perf_counter()
    s = socket.create_connection((host, 443 if tls else 80), timeout=30)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    if tls:
        s = ctx.wrap_socket(s, server_hostname=host)
    s.sendall(("GET %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (path, host)).encode())
    n = 0
    while True:
        b = s.recv(1 << 20)
        if not b:
            break
        n += len(b)
    s.close()
    return time.perf_counter() - t0, n
out = {"http": [get(False, "/")[0] for _ in range(rounds)], "https": [get(True, "/")[0] for _ in range(rounds)]}
t, n = get(False, "/bytes/%d" % big)
out["http_mib_s"] = n / t / 2**20
t, n = get(True, "/bytes/%d" % big)
out["https_mib_s"] = n / t / 2**20
print(json.dumps(out))
'''


def ms(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1] * 1e3 if q != 50 else statistics.median(xs) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d, running_test_hosts(Path(d)) as hosts:
        direct = Sandbox.create(timeout=600)
        proxied = Sandbox.create(timeout=600, network={"allow_out": ["bench.test"], "deny_out": ["0.0.0.0/0"]})
        try:
            rows = {}
            for name, sbx in (("direct", direct), ("egress proxy", proxied)):
                add_hosts(sbx, {"bench.test": hosts.public})
                sbx.files.write("/tmp/client.py", CLIENT)
                r = sbx.commands.run(f"python3 /tmp/client.py bench.test {args.rounds} {args.mib << 20}", timeout=600)
                rows[name] = json.loads(r.stdout)
            updates = []
            for i in range(20):
                t0 = time.perf_counter()
                direct.update_network({"deny_out": [f"203.0.113.{i}/32"]})
                updates.append(time.perf_counter() - t0)
        finally:
            for s in (direct, proxied):
                s.kill()
    print(f"| path | HTTP p50 / p90 ms | HTTPS p50 / p90 ms | HTTP MiB/s | HTTPS MiB/s |\n|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {ms(r['http'], 50):.2f} / {ms(r['http'], 90):.2f} | {ms(r['https'], 50):.2f} / "
              f"{ms(r['https'], 90):.2f} | {r['http_mib_s']:.0f} | {r['https_mib_s']:.0f} |")
    print(f"\nPUT /sandboxes/{{id}}/network (SDK round trip, 20 calls): p50 {ms(updates, 50):.1f} ms, "
          f"p90 {ms(updates, 90):.1f} ms, max {max(updates) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
