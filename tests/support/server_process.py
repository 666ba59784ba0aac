"""A real ``kvstore serve`` child process, its tokens, and TLS material for tests.

Servers bind 127.0.0.1 with port 0 (the kernel picks free ports, reported on the ready
line), so parallel runs never race for a port. ``ServerProcess.restart()`` reuses the
same ports and data paths, which is what a client reconnecting after a restart sees.
The fixtures that start and stop these live in tests/server_fixtures.py.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore import StoreClient
from kvstore.shm.index import index_name
from kvstore.tenants import Principal, derive_scope_key

__all__ = [
    "ADMIN",
    "ALPHA",
    "BRAVO",
    "SCOPE_SECRET",
    "TOKENS",
    "ServerProcess",
    "Token",
    "base_flags",
    "make_tls_cert",
    "principal_of",
    "write_tokens",
]


@dataclass(frozen=True)
class Token:
    token: str
    tenant: str
    admin: bool = False


ALPHA = Token("alpha-token-0123456789", "alpha")
BRAVO = Token("bravo-token-0123456789", "bravo")
ADMIN = Token("admin-token-0123456789", "ops", admin=True)
TOKENS = (ALPHA, BRAVO, ADMIN)
READY_TIMEOUT = 30.0


SCOPE_SECRET = "test-scope-secret-0123456789abcdef0123456789"


def principal_of(token: Token, secret: str = SCOPE_SECRET) -> Principal:
    """How a server given :func:`write_tokens`'s file scopes this token's keys (what a
    test computes to find a tenant's blocks in a node or the directory)."""
    return Principal(token.tenant, scope_key=derive_scope_key(secret.encode(), token.tenant))


def write_tokens(
    path: Path, tokens: tuple[Token, ...] = TOKENS, secret: str = SCOPE_SECRET
) -> Path:
    """A tokens file (TOML) for ``--tokens-file``, with the cluster's scope secret
    (``secret=""``: none)."""
    lines = [f'scope_secret = "{secret}"', ""] if secret else []
    for t in tokens:
        admin = "true" if t.admin else "false"
        lines += [
            "[[tokens]]",
            f'token = "{t.token}"',
            f'tenant = "{t.tenant}"',
            f"admin = {admin}",
            "",
        ]
    path.write_text("\n".join(lines))
    return path


class ServerProcess:
    """One ``python -m kvstore.cli serve`` child and the facts from its ready line."""

    def __init__(self, workdir: Path, flags: dict[str, Any], env: dict[str, str] | None = None):
        self.workdir = workdir
        self.flags = dict(flags)
        self.env = env or {}
        self.proc: subprocess.Popen[str] | None = None
        self.facts: dict[str, Any] = {}
        self.log = workdir / "server.log"

    @property
    def port(self) -> int:
        return int(self.facts["port"])

    @property
    def data_port(self) -> int:
        return int(self.facts["data_port"])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "kvstore.cli", "serve", "--json"]
        for name, value in self.flags.items():
            flag = "--" + name.replace("_", "-")
            if value is True:
                argv.append(flag)
            elif value is not None and value is not False:
                argv += [flag, str(value)]
        return argv

    def start(self) -> ServerProcess:
        """Start the child and wait for its ready line (or fail with its log)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        env.update(self.env)
        env["PYTHONUNBUFFERED"] = "1"
        log = open(self.log, "a")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            self.argv(), stdout=subprocess.PIPE, stderr=log, env=env, text=True, cwd=os.getcwd()
        )
        log.close()
        self.facts = self._ready_line()
        # Later starts (restart) reuse the same ports so clients find the server again.
        self.flags["port"], self.flags["data_port"] = self.port, self.data_port
        return self

    def _ready_line(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith("{"):
                    return dict(json.loads(line))
            if self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"kvstore serve did not start; its log:\n{self.log.read_text()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        """Signal the child (by PID) and wait for it; SIGKILL if it will not go."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        # A killed server cannot unlink its DRAM segment; this one is ours to remove.
        shm = self.facts.get("shm_name")
        if shm:
            Path("/dev/shm", shm).unlink(missing_ok=True)
            Path("/dev/shm", index_name(shm)).unlink(missing_ok=True)
        return self.proc.returncode

    def restart(self, sig: int = signal.SIGTERM) -> ServerProcess:
        """Stop (SIGTERM: clean; SIGKILL: crash) and start again on the same ports."""
        self.stop(sig)
        return self.start()

    def client(self, token: Token | str | None = ALPHA, **kwargs: Any) -> StoreClient:
        """An open client of this server."""
        tok = token.token if isinstance(token, Token) else token
        kwargs.setdefault("timeout_s", 10.0)
        kwargs.setdefault("connect_timeout_s", 10.0)
        return StoreClient.connect(self.address, token=tok, **kwargs)


def base_flags(workdir: Path) -> dict[str, Any]:
    """A server of the three test tenants, which trust each other with one shared DRAM
    segment (tests/service/test_private_dram.py covers the default: private DRAM)."""
    return {
        "port": 0,
        "data_port": 0,
        "tokens_file": write_tokens(workdir / "tokens.toml"),
        "shared_memory": "all_tenants",
        "dram_bytes": "64MiB",
        "ssd_path": workdir / "ssd",
        "ssd_bytes": "256MiB",
    }


def make_tls_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 / localhost and its key (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvstore-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path
