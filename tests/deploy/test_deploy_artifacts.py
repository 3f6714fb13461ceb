"""Deployment artefacts (deploy/, Dockerfile) checked offline: linted, validated against their
schemas, and cross-checked against the code they deploy (CLI roles, settings names).

Nothing here starts a container (tests/packaging/test_container_image.py builds and runs the image
with podman; there is no Kubernetes cluster on our machines); what can be proven offline is proven: Dockerfile lint (hadolint), Compose file against the
Compose specification, kustomize build + Kubernetes schema validation, shellcheck, the systemd
units through `systemd-analyze verify`, and `deploy/install.sh` run into a scratch root.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agentenv.cli import main as cli
from agentenv.config import Settings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BIN = Path(sys.executable).parent
K8S_VERSION = "1.30.0"


def tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is missing: scripts/setup.sh --test installs it")
    return found


def run(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)


def settings_env_names() -> set[str]:
    return {f"AGENTENV_{name.upper()}" for name in Settings.model_fields}


def check_env(names: set[str], where: str) -> None:
    unknown = sorted(n for n in names if n.startswith("AGENTENV_") and n not in settings_env_names())
    assert not unknown, f"{where} sets AGENTENV_* variables that agentenv does not read: {unknown}"


def check_role(argv: list[str], where: str) -> None:
    assert argv, f"{where}: no command"
    assert argv[0] in cli.commands, f"{where}: `agentenv {argv[0]}` is not a command ({sorted(cli.commands)})"


# ---------------------------------------------------------------- Dockerfile


def test_dockerfile_lints_clean():
    res = run(tool("hadolint"), "--no-color", str(REPO / "Dockerfile"))
    assert res.returncode == 0, res.stdout + res.stderr


def test_dockerfile_uses_setup_script_and_a_real_role():
    text = (REPO / "Dockerfile").read_text()
    assert "bash scripts/setup.sh" in text  # one host-setup path for image and bare metal
    entry = re.search(r'^ENTRYPOINT \["agentenv"\]', text, re.M)
    cmd = re.search(r"^CMD (\[.*\])", text, re.M)
    assert entry and cmd
    check_role(yaml.safe_load(cmd.group(1)), "Dockerfile CMD")
    for copied in re.findall(r"^COPY (\S+)", text, re.M):
        assert (REPO / copied).exists(), f"Dockerfile copies {copied}, which does not exist"


# ---------------------------------------------------------------- Compose


def test_compose_file_matches_the_compose_spec():
    res = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
              str(DEPLOY / "docker-compose.yml"))
    assert res.returncode == 0, res.stdout + res.stderr


def test_compose_cluster_roles_and_settings():
    doc = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = doc["services"]
    roles = {name: svc["command"][0] for name, svc in services.items()
             if svc.get("image", "").startswith("agentenv") and "entrypoint" not in svc
             and svc["command"][0] != "data-plane"}
    assert sorted(roles.values()) == ["gateway", "node", "node", "scheduler"], roles
    # HAProxy of the gateway and of each node: a component of its own beside its role
    for name, role in roles.items():
        if role == "scheduler":
            continue
        env = services[name]["environment"]
        assert env.get("AGENTENV_HAPROXY_EXTERNAL") == "true", f"{name}: its HAProxy is not the data-plane service"
        dp = services[f"{name}-data-plane"]
        check_role(dp["command"], f"compose service {name}-data-plane")
        argv = dp["command"]
        assert argv[argv.index("--role") + 1] == role, argv
        assert dp["network_mode"] == f"service:{name}", "the data plane must share its role's network"
        data_dir = env.get("AGENTENV_DATA_DIR", "/var/lib/agentenv")
        assert argv[argv.index("--data-dir") + 1] == data_dir, argv
        shared = {v.split(":")[1]: v.split(":")[0] for v in services[name]["volumes"]}
        mine = {v.split(":")[1]: v.split(":")[0] for v in dp["volumes"]}
        for path in (data_dir, "/tmp", "/etc/agentenv/pki"):  # config, maps; the sockets; the cluster CA
            assert shared.get(path) and mine.get(path) == shared[path], (name, path, shared, mine)
    res = run(str(BIN / "agentenv"), "data-plane", "--help")
    assert res.returncode == 0 and all(o in res.stdout for o in ("--role", "--port", "--data-dir")), res.stdout
    # the one-shot pki job: the cluster CA and a certificate for each role, with the real CLI
    pki = services["pki"]["command"][0]
    assert "agentenv cluster ca init" in pki and pki.count("cert --role") == 4, pki
    res = run(str(BIN / "agentenv"), "cluster", "cert", "--help")
    assert res.returncode == 0 and all(o in res.stdout for o in ("--ca-dir", "--role", "--host", "--days")), res.stdout
    for name, svc in services.items():
        if name in roles:
            check_role(svc["command"], f"compose service {name}")
            check_env(set(svc.get("environment", {})), f"compose service {name}")
            if roles[name] == "node":
                assert svc.get("privileged") is True, f"{name}: node agents need a privileged container"
    node_urls = {services[n]["environment"]["AGENTENV_NODE_URL"] for n in roles if roles[n] == "node"}
    assert len(node_urls) == 2, "each node advertises its own URL"
    assert {"postgres", "s3"} <= set(services)


# ---------------------------------------------------------------- Kubernetes


def kustomize(path: Path) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed on this host")
    res = run("kubectl", "kustomize", str(path))
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


@pytest.mark.parametrize("overlay", ["base", "overlays/dev"])
def test_kustomize_builds_valid_manifests(overlay, tmp_path):
    docs = kustomize(DEPLOY / "k8s" / overlay)
    out = tmp_path / "manifests.yaml"
    out.write_text(yaml.safe_dump_all(docs))
    res = run(tool("kubernetes-validate"), "-k", K8S_VERSION, "--strict", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Deployment", "agentenv-gateway"), ("Service", "agentenv-gateway"),
            ("Deployment", "agentenv-scheduler"), ("DaemonSet", "agentenv-node")} <= kinds


def test_kubernetes_workloads_match_the_code():
    docs = kustomize(DEPLOY / "k8s" / "overlays" / "dev")
    config = {k for d in docs if d["kind"] in ("ConfigMap", "Secret")
              for k in (d.get("data") or {}) | (d.get("stringData") or {})}
    check_env(config, "ConfigMap/Secret")
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "DaemonSet")}
    for name in ("agentenv-gateway", "agentenv-scheduler", "agentenv-node"):
        containers = workloads[name]["spec"]["template"]["spec"]["containers"]
        for container in containers:
            check_role(container["args"], f"{name}/{container['name']}")
            check_env({e["name"] for e in container.get("env", [])}, name)
        if name == "agentenv-scheduler":
            assert len(containers) == 1
            continue
        # HAProxy: a container of its own in the role's pod (same network), sharing its data dir and /tmp
        role, dp = containers[0], next(c for c in containers if c["name"] == "data-plane")
        assert {"name": "AGENTENV_HAPROXY_EXTERNAL", "value": "true"} in role["env"], name
        assert dp["args"][:3] == ["data-plane", "--role", role["args"][0]], dp["args"]
        data_dir = next(e["value"] for e in role["env"] if e["name"] == "AGENTENV_DATA_DIR")
        assert {"name": "AGENTENV_DATA_DIR", "value": data_dir} in dp["env"], name
        role_mounts = {m["mountPath"]: m["name"] for m in role["volumeMounts"]}
        dp_mounts = {m["mountPath"]: m["name"] for m in dp["volumeMounts"]}
        for path in (data_dir, "/tmp", "/etc/agentenv/pki"):
            assert role_mounts.get(path) and dp_mounts.get(path) == role_mounts[path], (name, path)
    node = workloads["agentenv-node"]["spec"]["template"]["spec"]
    agent = node["containers"][0]
    assert agent["securityContext"]["privileged"] is True
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    assert mounts["/run/netns"]["mountPropagation"] == "Bidirectional"
    data = next(v for v in node["volumes"] if v["name"] == mounts["/var/lib/agentenv"]["name"])
    assert data["hostPath"]["path"] == "/var/lib/agentenv"
    # graceful drain: the preStop hook is a real CLI invocation and the grace period covers it
    pre_stop = agent["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "agentenv"
    check_role(pre_stop[1:], "node preStop")
    res = run(str(BIN / "agentenv"), *pre_stop[1:2], "--help")
    assert res.returncode == 0 and all(opt in res.stdout for opt in pre_stop[2:]), res.stdout + res.stderr
    assert node["terminationGracePeriodSeconds"] >= 120
    gw = workloads["agentenv-gateway"]["spec"]["template"]["spec"]
    assert gw["securityContext"]["runAsNonRoot"] is True  # gateway runs unprivileged


# ---------------------------------------------------------------- systemd + install.sh


def test_shell_scripts_pass_shellcheck():
    scripts = [DEPLOY / "install.sh", *sorted((REPO / "scripts").glob("*.sh")), REPO / ".ci" / "run"]
    res = run(tool("shellcheck"), "-x", *map(str, scripts))
    assert res.returncode == 0, res.stdout + res.stderr


def install(root: Path, *args: str) -> subprocess.CompletedProcess:
    res = run("bash", str(DEPLOY / "install.sh"), "--prefix", str(root), "--skip-setup", *args)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def env_file(root: Path) -> dict[str, str]:
    lines = (root / "etc/agentenv/agentenv.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def test_install_writes_units_and_config_idempotently(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed on this host")
    res = install(tmp_path, "--role", "all", "--role", "node", "--role", "gateway", "--role", "scheduler",
                  "--database-url", "postgresql://db.example/agentenv")
    env = env_file(tmp_path)
    check_env(set(env), "agentenv.env")
    key = env["AGENTENV_BOOTSTRAP_API_KEY"]
    assert re.fullmatch(r"e2b_[0-9a-f]{40}", key)
    assert re.fullmatch(r"[0-9a-f]{64}", env["AGENTENV_CLUSTER_TOKEN"])
    assert f"E2B_API_KEY={key}" in res.stdout
    mode = stat.S_IMODE((tmp_path / "etc/agentenv/agentenv.env").stat().st_mode)
    assert mode == 0o600, oct(mode)

    units = sorted((tmp_path / "etc/systemd/system").glob("*.service"))
    assert [u.name for u in units] == ["agentenv-gateway.service", "agentenv-node.service",
                                       "agentenv-scheduler.service", "agentenv.service"]
    for unit in units:
        text = unit.read_text()
        assert "@" not in text.replace("@.service", ""), f"unfilled placeholder in {unit.name}"
        exec_start = re.search(r"^ExecStart=(\S+) (\S+)$", text, re.M)
        assert exec_start and os.access(exec_start.group(1), os.X_OK)
        check_role([exec_start.group(2)], unit.name)
        check_env(set(re.findall(r"^Environment=(\w+)=", text, re.M)), unit.name)
        res = run("systemd-analyze", "verify", str(unit))
        assert res.returncode == 0, f"{unit.name}: {res.stdout}{res.stderr}"

    # Second run: keeps the generated secrets, updates only the options given now.
    install(tmp_path, "--port", "3100")
    again = env_file(tmp_path)
    assert again["AGENTENV_BOOTSTRAP_API_KEY"] == key
    assert again["AGENTENV_CLUSTER_TOKEN"] == env["AGENTENV_CLUSTER_TOKEN"]
    assert again["AGENTENV_PORT"] == "3100"
    assert again["AGENTENV_DATABASE_URL"] == "postgresql://db.example/agentenv"


def test_install_rejects_bad_input(tmp_path):
    res = run("bash", str(DEPLOY / "install.sh"), "--prefix", str(tmp_path), "--skip-setup", "--role", "bogus")
    assert res.returncode != 0 and "unknown role 'bogus'" in res.stderr
    assert not (tmp_path / "etc").exists()


# ---------------------------------------------------------------- Prometheus


@pytest.mark.parametrize("name", ["static.yml", "kubernetes.yml"])
def test_prometheus_examples_scrape_every_role(name):
    """One job per role; schedulers and nodes over mutual TLS with a certificate whose role may read
    /metrics; the Kubernetes jobs keep the pods of the deploy/k8s workloads."""
    from agentenv.cluster import tls

    doc = yaml.safe_load((DEPLOY / "prometheus" / name).read_text())
    jobs = {j["job_name"]: j for j in doc["scrape_configs"]}
    assert set(jobs) == {"agentenv-gateway", "agentenv-scheduler", "agentenv-node"}
    assert "admin" in tls.allowed_roles("/metrics")
    for role in ("scheduler", "node"):
        job = jobs[f"agentenv-{role}"]
        assert job["scheme"] == "https" and {"ca_file", "cert_file", "key_file"} <= set(job["tls_config"]), job
    if name == "kubernetes.yml":
        names = {d["metadata"]["name"] for d in kustomize(DEPLOY / "k8s" / "base")}
        for job_name, job in jobs.items():
            keep = [r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"
                    and r["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_name"]]
            assert keep == [job_name] and job_name in names, job
