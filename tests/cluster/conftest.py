"""A whole agentenv cluster on one machine, shared by the cluster tests of a session.

- a bridge in the root network namespace with the cluster's "LAN" (`LAN_PREFIX`.0/24);
- three node hosts: each a network namespace with its own address on that LAN (a veth into the
  bridge), running its own `agentenv node` process (own data dir, instance tag, slot subnet);
- in the root namespace: a real PostgreSQL (initdb'd by the test), a real S3 server
  (`rclone serve s3`), `agentenv scheduler` and `agentenv gateway`.

The nodes run under `nsenter --net=` (network namespace only, so their mounts stay visible to the
leftover checks). Teardown stops every process by PID, runs `agentenv gc` for each node inside its
namespace (a node killed with -9 leaves its sandboxes running, as a lost machine would), checks
that no container, netns, mount or process of any node is left, and removes the namespaces and
the bridge — also when a test or the startup failed.

Knobs (parallel sessions on one host need their own): AGENTENV_TEST_CLUSTER_LAN (default
10.246.250), AGENTENV_TEST_CLUSTER_TAG (2 chars, default "cl": instance tags <tag>a/b/c),
AGENTENV_TEST_CLUSTER_SUBNETS (three /16s, default 10.247.0.0/16,10.248.0.0/16,10.249.0.0/16),
AGENTENV_TEST_CLUSTER_MAX_SANDBOXES (per node, default 16).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from agentenv.cluster import tls
from leftovers import live_spare, mounts_under, processes_mentioning, runsc_containers
from pgserver import pg_bindir, start_postgres
from s3server import start_s3
from serverproc import (agentenv_executable, free_port, log_tail, new_api_key, new_data_dir, remove_data_dir,
                        shared_data_dir)

LAN = os.environ.get("AGENTENV_TEST_CLUSTER_LAN", "10.246.250")
TAG = os.environ.get("AGENTENV_TEST_CLUSTER_TAG", "cl")
SUBNETS = os.environ.get("AGENTENV_TEST_CLUSTER_SUBNETS", "10.247.0.0/16,10.248.0.0/16,10.249.0.0/16").split(",")
MAX_SANDBOXES = int(os.environ.get("AGENTENV_TEST_CLUSTER_MAX_SANDBOXES", "16"))
BRIDGE = f"ae{TAG}br"
NODE_PORT = 3000
HEARTBEAT_S = 1.0
# Three nodes, the gateway, the scheduler, PostgreSQL and up to 48 busy sandboxes share 2 cores in CI:
# a node's event loop can miss heartbeats for several seconds under the load test (a 5 s limit once
# declared a healthy node dead mid-run). The kill -9 test waits for this long.
DEAD_AFTER_S = 15.0
# nft table of Node.partition (in the node's namespace)
PARTITION_TABLE = "aetestpartition"


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=60, check=check)


@dataclass
class Node:
    name: str  # node id: a | b | c
    netns: str
    address: str
    instance: str
    subnet: str
    data_dir: Path
    env: dict[str, str]
    log_path: Path
    pki: "Pki"
    proc: subprocess.Popen | None = None
    killed: bool = False

    @property
    def url(self) -> str:
        return f"https://{self.address}:{NODE_PORT}"

    def start(self) -> None:
        full = dict(os.environ)
        for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"):
            full.pop(k, None)
        full.update(self.env)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{self.netns}", agentenv_executable(), "node"],
                                     env=full, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.killed = False

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.killed = True

    def stop(self, timeout: float = 90) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    @property
    def lan_if(self) -> str:
        return f"ae{TAG}{self.name}1"

    def partition(self) -> None:
        """Cut the node off the LAN (PostgreSQL, S3, scheduler, gateway, the other nodes): packets
        dropped both ways in its namespace, as a failed switch port would, not refused."""
        rules = (f"table inet {PARTITION_TABLE} {{\n"
                 f" chain i {{ type filter hook input priority -300; iifname \"{self.lan_if}\" drop; }}\n"
                 f" chain o {{ type filter hook output priority -300; oifname \"{self.lan_if}\" drop; }}\n}}\n")
        subprocess.run(["ip", "netns", "exec", self.netns, "nft", "-f", "-"], input=rules, text=True, check=True,
                       capture_output=True, timeout=30)

    def heal(self) -> None:
        sh("ip", "netns", "exec", self.netns, "nft", "delete", "table", "inet", PARTITION_TABLE, check=False)

    def sandbox_status(self, sandbox_id: str, port: int = 49983, path: str = "/health") -> int:
        """HTTP status of a request to `sandbox_id` through this node's own listener, from inside its
        namespace (works while it is partitioned); 0 when nothing answers within 3 s."""
        r = subprocess.run(["ip", "netns", "exec", self.netns, "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                            "--max-time", "3", "--cacert", str(self.pki.ca), "--cert", str(self.pki.admin[0]),
                            "--key", str(self.pki.admin[1]), "-H", f"E2b-Sandbox-Id: {sandbox_id}",
                            "-H", f"E2b-Sandbox-Port: {port}",
                            f"{self.url}{path}"], capture_output=True, text=True, timeout=30)
        return int(r.stdout.strip() or 0)

    def gc(self) -> subprocess.CompletedProcess:
        env = dict(os.environ)
        env.update(self.env)
        return subprocess.run(["nsenter", f"--net=/run/netns/{self.netns}", agentenv_executable(), "gc",
                               "--data-dir", str(self.data_dir)], env=env, capture_output=True, text=True,
                              timeout=300, stdin=subprocess.DEVNULL)

    def leftovers(self) -> list[str]:
        out = [f"container {c}" for c in runsc_containers(self.data_dir)]
        out += [f"mount {m}" for m in mounts_under(self.data_dir)]
        ns = sh("ip", "netns", "list").stdout.split()
        out += [f"netns {n}" for n in ns if n.startswith(f"agentenv-{self.instance}-")
                and not live_spare(n, self.instance)]  # a running node's ready slots
        out += [f"process {p}" for p in processes_mentioning(str(self.data_dir.resolve()))]
        return out

    def log_tail(self, n: int = 60) -> str:
        return log_tail(self.log_path, n)

    def log_size(self) -> int:
        """Where the log ends now: `wait_log` from here sees only what comes after."""
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def wait_log(self, text: str, since: int, timeout: float = 120) -> str:
        """The log written after offset `since` (the log file spans every start of this node), once
        it contains `text`."""
        deadline = time.monotonic() + timeout
        while True:
            with open(self.log_path, "rb") as f:
                f.seek(since)
                new = f.read().decode(errors="replace")
            if text in new:
                return new
            assert time.monotonic() < deadline, f"node {self.name} never logged {text!r}:\n{self.log_tail(80)}"
            time.sleep(0.5)


@dataclass
class Proc:
    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path

    data_dir: Path

    def stop(self) -> None:
        """SIGTERM; one that does not stop in 30 s is killed, with a warning that carries what its
        tasks waited on. A role killed so leaves its HAProxy running (a data plane outlives its
        server by design: the next start takes it over); the tests stop it here."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
            return
        except subprocess.TimeoutExpired:
            pass
        size = self.log_path.stat().st_size
        self.proc.send_signal(signal.SIGUSR1)  # its asyncio tasks into its log (observability/taskdump.py)
        time.sleep(2)
        self.proc.kill()
        self.proc.wait(10)
        for pid in haproxy_mentioning(self.data_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with open(self.log_path, "rb") as f:
            f.seek(max(0, size - 4000))
            tail = f.read().decode(errors="replace")
        warnings.warn(f"the {self.name} at {self.url} did not stop within 30 s of SIGTERM and was killed:\n{tail}")


def haproxy_mentioning(path: Path) -> list[int]:
    """HAProxy processes whose command line names a file under `path` (a role's data dir)."""
    pids = []
    for line in processes_mentioning(str(path.resolve())):
        pid, cmdline = line.split(": ", 1)
        if cmdline.split()[0].endswith("haproxy"):
            pids.append(int(pid))
    return pids


@dataclass
class Pki:
    """The cluster CA and certificates of the test cluster (internal traffic over mutual TLS)."""

    dir: Path

    def __post_init__(self) -> None:
        tls.create_ca(self.dir / "ca")
        self.admin = self.issue("admin", "admin")  # the tests' own calls to internal routes

    @property
    def ca(self) -> Path:
        return self.dir / "ca" / "ca.crt"

    def issue(self, role: str, name: str, hosts: tuple[str, ...] = (), out: Path | None = None) -> tuple[Path, Path]:
        """A certificate (into the roles' directory unless `out`: the roles reload theirs when it changes)."""
        return tls.issue_cert(self.dir / "ca", role, name, out or self.dir, hosts=list(hosts), days=1)

    def env(self, role: str, name: str, hosts: tuple[str, ...] = ()) -> dict[str, str]:
        crt, key = self.issue(role, name, hosts)
        return {"AGENTENV_CLUSTER_CA_FILE": str(self.ca), "AGENTENV_CLUSTER_CERT_FILE": str(crt),
                "AGENTENV_CLUSTER_KEY_FILE": str(key)}

    def request(self, method: str, url: str, **kw) -> requests.Response:
        """An internal call with the admin certificate."""
        return requests.request(method, url, cert=tuple(map(str, self.admin)), verify=str(self.ca), **kw)


@dataclass
class Cluster:
    gateway: Proc
    scheduler: Proc
    nodes: dict[str, Node]
    api_key: str
    pki: Pki
    database_url: str
    s3: object
    work: Path
    extra: dict = field(default_factory=dict)

    def sdk_opts(self, **kw) -> dict:
        return dict(api_key=self.api_key, api_url=self.gateway.url, sandbox_url=self.gateway.url, **kw)

    def task_dumps(self, tail: int = 8000) -> str:
        """What every running role's asyncio tasks wait on right now (SIGUSR1, observability/taskdump.py),
        read back from their logs: for a test that failed on a call that hung."""
        roles = {"gateway": (self.gateway.proc, self.gateway.log_path),
                 "scheduler": (self.scheduler.proc, self.scheduler.log_path),
                 **{f"node {n.name}": (n.proc, n.log_path) for n in self.nodes.values()}}
        since = {}
        for name, (proc, path) in roles.items():
            if proc is not None and proc.poll() is None:
                since[name] = path.stat().st_size
                proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        out = []
        for name, offset in since.items():
            with open(roles[name][1], "rb") as f:
                f.seek(offset)
                out.append(f"--- {name}: tasks\n" + f.read().decode(errors="replace")[-tail:])
        return "\n".join(out)

    def node_status(self) -> dict[str, dict]:
        r = self.pki.request("GET", f"{self.scheduler.url}/internal/nodes", timeout=10)
        r.raise_for_status()
        return {n["node_id"]: n for n in r.json()}

    def drain(self, node: str, draining: bool = True) -> None:
        r = self.pki.request("POST", f"{self.nodes[node].url}/internal/drain", json={"draining": draining},
                             timeout=10)
        r.raise_for_status()

    def wait_nodes(self, names: list[str], timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for n in names:
                p = self.nodes[n].proc
                if p is not None and p.poll() is not None:
                    raise RuntimeError(f"node {n} exited ({p.returncode}):\n{self.nodes[n].log_tail()}")
            try:
                st = self.node_status()
                if all(st.get(n, {}).get("state") == "active" for n in names) and all(
                        self.pki.request("GET", f"{self.nodes[n].url}/health", timeout=3).ok for n in names):
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("nodes not up: " + "\n".join(f"--- {n}\n{self.nodes[n].log_tail()}" for n in names))
            time.sleep(0.5)

    def start_gateway(self, env: dict[str, str] | None = None, port: int | None = None) -> Proc:
        """Another gateway replica (stateless: same store, scheduler and key), with `env` on top of
        the first one's settings; the caller stops it."""
        port = port or free_port()
        env = {**self.extra["gateway_env"], "AGENTENV_HOST": "127.0.0.1", "AGENTENV_PORT": str(port),
               "AGENTENV_DATA_DIR": str(self.work / f"gateway-{port}"), **(env or {})}
        return _start_role("gateway", env, f"http://127.0.0.1:{port}", self.work / f"gateway-{port}.log", self.work)

    def restart_node(self, name: str) -> None:
        node = self.nodes[name]
        node.stop()
        node.start()
        self.wait_nodes([name])


def _netns_setup(nodes: list[tuple[str, str, str]]) -> None:
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "addr", "add", f"{LAN}.1/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    for name, netns, address in nodes:
        sh("ip", "netns", "add", netns)
        host_if, node_if = f"ae{TAG}{name}0", f"ae{TAG}{name}1"
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", node_if)
        sh("ip", "link", "set", host_if, "master", BRIDGE, "up")
        sh("ip", "link", "set", node_if, "netns", netns)
        sh("ip", "-n", netns, "addr", "add", f"{address}/24", "dev", node_if)
        sh("ip", "-n", netns, "link", "set", node_if, "up")
        sh("ip", "-n", netns, "link", "set", "lo", "up")


def _netns_teardown(nodes: list[tuple[str, str, str]]) -> None:
    for name, netns, _address in nodes:
        sh("ip", "link", "del", f"ae{TAG}{name}0", check=False)
        sh("ip", "netns", "del", netns, check=False)
    sh("ip", "link", "del", BRIDGE, check=False)


def _no_haproxy_left(work: Path) -> None:
    """The gateways stopped (SIGTERM) stopped their HAProxy too."""
    left = haproxy_mentioning(work)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"HAProxy processes of stopped gateways were still running: {left}"


def _start_role(role: str, env: dict[str, str], url: str, log_path: Path, work: Path,
                verify: str | bool = True) -> Proc:
    full = dict(os.environ)
    full.update(env)  # every role has a data dir of its own (never the session server's)
    proc = subprocess.Popen([agentenv_executable(), role], env=full, stdin=subprocess.DEVNULL,
                            stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, start_new_session=True, cwd=work)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{role} exited ({proc.returncode}):\n{log_tail(log_path)}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/health", timeout=2, verify=verify).ok:
                return Proc(role, url, proc, log_path, Path(full["AGENTENV_DATA_DIR"]))
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{role} not healthy in 60 s:\n{log_tail(log_path)}")
        time.sleep(0.2)


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    if os.geteuid() != 0:
        pytest.skip("the cluster tests need root (network namespaces, runsc)")
    if pg_bindir() is None:
        pytest.skip("PostgreSQL server not installed (apt-get install postgresql; scripts/setup.sh --test does it)")
    if shutil.which("nsenter") is None or shutil.which("runsc") is None:
        pytest.skip("nsenter or runsc missing")
    specs = [(n, f"ae{TAG}-node-{n}", f"{LAN}.{11 + i}") for i, n in enumerate("abc")]
    _netns_teardown(specs)  # a crashed earlier session's
    stack = contextlib.ExitStack()
    try:
        stack.callback(_netns_teardown, specs)
        _netns_setup(specs)
        # The nodes hard-link the shared test images: make sure they are built and current first (a
        # changed envd means a new tools layer), or every node would rebuild its own at once.
        r = subprocess.run([agentenv_executable(), "image", "build", "--data-dir", str(shared_data_dir())],
                           capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            pytest.fail(f"`agentenv image build` of the shared test images failed:\n{r.stdout[-2000:]}\n"
                        f"{r.stderr[-2000:]}")
        work = new_data_dir("cluster")
        stack.callback(remove_data_dir, work)
        pg = start_postgres(listen=("127.0.0.1", f"{LAN}.1"))
        stack.callback(pg.stop)
        s3 = start_s3(work / "s3", host=f"{LAN}.1")
        stack.callback(s3.stop)
        pki = Pki(work / "pki")  # no shared token: the roles know each other by their certificates
        api_key = new_api_key()
        common = {"AGENTENV_DATABASE_URL": pg.url(f"{LAN}.1"), "AGENTENV_CLUSTER_CA_FILE": str(pki.ca),
                  "AGENTENV_SNAPSHOT_STORE": "s3", "AGENTENV_S3_BUCKET": "cluster", "AGENTENV_S3_ENDPOINT": s3.endpoint,
                  "AGENTENV_S3_ACCESS_KEY": s3.access_key, "AGENTENV_S3_SECRET_KEY": s3.secret_key,
                  "AGENTENV_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S), "AGENTENV_NODE_DEAD_AFTER_S": str(DEAD_AFTER_S),
                  "AGENTENV_LOG_LEVEL": "INFO", "AGENTENV_MAX_STARTING_PER_NODE": "2",
                  "AGENTENV_ADMISSION_WAIT_S": "30",
                  "AGENTENV_CLUSTER_CERT_RELOAD_S": "5"}  # renewed certificates looked for every 5 s (default 30)
        sched_port, gw_port = free_port(), free_port()
        # on the LAN: nodes cut off from PostgreSQL relay their heartbeats through it (fencing)
        scheduler = _start_role("scheduler", {**common, **pki.env("scheduler", "scheduler", (f"{LAN}.1",)),
                                              "AGENTENV_HOST": f"{LAN}.1", "AGENTENV_PORT": str(sched_port),
                                              # its periodic store GC runs (the default grace: removes nothing)
                                              "AGENTENV_STORE_GC_INTERVAL_S": "10",
                                              "AGENTENV_DATA_DIR": str(work / "scheduler")},
                                f"https://{LAN}.1:{sched_port}", work / "scheduler.log", work, verify=str(pki.ca))
        stack.callback(_no_haproxy_left, work)  # once gateway and scheduler stopped
        stack.callback(scheduler.stop)
        gateway_env = {**common, **pki.env("gateway", "gateway"), "AGENTENV_SCHEDULER_URL": scheduler.url,
                       "AGENTENV_BOOTSTRAP_API_KEY": api_key}
        gateway = _start_role("gateway", {**gateway_env, "AGENTENV_HOST": "127.0.0.1", "AGENTENV_PORT": str(gw_port),
                                          "AGENTENV_DATA_DIR": str(work / "gateway")},
                              f"http://127.0.0.1:{gw_port}", work / "gateway.log", work)
        stack.callback(gateway.stop)
        nodes: dict[str, Node] = {}
        for (name, netns, address), subnet in zip(specs, SUBNETS):
            d = work.parent / f"{work.name}-node-{name}"
            d.mkdir()
            subprocess.run(["cp", "-al", str(work / "images"), str(d / "images")], check=True, timeout=300)
            env = {**common, "AGENTENV_NODE_ID": name, "AGENTENV_SCHEDULER_URL": scheduler.url,
                   "AGENTENV_NODE_URL": f"https://{address}:{NODE_PORT}", "AGENTENV_HOST": address,
                   "AGENTENV_PORT": str(NODE_PORT), "AGENTENV_DATA_DIR": str(d),
                   "AGENTENV_INSTANCE": f"{TAG}{name}", "AGENTENV_SLOT_SUBNET": subnet,
                   "AGENTENV_MAX_SANDBOXES": str(MAX_SANDBOXES), "AGENTENV_ALLOW_INTERNET_ACCESS": "false"}
            env.update(pki.env("node", name, (address,)))
            nodes[name] = Node(name, netns, address, f"{TAG}{name}", subnet, d, env, d / "node.log", pki)

        def stop_nodes() -> None:
            problems = []
            for n in nodes.values():
                n.heal()  # a partition test that failed half-way
            for n in nodes.values():
                n.stop()
            for n in nodes.values():
                r = n.gc()
                if r.returncode != 0:
                    problems.append(f"gc of node {n.name} failed: {r.stdout[-800:]} {r.stderr[-800:]}")
                left = n.leftovers()
                if left:
                    problems.append(f"node {n.name} left: {left}")
            for n in nodes.values():
                with contextlib.suppress(Exception):
                    remove_data_dir(n.data_dir)
            assert not problems, "\n".join(problems)

        stack.callback(stop_nodes)
        for n in nodes.values():
            n.start()
        c = Cluster(gateway, scheduler, nodes, api_key, pki, pg.url(), s3, work, extra={"gateway_env": gateway_env})
        c.wait_nodes(list(nodes))
    except BaseException:
        stack.close()
        raise
    with stack:
        # the last callbacks registered run first: nodes (gc + leftovers), gateway, scheduler, S3,
        # PostgreSQL, data dir, namespaces
        yield c
