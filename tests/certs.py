"""Throw-away X.509 material for TLS tests: a CA, a server certificate for
127.0.0.1/localhost, and client certificates (one signed by the CA, one not)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class PKI:
    ca: Path
    server: Pair
    client: Pair  # common name "coordinator"
    rogue_client: Pair  # signed by a different CA
    other_client: Pair  # signed by the CA, common name "intruder": valid, but not the coordinator


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, cert, key) -> Pair:
    cert_path, key_path = path.with_suffix(".crt"), path.with_suffix(".key")
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return Pair(cert_path, key_path)


def _ca(name: str):
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(ca_cert, ca_key, name: str, usage, dns: tuple[str, ...] = ("localhost",)):
    key = _key()
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [*(x509.DNSName(d) for d in dns), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def make_pki(folder: Path) -> PKI:
    folder.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = _ca("specserve test CA")
    ca_path = folder / "ca.crt"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    server = _write(folder / "server", *_leaf(ca_cert, ca_key, "localhost", ExtendedKeyUsageOID.SERVER_AUTH))
    client = _write(
        folder / "client", *_leaf(ca_cert, ca_key, "coordinator", ExtendedKeyUsageOID.CLIENT_AUTH)
    )
    rogue_ca, rogue_key = _ca("rogue CA")
    rogue = _write(folder / "rogue", *_leaf(rogue_ca, rogue_key, "rogue", ExtendedKeyUsageOID.CLIENT_AUTH))
    other = _write(
        folder / "other", *_leaf(ca_cert, ca_key, "intruder", ExtendedKeyUsageOID.CLIENT_AUTH, dns=("intruder",))
    )
    return PKI(ca=ca_path, server=server, client=client, rogue_client=rogue, other_client=other)
