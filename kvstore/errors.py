"""One exception tree for the whole store, each class with a stable string code.

Callers catch these, never foreign errors: gRPC, etcd, socket and lmdb errors are
translated into this tree in exactly one place per foreign library (with
``raise ... from exc``), so the cause stays attached for debugging while the type
a user programs against stays stable across transports. The ``code`` strings are
part of the wire contract (they travel in gRPC status details) and never change.
"""

from __future__ import annotations

__all__ = [
    "AuthError",
    "BlockTooLarge",
    "CapacityError",
    "ClosedError",
    "ConfigError",
    "ConflictError",
    "CorruptBlock",
    "DeviceError",
    "DirectoryError",
    "InvalidKey",
    "InvalidValue",
    "KVStoreError",
    "LayoutMismatch",
    "LimitExceeded",
    "LeaseExpired",
    "NotFound",
    "PermissionDenied",
    "QuotaExceeded",
    "ReservationError",
    "StorageError",
    "TimeoutError_",
    "TransportError",
    "Unavailable",
    "error_for_code",
]


class KVStoreError(Exception):
    """Base of every error the store raises on purpose.

    ``retryable`` says whether the same call may succeed if simply tried again
    (the client's retry loop reads it and nothing else).
    """

    code: str = "internal"
    retryable: bool = False


class InvalidKey(KVStoreError, ValueError):
    """A key is not a 16-byte block key (wrong type or length)."""

    code = "invalid_key"


class InvalidValue(KVStoreError, ValueError):
    """A value cannot be stored: unsupported type, non-contiguous, or empty."""

    code = "invalid_value"


class LayoutMismatch(InvalidValue):
    """A value's dtype or shape disagrees with the namespace's KV layout, or a stored
    block belongs to another namespace. Loading it could hand foreign KV to an engine."""

    code = "layout_mismatch"


class BlockTooLarge(KVStoreError, ValueError):
    """A single block is larger than a tier (or a configured value limit) can ever hold."""

    code = "block_too_large"


class LimitExceeded(KVStoreError, ValueError):
    """A request exceeds a configured limit (keys per batch, message size)."""

    code = "limit_exceeded"


class QuotaExceeded(LimitExceeded):
    """A write would take a tenant past its quota (bytes in a tier, or reservations in
    flight; kvstore/server/quotas.py), and none of its own blocks could make room.

    Not retryable: an immediate retry meets the same quota. It clears when the tenant's
    own writes in flight end or it removes blocks; other tenants are not affected.
    """

    code = "quota_exceeded"


class CapacityError(KVStoreError):
    """No space can be made: every eviction candidate is pinned or in flight.

    Transient by nature: pins are short-lived, so a retry may succeed.
    """

    code = "no_capacity"
    retryable = True


class CorruptBlock(KVStoreError):
    """A block's header or checksum does not verify. Readers turn this into a miss."""

    code = "corrupt_block"


class NotFound(KVStoreError, KeyError):
    """A reservation, node or block that an operation names does not exist."""

    code = "not_found"


class ReservationError(KVStoreError):
    """A two-phase write was used out of order (commit after abort, double commit...)."""

    code = "reservation"


class ConfigError(KVStoreError, ValueError):
    """A configuration value is missing, malformed or out of range."""

    code = "config"


class ClosedError(KVStoreError, RuntimeError):
    """An operation on a node, tier or client that is not open (or already closed)."""

    code = "closed"


class StorageError(KVStoreError, OSError):
    """A local storage failure (disk full, lmdb error, shared-memory mapping failure)."""

    code = "storage"


class AuthError(KVStoreError):
    """Missing or wrong credentials."""

    code = "unauthenticated"


class PermissionDenied(KVStoreError):
    """Valid credentials that do not allow this operation (e.g. admin ops by a tenant)."""

    code = "permission_denied"


class ConflictError(KVStoreError):
    """A resource is already claimed (e.g. a node id registered by a live node)."""

    code = "conflict"


class Unavailable(KVStoreError, ConnectionError):
    """A peer (node, directory, server) cannot be reached right now."""

    code = "unavailable"
    retryable = True


class TimeoutError_(KVStoreError, TimeoutError):
    """An operation ran past its deadline."""

    code = "timeout"
    retryable = True


class TransportError(KVStoreError):
    """A data-plane transfer failed or delivered a malformed frame."""

    code = "transport"
    retryable = True


class DeviceError(KVStoreError):
    """A CUDA call failed (an illegal address, out of memory, a lost device) while
    copying between host memory and a device tensor: the tensors of that call hold no
    result, and none of them is reported filled. Not retryable: CUDA errors of this kind
    are sticky for the process's context."""

    code = "device"


class DirectoryError(KVStoreError):
    """The cluster directory (etcd) refused or failed an operation for a reason that is
    neither a conflict, an outage nor a timeout (a malformed request, an internal error)."""

    code = "directory"


class LeaseExpired(DirectoryError):
    """A node's directory lease is gone (expired or revoked), so its registration and
    every entry published under it are gone too. Re-registering takes a new lease."""

    code = "lease_expired"
    retryable = True


def _all_subclasses(cls: type[KVStoreError]) -> list[type[KVStoreError]]:
    out: list[type[KVStoreError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


def error_for_code(code: str, message: str) -> KVStoreError:
    """Rebuild a typed error from its wire code (unknown codes give the base class)."""
    for cls in _all_subclasses(KVStoreError):
        if cls.code == code:
            return cls(message)
    return KVStoreError(message)
