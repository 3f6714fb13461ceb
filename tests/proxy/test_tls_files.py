"""The certificate files HAProxy serves (`agentenv.proxy.tls.prepare`)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agentenv.proxy.tls import prepare


def _self_signed(tmp: Path, name: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(f"*.{name}")]), critical=False)
            .sign(key, hashes.SHA256()))
    c, k = tmp / f"{name}.crt", tmp / f"{name}.key"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return c, k


def test_an_operator_pair_that_does_not_match_is_refused_and_the_served_file_kept(tmp_path: Path) -> None:
    cert_a, key_a = _self_signed(tmp_path, "a.test")
    cert_b, key_b = _self_signed(tmp_path, "b.test")
    files = prepare(tmp_path / "tls", "a.test", cert_a, key_a)
    served = files.pem.read_bytes()
    assert served.startswith(cert_a.read_bytes().rstrip(b"\n")) and served.endswith(key_a.read_bytes())
    # a renewal caught between writing its certificate and its key
    with pytest.raises(ValueError, match="does not belong to the key"):
        prepare(tmp_path / "tls", "a.test", cert_b, key_a)
    assert files.pem.read_bytes() == served
    with pytest.raises(ValueError, match="cannot read"):
        prepare(tmp_path / "tls", "a.test", key_b, key_b)
    assert prepare(tmp_path / "tls", "b.test", cert_b, key_b).pem.read_bytes().endswith(key_b.read_bytes())
