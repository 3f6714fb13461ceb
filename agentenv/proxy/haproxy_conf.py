"""The HAProxy configuration of the data plane (docs/proxy.md, "The data plane").

HAProxy owns the public listener(s). A request addressed to a running sandbox that HAProxy can serve
by itself (its id is in the routes map, and a private sandbox's traffic token matches) goes straight
to the sandbox: `set-dst`/`set-dst-port` on a `server 0.0.0.0:0`. Everything else -- the control
API, unknown or paused sandboxes (wake on traffic), a missing or wrong token, signed `/files` URLs on
the API host, malformed routing -- goes to the server's Python listener on a unix socket, which
answers exactly as it does without HAProxy.

The maps are files HAProxy loads at start; agentenv keeps them current through the runtime API
(`agentenv.proxy.haproxy.RouteTable`), never by a reload.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agentenv.constants import ENVD_PORT
from agentenv.proxy.hostfiles import MIN_BYTES


@dataclass(frozen=True)
class HaproxyLayout:
    """Where the data plane's files live (`dir` under the data dir, `sock_dir` short for unix sockets)."""

    dir: Path
    sock_dir: Path

    @property
    def config(self) -> Path:
        return self.dir / "haproxy.cfg"

    @property
    def routes_map(self) -> Path:  # sandbox id -> host ip of its slot
        return self.dir / "routes.map"

    @property
    def tokens_map(self) -> Path:  # sandbox id -> traffic access token (private sandboxes only)
        return self.dir / "tokens.map"

    @property
    def nodes_map(self) -> Path:  # a cluster gateway's: node id -> "<ip>/<port>/<name to verify>"
        return self.dir / "nodes.map"

    @property
    def admin_socket(self) -> Path:  # the runtime API
        return self.sock_dir / "admin.sock"

    @property
    def app_socket(self) -> Path:  # the server's aiohttp listener (control API + fallback proxy)
        return self.sock_dir / "app.sock"


