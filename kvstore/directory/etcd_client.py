"""An aetcd client that can authenticate and speak TLS: one channel for every etcd user.

aetcd 1.0 dials a plaintext channel only, and attaches its auth token to the calls of
its own high-level methods, not to calls made through its stubs (which is how
kvstore/directory/etcd.py reads and writes). So the channel is built here instead:
plaintext or TLS (:class:`~kvstore.config.EtcdAuth`: CA, client certificate), with
interceptors that put etcd's ``token`` metadata on every call, whoever makes it.

The token comes from etcd's Authenticate call with the configured user and password.
etcd forgets a token after ``--auth-token-ttl`` of disuse (simple tokens) or a restart;
a unary call refused with "invalid auth token" then authenticates again and is retried
once, and a refused stream (watch, lease keepalive) marks the token stale so the next
call authenticates first. Errors stay grpc/aetcd errors: kvstore/directory/etcd.py
translates them in its one place.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aetcd
import aetcd.watcher
import grpc
from aetcd import rpc

from kvstore.config import EtcdAuth
from kvstore.errors import ConfigError

__all__ = ["AuthClient", "cancelling", "etcd_client"]

_AUTHENTICATE = "/etcdserverpb.Auth/Authenticate"
_STALE = "invalid auth token"  # etcd's ErrInvalidAuthToken: a forgotten token


def cancelling() -> bool:
    """Whether the running task is being cancelled.

    A cancellation that reaches a call inside a grpc.aio interceptor comes out of the
    call as an RpcError(CANCELLED), not as CancelledError. Code that turns RPC errors
    into retries must ask this first and raise CancelledError instead, or a cancelled
    task (a keepalive being stopped) would swallow its cancellation and run on.
    """
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _method(details: grpc.aio.ClientCallDetails) -> str:
    m = details.method
    return m.decode() if isinstance(m, bytes) else str(m)


def _stale(code: grpc.StatusCode, details: str | None) -> bool:
    """Whether a call ended refused for a forgotten token."""
    return code == grpc.StatusCode.UNAUTHENTICATED and _STALE in (details or "")


class _Session:
    """The current etcd token of one channel and how to get a new one.

    Concurrency: used on the channel's event loop only; ``_lock`` makes callers that find
    the token stale at the same time authenticate once, not once each.
    """

    def __init__(self, user: str, password: str, timeout: float | None) -> None:
        self.user, self._password, self._timeout = user, password, timeout
        self.token = ""
        self.stale = True
        self._lock = asyncio.Lock()
        self.channel: grpc.aio.Channel | None = None

    async def ensure(self, seen: str | None = None) -> str:
        """A valid-looking token; authenticates when stale, or when the caller's token
        ``seen`` was refused and nobody has replaced it yet."""
        async with self._lock:
            if self.stale or (seen is not None and seen == self.token):
                assert self.channel is not None
                req = rpc.AuthenticateRequest(name=self.user, password=self._password)
                reply = await rpc.AuthStub(self.channel).Authenticate(req, timeout=self._timeout)
                self.token, self.stale = reply.token, False
            return self.token


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add("token", token)
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class _UnaryToken(grpc.aio.UnaryUnaryClientInterceptor):
    """Token on every unary call; one retry after re-authenticating a forgotten token."""

    def __init__(self, session: _Session) -> None:
        self._session = session

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if _method(details) == _AUTHENTICATE:
            return await continuation(details, request)
        token = await self._session.ensure()
        call = await continuation(_with_token(details, token), request)
        if not await _refused_stale(call):
            # The call goes back whole, reply or failure: a failure raised in here would
            # be kept by grpc's interceptor task in a cycle with the frames of its own
            # traceback, and with it the call, which holds the channel's connection
            # open after close until the cyclic GC runs (issue 33).
            return call
        token = await self._session.ensure(seen=token)
        return await continuation(_with_token(details, token), request)


async def _refused_stale(call: Any) -> bool:
    """Wait for a unary call to end (without raising its failure); whether etcd refused
    it for a forgotten token. A cancelled wait cancels the call."""
    try:
        code = await call.code()
    except asyncio.CancelledError:
        call.cancel()
        raise
    return _stale(code, await call.details())


class _StreamToken:
    """Token on every streaming call (watch, lease keepalive); a stream refused for a
    forgotten token marks it stale, so the caller's retry authenticates first."""

    def __init__(self, session: _Session) -> None:
        self._session = session
        self._checks: set[asyncio.Future[None]] = set()  # kept alive until they ran

    async def _start(self, continuation: Any, details: Any, request: Any) -> Any:
        token = await self._session.ensure()
        call = await continuation(_with_token(details, token), request)
        call.add_done_callback(self._check)
        return call

    def _check(self, call: Any) -> None:
        if call.cancelled():
            return
        check = asyncio.ensure_future(self._mark(call))
        self._checks.add(check)
        check.add_done_callback(self._checks.discard)

    async def _mark(self, call: Any) -> None:
        if _stale(await call.code(), await call.details()):
            self._session.stale = True


