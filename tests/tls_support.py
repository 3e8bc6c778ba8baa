"""Test certificates, made at test time with `cryptography` (no private key is ever committed).

A CA, a server certificate for 127.0.0.1/localhost (serverAuth and clientAuth, as a split-job peer presents it
to other servers too), a client certificate, and a rogue CA with its own client certificate.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())  # fast to make, unlike RSA


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Certificate | None,
          issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool = False, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name)
               .issuer_name(issuer.subject if issuer is not None else name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                      content_commitment=False, key_encipherment=False,
                                                      data_encipherment=False, key_agreement=False,
                                                      encipher_only=False, decipher_only=False), critical=True)
    else:
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@dataclass(frozen=True)
class Certs:
    """PEM files in a directory."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path
    rogue_client_cert: Path
    rogue_client_key: Path


def make_certs(directory: Path) -> Certs:
    """Write a fresh CA, server and client certificates (and a rogue CA's) under ``directory``."""
    files: dict[str, bytes] = {}
    ca_key, rogue_key = _key(), _key()
    ca = _cert("deepco test CA", ca_key, None, ca_key, ca=True)
    rogue = _cert("rogue CA", rogue_key, None, rogue_key, ca=True)
    files["ca"] = ca.public_bytes(serialization.Encoding.PEM)
    files["rogue_ca"] = rogue.public_bytes(serialization.Encoding.PEM)
    for label, issuer, issuer_key, server in (("server", ca, ca_key, True), ("client", ca, ca_key, False),
                                              ("rogue_client", rogue, rogue_key, False)):
        key = _key()
        files[f"{label}_cert"] = _cert(f"deepco {label}", key, issuer, issuer_key,
                                       server=server).public_bytes(serialization.Encoding.PEM)
        files[f"{label}_key"] = _pem_key(key)
    paths = {}
    for label, data in files.items():
        path = directory / f"{label}.pem"
        path.write_bytes(data)
        paths[label] = path
    return Certs(**paths)
