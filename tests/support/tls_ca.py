"""A throwaway certificate authority for tests: a CA, and certificates it signs for a
server on 127.0.0.1 and for clients (PEM files in a test's tmp dir).

tests/support/server_process.py's ``make_tls_cert`` makes one self-signed certificate,
enough for a server the client trusts directly; etcd with ``--client-cert-auth`` needs a
CA that signs both ends, which is what this makes.
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

__all__ = ["TestCA"]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)
    return path


@dataclass
class TestCA:
    """A CA whose certificate is at ``cert`` (give it to whoever must trust it)."""

    __test__ = False  # not a pytest test class

    directory: Path
    cert: Path
    _key: ec.EllipticCurvePrivateKey
    _ca: x509.Certificate

    @classmethod
    def create(cls, directory: Path, cn: str = "kvstore-test-ca") -> TestCA:
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        ca = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(_name(cn))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256())
        )
        path = directory / "ca.pem"
        path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        return cls(directory, path, key, ca)

    def issue(self, cn: str, *, server: bool) -> tuple[Path, Path]:
        """(cert, key) PEM files for ``cn``: a server certificate for 127.0.0.1 and
        localhost, or a client certificate."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self._ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if server:
            sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        cert_path = self.directory / f"{cn}.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cert_path, _write_key(key, self.directory / f"{cn}-key.pem")