# grpc.aio files an interceptor under one call kind only: one class per kind.
class _StreamStreamToken(_StreamToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await self._start(continuation, details, requests)


class _UnaryStreamToken(_StreamToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self._start(continuation, details, request)


def _credentials(auth: EtcdAuth) -> grpc.ChannelCredentials:
    def read(path: str, what: str) -> bytes | None:
        if not path:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise ConfigError(f"etcd_{what}: cannot read {path!r} ({exc.strerror})") from None

    return grpc.ssl_channel_credentials(
        root_certificates=read(auth.ca, "ca"),
        private_key=read(auth.key, "key"),
        certificate_chain=read(auth.cert, "cert"),
    )


class AuthClient(aetcd.Client):
    """``aetcd.Client`` over a channel of our making: TLS when configured, and etcd's
    token on every call when a user is configured.

    Only :meth:`connect` differs: it fills the attributes aetcd 1.0's own ``connect``
    fills (channel, stubs, watcher), so aetcd's methods (get, put, lease, watch, ...)
    work unchanged; ``metadata`` stays None because the interceptors add the token.
    """

    def __init__(
        self,
        host: str,
        port: int,
        auth: EtcdAuth,
        *,
        timeout: float | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(host, port, options=options)
        self._auth = auth
        self._call_timeout = timeout

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        auth, target = self._auth, f"{self._host}:{self._port}"
        interceptors: list[Any] = []
        session = None
        if auth.user:
            session = _Session(auth.user, auth.password, self._call_timeout)
            interceptors = [
                _UnaryToken(session),
                _StreamStreamToken(session),
                _UnaryStreamToken(session),
            ]
        options = list(self._options.items())
        if auth.tls:
            channel = grpc.aio.secure_channel(
                target, _credentials(auth), options=options, interceptors=interceptors
            )
        else:
            channel = grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
        if session is not None:
            session.channel = channel
        self.channel = channel
        self.kvstub = rpc.KVStub(channel)
        self.clusterstub = rpc.ClusterStub(channel)
        self.leasestub = rpc.LeaseStub(channel)
        self.maintenancestub = rpc.MaintenanceStub(channel)
        self._watcher = aetcd.watcher.Watcher(rpc.WatchStub(channel), timeout=self._timeout)
        if session is not None:
            try:
                await session.ensure()  # a wrong password fails here, not at first use
            except BaseException:
                await channel.close()
                self._init_channel_attrs()
                raise
        self._connected.set()


def etcd_client(
    endpoint: str,
    auth: EtcdAuth | None = None,
    *,
    timeout: float | None = None,
    options: dict[str, Any] | None = None,
) -> aetcd.Client:
    """An unconnected aetcd client of ``host:port``: aetcd's own when ``auth`` asks for
    nothing, else an :class:`AuthClient`."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"etcd endpoint {endpoint!r}: expected host:port")
    if auth is None or auth.empty:
        return aetcd.Client(host, int(port), options=options)
    return AuthClient(host, int(port), auth, timeout=timeout, options=options)
