"""Start and stop a single-member etcd on free loopback ports.

For tests, benchmarks and ``kvstore up``: everything that needs a throwaway etcd
starts it here, so the flags (loopback only, a private data dir, quiet logs) are
chosen once. Not a supervisor for production clusters: deploy/ has those.

The process is stopped by its PID (never by name), and ``restart`` keeps the data
dir and both ports, which is what an etcd restart looks like to clients.

For the tests of an etcd that is locked down: ``EtcdProcess(..., tls=EtcdTLS(...))``
serves clients over TLS (client certificates required when the TLS material has a
client pair), and :meth:`EtcdProcess.enable_auth` creates a root user and users whose
roles reach only their own key prefix, then turns etcd's auth on.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError, Unavailable

__all__ = ["EtcdProcess", "EtcdTLS", "EtcdUser", "etcd_binary", "free_port"]


def etcd_binary() -> str | None:
    """The etcd executable on PATH (or Debian's /usr/bin/etcd), None when absent."""
    found = shutil.which("etcd")
    if found:
        return found
    return "/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the caller retries on a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class EtcdTLS:
    """PEM files of an etcd that serves clients over TLS.

    ``cert``/``key`` are the server's (its certificate names 127.0.0.1); ``ca`` signed
    it and, when ``client_cert``/``client_key`` are given, the clients too: etcd then
    runs with ``--client-cert-auth`` and this process's own probes use that pair.
    """

    ca: Path
    cert: Path
    key: Path
    client_cert: Path | None = None
    client_key: Path | None = None

    def context(self) -> ssl.SSLContext:
        """A client context trusting ``ca`` (and presenting the client pair, if any)."""
        ctx = ssl.create_default_context(cafile=str(self.ca))
        if self.client_cert is not None and self.client_key is not None:
            ctx.load_cert_chain(str(self.client_cert), str(self.client_key))
        return ctx


@dataclass(frozen=True)
class EtcdUser:
    """An etcd user whose one role may read and write keys under ``prefix`` only."""

    name: str
    password: str = field(repr=False)
    prefix: bytes


class EtcdProcess:
    """One etcd member listening on 127.0.0.1 only, data under ``data_dir``.

    Lifecycle: ``start()`` (waits until /health answers), ``stop()`` (SIGTERM, then
    SIGKILL), ``kill()`` (SIGKILL, as a crash), ``restart()`` (same ports and data).
    Also a context manager. Not thread-safe: one owner drives it.
    """

    def __init__(
        self,
        data_dir: str | Path,
        *,
        binary: str | None = None,
        tls: EtcdTLS | None = None,
        extra_flags: Iterable[str] = (),
    ) -> None:
        found = binary or etcd_binary()
        if found is None:
            raise ConfigError("etcd binary not found (install etcd-server or put etcd on PATH)")
        self.binary = found
        self.data_dir = Path(data_dir)
        self.tls = tls
        self.extra_flags = list(extra_flags)  # e.g. --auth-token-ttl=1 for a test
        self.client_port = 0
        self.peer_port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        """Client host (always loopback)."""
        return "127.0.0.1"

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client listener, as EtcdDirectory takes it."""
        return f"{self.host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        """PID of the running member, None when stopped."""
        return self._proc.pid if self._proc is not None else None

    @property
    def _scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def _command(self) -> list[str]:
        client = f"{self._scheme}://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        tls: list[str] = []
        if self.tls is not None:
            tls = [
                f"--cert-file={self.tls.cert}",
                f"--key-file={self.tls.key}",
                f"--trusted-ca-file={self.tls.ca}",
            ]
            if self.tls.client_cert is not None:
                tls.append("--client-cert-auth")
        return [
            self.binary,
            "--name=default",
            f"--data-dir={self.data_dir / 'member-data'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            "--logger=zap",
            "--log-level=error",
            *tls,
            *self.extra_flags,
        ]

    def start(self, timeout: float = 20.0) -> EtcdProcess:
        """Start on free ports (kept across restarts) and wait until healthy."""
        if self._proc is not None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fresh = self.client_port == 0
        for _attempt in range(5):
            if fresh:
                self.client_port, self.peer_port = free_port(), free_port()
            if self._spawn_and_wait(timeout):
                return self
            if not fresh:
                break
        raise Unavailable(f"etcd did not become healthy; see {self.data_dir / 'etcd.log'}")

    def _spawn_and_wait(self, timeout: float) -> bool:
        log = open(self.data_dir / "etcd.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            self._proc = subprocess.Popen(
                self._command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:  # exited: most likely a port race
                self._proc = None
                return False
            if self.healthy():
                return True
            time.sleep(0.05)
        self.kill()
        return False

    def healthy(self) -> bool:
        """Whether /health reports true right now."""
        url = f"{self._scheme}://127.0.0.1:{self.client_port}/health"
        ctx = self.tls.context() if self.tls is not None else None
        try:
            with urllib.request.urlopen(url, timeout=1.0, context=ctx) as resp:
                return bool(json.loads(resp.read()).get("health") == "true")
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def enable_auth(self, root_password: str, users: Iterable[EtcdUser] = ()) -> None:
        """Create ``root`` (etcd's admin) and each user with a role of its own that may
        read and write only under its prefix, then turn auth on. Needs aetcd (its
        generated stubs); runs once per data dir: etcd keeps users across restarts."""
        import grpc
        from aetcd import rpc

        target = self.endpoint
        if self.tls is not None:
            t = self.tls

            def read(p: Path | None) -> bytes | None:
                return p.read_bytes() if p is not None else None

            creds = grpc.ssl_channel_credentials(
                read(t.ca), read(t.client_key), read(t.client_cert)
            )
            channel = grpc.secure_channel(target, creds)
        else:
            channel = grpc.insecure_channel(target)
        with channel:
            auth = rpc.AuthStub(channel)

            def call(method: str, request: Any) -> None:
                getattr(auth, method)(request, timeout=10.0)

            call("UserAdd", rpc.AuthUserAddRequest(name="root", password=root_password))
            call("UserGrantRole", rpc.AuthUserGrantRoleRequest(user="root", role="root"))
            for u in users:
                role = f"{u.name}-role"
                end = u.prefix[:-1] + bytes([u.prefix[-1] + 1])
                perm = rpc.Permission(
                    permType=rpc.Permission.READWRITE, key=u.prefix, range_end=end
                )
                call("RoleAdd", rpc.AuthRoleAddRequest(name=role))
                call(
                    "RoleGrantPermission", rpc.AuthRoleGrantPermissionRequest(name=role, perm=perm)
                )
                call("UserAdd", rpc.AuthUserAddRequest(name=u.name, password=u.password))
                call("UserGrantRole", rpc.AuthUserGrantRoleRequest(user=u.name, role=role))
            call("AuthEnable", rpc.AuthEnableRequest())

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM by PID, SIGKILL if it lingers; idempotent."""
        self._signal(signal.SIGTERM, timeout)

    def kill(self) -> None:
        """SIGKILL by PID, as a crash would; idempotent."""
        self._signal(signal.SIGKILL, 10.0)

    def _signal(self, sig: signal.Signals, timeout: float) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

    def restart(self, down_for: float = 0.0, *, crash: bool = False) -> None:
        """Stop (or kill), stay down ``down_for`` seconds, start on the same ports."""
        if crash:
            self.kill()
        else:
            self.stop()
        if down_for > 0:
            time.sleep(down_for)
        self.start()

    def __enter__(self) -> EtcdProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
