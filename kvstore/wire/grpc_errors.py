"""The one place gRPC errors meet the kvstore error tree, in both directions.

Server side, :func:`abort` ends a call with the gRPC status that fits a KVStoreError and
puts the error's stable code in trailing metadata (``kvstore-error-code``). Client side,
:func:`error_from_rpc` rebuilds the exact class from that code with ``error_for_code``;
errors gRPC raises on its own (no code: the server is down, a deadline passed, a message
was too large) are mapped by status. :func:`mapped` wraps a client call so a raw
``grpc.RpcError`` never reaches a user, always ``raise ... from`` the original.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import grpc

from kvstore.errors import (
    AuthError,
    InvalidValue,
    KVStoreError,
    LimitExceeded,
    NotFound,
    PermissionDenied,
    TimeoutError_,
    Unavailable,
    error_for_code,
)
from kvstore.wire.codec import wire_error

__all__ = ["ERROR_CODE_KEY", "abort", "error_from_rpc", "mapped", "status_for"]

ERROR_CODE_KEY = "kvstore-error-code"
_S = grpc.StatusCode

_STATUS_OF_CODE = {
    "unauthenticated": _S.UNAUTHENTICATED,
    "permission_denied": _S.PERMISSION_DENIED,
    "invalid_key": _S.INVALID_ARGUMENT,
    "invalid_value": _S.INVALID_ARGUMENT,
    "layout_mismatch": _S.FAILED_PRECONDITION,
    "block_too_large": _S.OUT_OF_RANGE,
    "limit_exceeded": _S.RESOURCE_EXHAUSTED,
    "quota_exceeded": _S.RESOURCE_EXHAUSTED,
    "no_capacity": _S.RESOURCE_EXHAUSTED,
    "not_found": _S.NOT_FOUND,
    "reservation": _S.FAILED_PRECONDITION,
    "conflict": _S.ALREADY_EXISTS,
    "config": _S.INVALID_ARGUMENT,
    "corrupt_block": _S.DATA_LOSS,
    "unavailable": _S.UNAVAILABLE,
    "timeout": _S.DEADLINE_EXCEEDED,
    "transport": _S.UNAVAILABLE,
}

# For failures gRPC itself raises, which carry no kvstore code.
_ERROR_OF_STATUS: dict[Any, type[KVStoreError]] = {
    _S.UNAUTHENTICATED: AuthError,
    _S.PERMISSION_DENIED: PermissionDenied,
    _S.UNAVAILABLE: Unavailable,
    _S.DEADLINE_EXCEEDED: TimeoutError_,
    _S.RESOURCE_EXHAUSTED: LimitExceeded,  # e.g. "Received message larger than max"
    _S.INVALID_ARGUMENT: InvalidValue,
    _S.NOT_FOUND: NotFound,
    _S.CANCELLED: Unavailable,
}


def status_for(exc: KVStoreError) -> grpc.StatusCode:
    """The gRPC status code for a store error (INTERNAL for unknown codes)."""
    return _STATUS_OF_CODE.get(exc.code, _S.INTERNAL)


async def abort(context: grpc.aio.ServicerContext, exc: KVStoreError) -> NoReturn:
    """End the current call with ``exc``: its status, message and code."""
    exc = wire_error(exc)
    await context.abort(status_for(exc), str(exc), trailing_metadata=((ERROR_CODE_KEY, exc.code),))
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


def error_from_rpc(exc: grpc.RpcError, what: str = "") -> KVStoreError:
    """The typed error for a failed call (``what`` names the call in the message)."""
    status = exc.code() if hasattr(exc, "code") else _S.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(status)
    code = None
    if hasattr(exc, "trailing_metadata"):
        for k, v in exc.trailing_metadata() or ():
            if k == ERROR_CODE_KEY:
                code = v.decode() if isinstance(v, bytes) else str(v)
    if code:
        return error_for_code(code, details)
    prefix = f"{what}: " if what else ""
    cls = _ERROR_OF_STATUS.get(status, KVStoreError)
    return cls(f"{prefix}{details} (gRPC {status.name})")


@contextmanager
def mapped(what: str) -> Iterator[None]:
    """Translate any ``grpc.RpcError`` raised in the block into the store's tree."""
    try:
        yield
    except grpc.RpcError as exc:
        raise error_from_rpc(exc, what) from exc
