"""The cluster's certificates without a cluster: `agentenv cluster ca init` / `cluster cert` write
what the roles need (role in the OU, names, both usages, short validity, private keys 0600), a CA is
never overwritten, and a listener picks up a renewed certificate without a restart (`Reloader`)."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import ssl
import subprocess

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agentenv.cluster import tls
from agentenv.config import Settings
from serverproc import agentenv_executable


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([agentenv_executable(), "cluster", *args], capture_output=True, text=True, timeout=60)


def test_ca_and_role_certificates(tmp_path):
    ca = tmp_path / "ca"
    assert cli("ca", "init", "--dir", str(ca)).returncode == 0
    again = cli("ca", "init", "--dir", str(ca))
    assert again.returncode != 0 and "exists" in again.stderr
    r = cli("cert", "--ca-dir", str(ca), "--role", "node", "--name", "n1", "--host", "10.0.0.7", "--host", "n1.local",
            "--out", str(tmp_path / "out"), "--stem", "tls")
    assert r.returncode == 0, r.stderr
    assert cli("cert", "--ca-dir", str(ca), "--role", "node", "--out", str(tmp_path)).returncode != 0  # no --name
    for key in (ca / "ca.key", tmp_path / "out" / "tls.key"):
        assert key.stat().st_mode & 0o777 == 0o600
    cert = x509.load_pem_x509_certificate((tmp_path / "out" / "tls.crt").read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "n1"
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == "node"
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(i) for i in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    assert sans.get_values_for_type(x509.DNSName) == ["n1.local"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert cert.not_valid_after_utc - cert.not_valid_before_utc <= dt.timedelta(days=7, minutes=5)


def test_a_renewed_certificate_is_served_without_a_restart(tmp_path):
    tls.create_ca(tmp_path / "ca")
    crt, key = tls.issue_cert(tmp_path / "ca", "scheduler", "s", tmp_path, hosts=["127.0.0.1"])
    settings = Settings(cluster_ca_file=tmp_path / "ca" / "ca.crt", cluster_cert_file=crt, cluster_key_file=key)
    server_ctx = tls.server_context(settings)
    reloader = tls.Reloader(settings, server_ctx)

    async def serial_seen() -> int:
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        client = ssl.create_default_context(cafile=str(settings.cluster_ca_file))
        try:
            _r, w = await asyncio.open_connection("127.0.0.1", port, ssl=client)
            der = w.get_extra_info("ssl_object").getpeercert(binary_form=True)
            w.close()
            return x509.load_der_x509_certificate(der).serial_number
        finally:
            server.close()

    first = asyncio.run(serial_seen())
    assert not reloader.check()  # unchanged files: nothing to do
    tls.issue_cert(tmp_path / "ca", "scheduler", "s", tmp_path, hosts=["127.0.0.1"])
    os.utime(crt, (crt.stat().st_atime, crt.stat().st_mtime + 5))  # a renewal within the same second
    assert reloader.check()
    renewed = x509.load_pem_x509_certificate(crt.read_bytes()).serial_number
    assert asyncio.run(serial_seen()) == renewed != first
