"""Who is calling: the server's table of bearer tokens to tenants (kvstore/tenants.py
scopes each tenant's keys).

The tenant is never taken from a request. A token maps to a :class:`Principal`
(tenant + admin flag) from the server's tokens file, and every key a request names is
rewritten to ``BLAKE2b-128(key=tenant, person="kvstore/tenant", data=key)`` before it
reaches the node. Two tenants sending identical keys therefore address different
blocks, and without another tenant's token no request can even name theirs.

Tokens are compared by their SHA-256 (a dict lookup on a digest), so the time a lookup
takes says nothing about how much of a guessed token was right.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvstore.config import ServerConfig
from kvstore.errors import AuthError, ConfigError
from kvstore.tenants import DEFAULT_TENANT, Principal

__all__ = ["TokenTable"]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenTable:
    """Token -> Principal, loaded once at start from the server config."""

    def __init__(self, entries: Mapping[str, Principal], *, anonymous: Principal | None = None):
        self._by_digest = {_digest(t): p for t, p in entries.items()}
        self._anonymous = anonymous

    @classmethod
    def from_config(cls, config: ServerConfig) -> TokenTable:
        """``auth_token`` (tenant "default", admin), then the tokens file's entries."""
        entries: dict[str, Principal] = {}
        if config.auth_token:
            entries[config.auth_token] = Principal(DEFAULT_TENANT, admin=True)
        if config.tokens_file:
            for token, principal in _read_tokens(config.tokens_file):
                if token in entries:
                    raise ConfigError(f"tokens_file: a token is listed twice ({principal})")
                entries[token] = principal
        anonymous = Principal(DEFAULT_TENANT) if config.allow_anonymous else None
        return cls(entries, anonymous=anonymous)

    def authenticate(self, token: str | None) -> Principal:
        """The principal of a token; AuthError for a missing or unknown one."""
        if not token:
            if self._anonymous is not None:
                return self._anonymous
            raise AuthError("missing bearer token")
        p = self._by_digest.get(_digest(token))
        if p is None:
            raise AuthError("invalid bearer token")
        return p

    def from_metadata(self, metadata: Sequence[tuple[str, Any]] | None) -> Principal:
        """Authenticate gRPC invocation metadata (``authorization: Bearer <token>``)."""
        token = None
        for k, v in metadata or ():
            if k == "authorization":
                value = v.decode() if isinstance(v, bytes) else str(v)
                scheme, _, rest = value.partition(" ")
                if scheme.lower() != "bearer":
                    raise AuthError("authorization metadata must be 'Bearer <token>'")
                token = rest.strip()
                break
        return self.authenticate(token)


def _read_tokens(path: str) -> list[tuple[str, Principal]]:
    """``[[tokens]]`` entries (TOML, or JSON ``{"tokens": [...]}``) as (token, principal)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        if path.endswith(".json"):
            doc = json.loads(data)
        else:
            import tomllib

            doc = tomllib.loads(data.decode())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"tokens_file {path!r}: {exc}") from None
    items = doc.get("tokens") if isinstance(doc, dict) else None
    if not isinstance(items, list) or not items:
        raise ConfigError(f"tokens_file {path!r}: expected a non-empty [[tokens]] list")
    out = []
    for i, item in enumerate(items):
        where = f"tokens_file {path!r} entry {i}"
        if not isinstance(item, dict) or set(item) - {"token", "tenant", "admin"}:
            raise ConfigError(f"{where}: use keys token, tenant, admin")
        token, tenant = item.get("token"), item.get("tenant")
        if not isinstance(token, str) or len(token) < 16:
            raise ConfigError(f"{where}: token must be a string of at least 16 characters")
        if not isinstance(tenant, str):
            raise ConfigError(f"{where}: tenant must be a string")
        admin = item.get("admin", False)
        if not isinstance(admin, bool):
            raise ConfigError(f"{where}: admin must be true or false")
        try:
            out.append((token, Principal(tenant, admin)))
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return out
