"""Test PKI made at test time with `cryptography`: a CA, a server certificate for 127.0.0.1/localhost, a client
certificate it signed, and a client certificate from an unrelated CA (which a mutual-TLS server must refuse).

Importable from unit and e2e tests alike: pytest puts tests/ on sys.path for tests/conftest.py.
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

Key = ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA the server trusts for client certificates, and the client trusts for the server's
    server_cert: Path
    server_key: Path
    client_cert: Path  # signed by `ca`
    client_key: Path
    other_client_cert: Path  # signed by an unrelated CA
    other_client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key: Key, issuer: x509.Certificate | None, issuer_key: Key, *, ca: bool = False,
                 usage: x509.ObjectIdentifier | None = None, san: list[x509.GeneralName] | None = None
                 ) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer.subject if issuer is not None else _name(subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate a little clock skew
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                          encipher_only=False, decipher_only=False), critical=True)
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(directory: Path, stem: str, cert: x509.Certificate, key: Key) -> tuple[Path, Path]:
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def make_pki(directory: Path) -> Pki:
    """Write the PEM files into `directory` (P-256 keys: fast to make, accepted by gRPC's BoringSSL)."""
    ca_key, other_ca_key, server_key, client_key, other_key = (ec.generate_private_key(ec.SECP256R1())
                                                               for _ in range(5))
    ca = _certificate("lmrpc test CA", ca_key, None, ca_key, ca=True)
    other_ca = _certificate("unrelated CA", other_ca_key, None, other_ca_key, ca=True)
    server = _certificate("localhost", server_key, ca, ca_key, usage=ExtendedKeyUsageOID.SERVER_AUTH,
                          san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client = _certificate("lmrpc test client", client_key, ca, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    other = _certificate("stranger", other_key, other_ca, other_ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    ca_path, _ = _write(directory, "ca", ca, ca_key)
    server_cert, server_key_path = _write(directory, "server", server, server_key)
    client_cert, client_key_path = _write(directory, "client", client, client_key)
    other_cert, other_key_path = _write(directory, "other-client", other, other_key)
    return Pki(ca_path, server_cert, server_key_path, client_cert, client_key_path, other_cert, other_key_path)
