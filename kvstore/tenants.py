"""Tenants and the scoping of their keys: the contract both ends compute alike.

The tenant is never taken from a request. A token maps to a :class:`Principal`
(tenant + admin flag + scope key) in the server's tokens file (kvstore/server/auth.py),
and every key a request names is rewritten to ``BLAKE2b-128(key=scope_key,
person="kvstore/tenant", data=key)`` before it reaches the node. Two tenants sending
identical keys therefore address different blocks.

Why a secret: the scoped keys are published to the cluster directory (etcd), so they
must not be computable by anyone who knows only a tenant's public name, or tenant B
could hash a guessed prompt under A's name and look it up there. With a cluster scope
secret (``scope_secret`` in the tokens file every node shares), a tenant's scope key
is ``HMAC-SHA256(secret, "kvstore/scope-key/v1\\0" + tenant)``: every node derives the
same one, and a client learns its own (never another tenant's) from the INFO reply of
a node its token authenticated to. Without a secret (open or single-tenant setups) the
scope key is the tenant's name, as it always was.

A same-host client scopes its keys with the same function to read the published DRAM
index (kvstore/client/transport/shm_direct.py), and the cluster client to look keys up
in the directory mirror (kvstore/client/members.py), both with the scope key the
server named in its INFO reply.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import ConfigError, PermissionDenied
from kvstore.keys import KEY_BYTES, as_key

__all__ = ["DEFAULT_TENANT", "MIN_SECRET_BYTES", "Principal", "derive_scope_key"]

DEFAULT_TENANT = "default"
MIN_SECRET_BYTES = 32  # a scope secret is a key, not a password: no shorter than this
_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")
_PERSON = b"kvstore/tenant"  # BLAKE2b personalization: domain-separates scoped keys
_DERIVE = b"kvstore/scope-key/v1\0"  # HMAC domain of scope keys: never reused elsewhere
_MAX_KEY = 64  # BLAKE2b's longest key


def derive_scope_key(secret: bytes, tenant: str) -> bytes:
    """The 32-byte scope key of ``tenant`` under the cluster's scope ``secret``.

    HMAC rather than a keyed BLAKE2b so a secret of any length works unchanged.
    """
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"scope secret: use at least {MIN_SECRET_BYTES} bytes")
    return hmac.new(secret, _DERIVE + tenant.encode(), hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller: its tenant, whether it may run admin operations, and
    the key its tenant's block keys are scoped with (b"": the tenant's name, the
    derivation of a server without a scope secret)."""

    tenant: str
    admin: bool = False
    scope_key: bytes = field(default=b"", repr=False)
    _base: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _TENANT.fullmatch(self.tenant):
            raise ConfigError(f"tenant {self.tenant!r}: use 1-64 of [A-Za-z0-9._-]")
        if len(self.scope_key) > _MAX_KEY:
            raise ConfigError(f"scope key: at most {_MAX_KEY} bytes, got {len(self.scope_key)}")
        key = self.scope_key or self.tenant.encode()
        base = hashlib.blake2b(digest_size=16, key=key, person=_PERSON)
        object.__setattr__(self, "_base", base)

    def scope(self, key: Any) -> bytes:
        """The node-side key of one of this tenant's keys (validates the key)."""
        return self.scope_all((key,))[0]

    def scope_all(self, keys: Iterable[Any]) -> list[bytes]:
        """:meth:`scope` for each key, in order (a hot loop: ~0.5 us per key)."""
        copy = self._base.copy
        out = []
        for k in keys:
            if type(k) is not bytes or len(k) != KEY_BYTES:
                k = as_key(k)
            h = copy()
            h.update(k)
            out.append(h.digest())
        return out

    def require_admin(self, what: str) -> None:
        """Refuse an admin operation to a non-admin token."""
        if not self.admin:
            raise PermissionDenied(f"{what} needs an admin token (tenant {self.tenant!r})")
