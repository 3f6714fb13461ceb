"""TLS material for the data plane: the operator's wildcard certificate, or a local CA of our own.

With `tls_cert`/`tls_key` set, those are used as they are (a certificate for `*.<domain>` and
`<domain>`, e.g. from Let's Encrypt's DNS-01 challenge). Without them, agentenv creates on first
start a local CA (`<data_dir>/tls/ca.pem`, its key next to it, mode 600) and a certificate for
`<domain>` and `*.<domain>` signed by it, renewed when the domain changes or it nears expiry. Clients
trust `ca.pem` (SSL_CERT_FILE, NODE_EXTRA_CA_CERTS, curl --cacert, the OS store).

HAProxy reads one PEM with the chain and the key (`haproxy.pem`). `prepare` runs again while the
server runs (`dataplane.CertificateWatch`: every minute and on SIGHUP), and a PEM that changed (a
renewed operator certificate, a local leaf near expiry) goes to HAProxy through its runtime API.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from agentenv import pki

CA_DAYS = 3650
LEAF_DAYS = 397
RENEW_BEFORE = dt.timedelta(days=30)


@dataclass(frozen=True)
class TlsFiles:
    pem: Path              # chain + key, for HAProxy
    ca: Path | None        # the local CA clients must trust (None: an operator's certificate)


def prepare(tls_dir: Path, domain: str, cert: Path | None = None, key: Path | None = None) -> TlsFiles:
    """The PEM HAProxy serves: from the operator's files, or from the local CA (created if needed)."""
    tls_dir.mkdir(parents=True, exist_ok=True)
    pem = tls_dir / "haproxy.pem"
    if cert is not None or key is not None:
        if cert is None or key is None:
            raise ValueError("tls_cert and tls_key go together")
        chain, private = cert.read_bytes(), key.read_bytes()
        _check_pair(chain, private, cert, key)  # e.g. a renewal caught between its two files
        _write_if_changed(pem, chain.rstrip(b"\n") + b"\n" + private)
        return TlsFiles(pem, None)
    ca_pem, ca_key = tls_dir / "ca.pem", tls_dir / "ca.key"
    if not (ca_pem.exists() and ca_key.exists()):
        _new_ca(ca_pem, ca_key)
    leaf, leaf_key = tls_dir / "server.pem", tls_dir / "server.key"
    if not _leaf_ok(leaf, domain):
        _new_leaf(ca_pem, ca_key, leaf, leaf_key, domain)
    _write_if_changed(pem, leaf.read_bytes() + ca_pem.read_bytes() + leaf_key.read_bytes())
    return TlsFiles(pem, ca_pem)


def _write_if_changed(path: Path, data: bytes) -> None:
    """`prepare` runs every minute while the server runs: the PEM is rewritten only when it changes."""
    try:
        if path.read_bytes() == data:
            return
    except FileNotFoundError:
        pass
    pki.write_private(path, data)


def _check_pair(chain: bytes, private: bytes, cert: Path, key: Path) -> None:
    """The chain's first certificate must be the key's (ValueError with the files' names if not)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        leaf = x509.load_pem_x509_certificate(chain)
        key_obj = serialization.load_pem_private_key(private, password=None)
    except (ValueError, TypeError) as e:
        raise ValueError(f"cannot read {cert} / {key}: {e}") from e
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    if leaf.public_key().public_bytes(serialization.Encoding.DER, spki) != \
            key_obj.public_key().public_bytes(serialization.Encoding.DER, spki):
        raise ValueError(f"the certificate {cert} does not belong to the key {key}")


def _names(domain: str) -> list:
    from cryptography import x509

    host = domain.split(":", 1)[0]
    names: list = [x509.DNSName(host), x509.DNSName(f"*.{host}")]
    if host == "localhost":
        names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    return names


def _leaf_ok(path: Path, domain: str) -> bool:
    from cryptography import x509

    if not path.exists():
        return False
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    wanted = {f"*.{domain.split(':', 1)[0]}"}
    fresh = cert.not_valid_after_utc - dt.datetime.now(dt.timezone.utc) > RENEW_BEFORE
    return fresh and wanted <= set(san.get_values_for_type(x509.DNSName))


def _new_ca(ca_pem: Path, ca_key: Path) -> None:
    from cryptography.x509.oid import NameOID

    key, cert = pki.self_signed_ca([(NameOID.COMMON_NAME, "agentenv local CA"),
                                    (NameOID.ORGANIZATION_NAME, "agentenv")],
                                   days=CA_DAYS, backdate=dt.timedelta(hours=1))
    pki.write_private(ca_key, pki.pem_key(key))
    pki.write_public(ca_pem, pki.pem_cert(cert))


def _new_leaf(ca_pem: Path, ca_key: Path, leaf: Path, leaf_key: Path, domain: str) -> None:
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca, ca_private = pki.load_ca(ca_pem, ca_key)
    key, cert = pki.leaf(ca, ca_private, [(NameOID.COMMON_NAME, f"*.{domain.split(':', 1)[0]}")],
                         sans=_names(domain), usages=[ExtendedKeyUsageOID.SERVER_AUTH],
                         days=LEAF_DAYS, backdate=dt.timedelta(hours=1))
    pki.write_private(leaf_key, pki.pem_key(key))
    pki.write_public(leaf, pki.pem_cert(cert))