def _q(text: str) -> str:
    """A double-quoted HAProxy argument."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _error_body(message: str) -> str:
    return _q('{"sandboxId":"%[var(txn.sid)]","message":"' + message.replace('"', "'") + '","code":502}')


@dataclass(frozen=True)
class ClusterListener:
    """A cluster node's listener: mutual TLS with the cluster CA instead of plain HTTP.

    HAProxy verifies a client certificate when one is presented (a wrong one fails the handshake,
    none reaches the Python server, which refuses all but /health, as the node does without HAProxy).
    Only a certificate whose role (its subject's OU) is in `roles` may use the fast path; the Python
    server learns the verified role and name from `PEER_HEADER`, which HAProxy alone sets."""

    pem: Path                 # the node's certificate and key, one file
    ca: Path                  # the cluster CA
    roles: tuple[str, ...]    # roles whose certificates may reach sandboxes


PEER_HEADER = "X-Agentenv-Cluster-Peer"
# The scheme the client used (https when HAProxy terminated TLS): set by HAProxy alone, for the
# server's absolute URLs (`public_scheme`).
SCHEME_HEADER = "X-Agentenv-Scheme"


def public_scheme(request) -> str:
    """The scheme a client reached the server with: HAProxy's word for a request it passed on over
    the unix socket, else the connection's own."""
    if isinstance(request.transport.get_extra_info("sockname") if request.transport else None, str):
        given = request.headers.get(SCHEME_HEADER)
        if given in ("http", "https"):
            return given
    return request.scheme


@dataclass(frozen=True)
class NodeHop:
    """A cluster gateway's data plane: sandbox traffic goes to the node that runs the sandbox.

    The routes map holds sandbox id -> node id, the nodes map node id -> "<ip>/<port>/<name>" of the
    node's listener; the request goes there unchanged (the node's own HAProxy routes it into the
    sandbox and checks a private sandbox's token). With cluster TLS (`pem`, `ca`) the hop is mutual
    TLS: the gateway's certificate, and the node's verified against the cluster CA *and* <name> (the
    SNI: the node's host name, or its id, which a certificate without host names carries as CN), so a
    request never reaches another node than the one the map names. Connections are reused per node
    (HAProxy keys them by address and SNI)."""

    pem: Path | None          # the gateway's certificate and key, one file (None: plain HTTP hop)
    ca: Path | None           # the cluster CA


def _public_binds(http_bind: str | None, https_bind: str | None, cert: Path | None,
                  cluster: ClusterListener | None) -> list[str]:
    binds = []
    if http_bind and cluster is not None:
        binds.append(f"    bind {http_bind} ssl crt {cluster.pem} ca-file {cluster.ca} verify optional")
    elif http_bind:
        binds.append(f"    bind {http_bind}")
    if https_bind:
        assert cert is not None
        binds.append(f"    bind {https_bind} ssl crt {cert} alpn h2,http/1.1")
    return binds


def render(layout: HaproxyLayout, *, http_bind: str | None, https_bind: str | None,
           cert: Path | None, threads: int, cluster: ClusterListener | None = None,
           hop: NodeHop | None = None, host_reads: bool = False) -> str:
    """The whole configuration. `http_bind`/`https_bind`: "addr:port" (or None for none);
    `cluster`: the `http_bind` listener speaks mutual TLS (a cluster node's); `hop`: a cluster
    gateway's, whose fast path leads to the sandbox's node instead of into the sandbox; `host_reads`:
    downloads from envd, and uploads of at least `MIN_BYTES`, go to the server, which sends large
    downloads from the host and stages the uploads there (`hostfiles`)."""
    return "\n".join([
        "# Written by agentenv at every start; edits are lost (agentenv/proxy/haproxy_conf.py).",
        "global",
        f"    nbthread {threads}",
        f"    stats socket {layout.admin_socket} mode 600 level admin",
        "    stats timeout 1h",
        "    hard-stop-after 5s",
        "    ssl-default-bind-options ssl-min-ver TLSv1.2",
        "    ssl-default-server-options ssl-min-ver TLSv1.2",
        "    tune.ssl.default-dh-param 2048",
        "",
        "defaults",
        "    mode http",
        "    timeout connect 5s",
        # Started responses never time out (long polls, SSE, downloads), as in the Python proxy.
        "    timeout client 24h",
        "    timeout server 24h",
        "    timeout tunnel 24h",
        "    timeout http-request 60s",
        "    timeout http-keep-alive 75s",
        "    timeout client-fin 5s",
        "    timeout server-fin 1s",
        "",
        "frontend agentenv",
        *_public_binds(http_bind, https_bind, cert, cluster),
        f"    http-request del-header {PEER_HEADER}",
        *_peer_rules(cluster),
        # -- which sandbox and port: E2b-Sandbox-Id/-Port headers, else the Host, else a /proxy/ path
        "    acl by_hdr req.hdr(e2b-sandbox-id) -m found",
        "    http-request set-var(txn.sid) req.hdr(e2b-sandbox-id) if by_hdr",
        "    http-request set-var(txn.port) req.hdr(e2b-sandbox-port) if by_hdr { req.hdr(e2b-sandbox-port) -m found }",
        f"    http-request set-var(txn.port) str({ENVD_PORT}) if by_hdr !{{ req.hdr(e2b-sandbox-port) -m found }}",
        "    http-request set-var(txn.label) req.hdr(host),field(1,:),lower,field(1,.) if !by_hdr",
        "    acl by_host var(txn.label) -m reg ^[0-9]{1,5}-[a-z0-9]+$",
        "    http-request set-var(txn.port) var(txn.label),field(1,-) if !by_hdr by_host",
        "    http-request set-var(txn.sid) var(txn.label),field(2,-) if !by_hdr by_host",
        "    acl by_path path -m reg ^/proxy/[a-z0-9]+/[0-9]{1,5}(/|$)",
        "    http-request set-var(txn.sid) path,field(3,/) if !by_hdr !by_host by_path",
        "    http-request set-var(txn.port) path,field(4,/) if !by_hdr !by_host by_path",
        "    http-request set-var(txn.prefixed) bool(true) if !by_hdr !by_host by_path",
        "    acl port_ok var(txn.port) -m reg ^[1-9][0-9]{0,4}$",
        "    acl port_ok_range var(txn.port) -m int 1:65535",
        "    http-request set-header X-Forwarded-Proto https if { ssl_fc } !{ req.hdr(x-forwarded-proto) -m found }",
        "    http-request set-header X-Forwarded-Proto http if !{ ssl_fc } !{ req.hdr(x-forwarded-proto) -m found }",
        "    http-request set-header X-Forwarded-Host %[req.hdr(host)] if { req.hdr(host) -m found } "
        "!{ req.hdr(x-forwarded-host) -m found }",
        "    option forwardfor",
        # -- can HAProxy serve it by itself?
        *(_to_node(layout) if hop is not None else _into_sandbox(layout, cluster, host_reads)),
        "    default_backend python",
        "",
        *(_node_backend(hop) if hop is not None else
          [line for name in SANDBOX_BACKENDS for line in _sandbox_backend(name)]),
        "backend python",
        # Large bodies from the server (downloads sent from the host, `hostfiles`) move by splice(2)
        # instead of through HAProxy's 16 KiB buffers: a 64 MiB download 90-120 -> 64-84 ms here.
        "    option splice-response",
        f"    http-request set-header {SCHEME_HEADER} https if {{ ssl_fc }}",
        f"    http-request set-header {SCHEME_HEADER} http if !{{ ssl_fc }}",
        *([f"    http-request set-header {PEER_HEADER} %[var(txn.peer)] if {{ var(txn.peer) -m found }}"]
          if cluster is not None else []),
        # The server itself down (crashed, restarting: HAProxy keeps the sandboxes' traffic going
        # meanwhile): the API's callers get JSON errors too, not HAProxy's HTML pages.
        *_server_errors(),
        f"    server app unix@{layout.app_socket}",
        "",
    ])


def _server_errors() -> list[str]:
    """HAProxy's own errors for requests the Python server should have answered, as E2B's JSON."""
    def body(status: int, message: str) -> str:
        return _q('{"code":%d,"message":"%s"}' % (status, message))
    return [
        "    http-error status 503 content-type application/json hdr retry-after 2 lf-string "
        + body(503, "The agentenv server is not answering (it may be restarting); retry shortly"),
        "    http-error status 502 content-type application/json hdr retry-after 2 lf-string "
        + body(502, "The agentenv server closed the connection before answering (it may have restarted); retry"),
        "    http-error status 504 content-type application/json lf-string "
        + body(504, "The agentenv server did not answer in time"),
    ]


def _into_sandbox(layout: HaproxyLayout, cluster: ClusterListener | None, host_reads: bool) -> list[str]:
    """`serve` and a node: a running sandbox's slot address, and a private one's token checked."""
    routes, tokens = layout.routes_map, layout.tokens_map
    return [
        f"    http-request set-var(txn.ip) var(txn.sid),map({routes}) if {{ var(txn.sid) -m found }}",
        f"    http-request set-var(txn.tok) var(txn.sid),map({tokens}) if {{ var(txn.ip) -m found }}",
        "    acl routed var(txn.ip) -m found",
        "    acl private var(txn.tok) -m found",
        f"    acl envd var(txn.port) -m str {ENVD_PORT}",
        "    acl token_ok req.hdr(e2b-traffic-access-token),secure_memcmp(txn.tok)",
        "    acl jupyter var(txn.port) -m str 49999",
        *(["    use_backend python if !peer_ok"] if cluster is not None else []),
        "    use_backend python if private !envd !token_ok",
        *(["    acl files_path path /files",
           "    acl download method GET",
           "    acl upload method POST",
           f"    acl big_body req.hdr_val(content-length) ge {MIN_BYTES}",
           "    use_backend python if routed envd files_path download",
           "    use_backend python if routed envd files_path upload big_body"] if host_reads else []),
        "    use_backend sandbox_envd if routed port_ok port_ok_range envd",
        "    use_backend sandbox_jupyter if routed port_ok port_ok_range jupyter",
        "    use_backend sandbox_user if routed port_ok port_ok_range",
    ]


def _to_node(layout: HaproxyLayout) -> list[str]:
    """A gateway: the node that runs the sandbox, and that node's listener address."""
    return [
        f"    http-request set-var(txn.node) var(txn.sid),map({layout.routes_map}) if {{ var(txn.sid) -m found }}",
        f"    http-request set-var(txn.dst) var(txn.node),map({layout.nodes_map}) if {{ var(txn.node) -m found }}",
        "    acl routed var(txn.dst) -m found",
        "    use_backend node_hop if routed port_ok port_ok_range",
    ]


def _peer_rules(cluster: ClusterListener | None) -> list[str]:
    """Who is calling a node: "<role>/<name>" of a verified client certificate, in `txn.peer`."""
    if cluster is None:
        return []
    roles = " ".join(cluster.roles)
    return [
        "    http-request set-var(txn.peer_cn) ssl_c_s_dn(CN) if { ssl_c_used } { ssl_c_verify 0 }",
        "    http-request set-var(txn.peer) ssl_c_s_dn(OU),concat(/,txn.peer_cn) if { var(txn.peer_cn) -m found }",
        f"    acl peer_ok var(txn.peer),field(1,/) -m str {roles}",
    ]


# One backend per kind of port (envd, Jupyter, the user's), identical but for their statistics:
# the server's metrics (`agentenv_proxy_*{port=...}`) are read from them.
SANDBOX_BACKENDS = {"sandbox_envd": "envd", "sandbox_jupyter": "jupyter", "sandbox_user": "user"}


def _sandbox_backend(name: str) -> list[str]:
    return [
        f"backend {name}",
        # Connections into a sandbox close with a reset (no TIME_WAIT inside it: gVisor could not
        # checkpoint it); idle ones are dropped after a second or so.
        "    option nolinger",
        "    http-reuse always",
        "    retries 2",
        "    retry-on conn-failure empty-response",
        "    http-request set-dst var(txn.ip)",
        "    http-request set-dst-port var(txn.port)",
        "    http-request set-header X-Forwarded-Prefix /proxy/%[var(txn.sid)]/%[var(txn.port)] if { var(txn.prefixed) -m found }",
        "    http-request set-path %[path,regsub(^/proxy/[a-z0-9]+/[0-9]+/?,/)] if { var(txn.prefixed) -m found }",
        # The API key is never a data-plane credential; the traffic and host tokens are ours.
        "    http-request del-header x-api-key",
        "    http-request del-header e2b-traffic-access-token",
        "    http-request del-header x-agentenv-host-token",
        f"    http-request del-header {SCHEME_HEADER}",
        r"    http-request del-header authorization if { req.hdr(authorization) -m reg -i ^(bearer\s+)?e2b_[0-9a-f]+\s*$ }",
        # HAProxy's own errors as the JSON bodies the SDKs key on ("port is not open", ...).
        *_json_errors("The sandbox is running but port is not open"),
        "    server sandbox 0.0.0.0:0 pool-purge-delay 1s",
        "",
    ]


def _json_errors(unreachable: str) -> list[str]:
    """HAProxy's own errors as JSON bodies, all 502 (`unreachable`: when it could not connect)."""
    return [
        "    http-error status 503 content-type application/json hdr x-agentenv-error 1 lf-string "
        + _error_body(unreachable),
        "    http-error status 502 content-type application/json hdr x-agentenv-error 1 lf-string "
        + _error_body("The connection to the sandbox closed before a response was received"),
        "    http-error status 504 content-type application/json hdr x-agentenv-error 1 lf-string "
        + _error_body("The sandbox did not answer in time"),
        "    http-after-response set-status 502 reason 'Bad Gateway' if { status 503 } { res.hdr(x-agentenv-error) -m found }",
        "    http-after-response del-header x-agentenv-error",
    ]


def _node_backend(hop: NodeHop) -> list[str]:
    tls = (f" ssl verify required ca-file {hop.ca} crt {hop.pem} sni var(txn.dst),field(3,/)"
           if hop.pem is not None and hop.ca is not None else "")
    return [
        "backend node_hop",
        "    http-reuse always",
        "    retries 2",
        "    retry-on conn-failure empty-response",
        "    http-request set-dst var(txn.dst),field(1,/)",
        "    http-request set-dst-port var(txn.dst),field(2,/)",
        # The node answers a request for a sandbox it no longer runs (paused, moved, killed) itself;
        # HAProxy answers for a node it cannot reach.
        *_json_errors("The node of the sandbox is not responding; retry later"),
        f"    server node 0.0.0.0:0{tls} pool-purge-delay 1s",
        "",
    ]
