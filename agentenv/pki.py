"""Certificates with the `cryptography` library: the one place agentenv makes keys, CAs and leaves.

Two users: the data plane's local CA and wildcard certificate (proxy/tls.py) and the cluster CA with
its role certificates for internal mutual TLS (cluster/tls.py). Keys are EC P-256; private keys are
written 0600 and atomically (a reader never sees half a key).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path
from typing import Any


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` with mode 0600, atomically (through a temp file and a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_public(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def new_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def pem_key(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def pem_cert(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def load_ca(cert_pem: Path, key_pem: Path) -> tuple[Any, Any]:
    """(certificate, private key) of a CA from its PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    return (x509.load_pem_x509_certificate(cert_pem.read_bytes()),
            serialization.load_pem_private_key(key_pem.read_bytes(), password=None))


def san_entries(hosts: list[str] | tuple[str, ...]) -> list[Any]:
    """subjectAltName entries: IP addresses as IPAddress, everything else as DNSName."""
    from cryptography import x509

    out: list[Any] = []
    for h in hosts:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def self_signed_ca(subject: list[tuple[Any, str]], *, days: int, backdate: dt.timedelta) -> tuple[Any, Any]:
    """A new CA (key, certificate): `subject` as (NameOID, value) pairs, valid from now - `backdate`
    (clock skew between machines) for `days`; it may sign leaves only (path length 0)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    key = new_key()
    name = x509.Name([x509.NameAttribute(oid, value) for oid, value in subject])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - backdate)
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def leaf(ca_cert: Any, ca_key: Any, subject: list[tuple[Any, str]], *, sans: list[Any], usages: list[Any],
         days: int, backdate: dt.timedelta) -> tuple[Any, Any]:
    """A new end-entity (key, certificate) signed by the CA, for the extended key `usages`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    key = new_key()
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(oid, value) for oid, value in subject]))
               .issuer_name(ca_cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - backdate)
               .not_valid_after(now + dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())
