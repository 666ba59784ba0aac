"""Who is calling: the server's table of bearer tokens to tenants (kvstore/tenants.py
scopes each tenant's keys).

The tenant is never taken from a request. A token maps to a :class:`Principal`
(tenant + admin flag + scope key) from the server's tokens file, and every key a
request names is rewritten under the tenant's scope key before it reaches the node.
Two tenants sending identical keys therefore address different blocks, and without
another tenant's token no request can even name theirs.

The tokens file also holds the cluster's ``scope_secret`` (every node loads the same
file, so every node scopes alike). It is required once the file names two or more
tenants: without it a tenant's scope key would be its public name, and the scoped keys
the nodes publish to etcd would tell one tenant which prompts another has cached.
A single-tenant file may leave it out (there is no other tenant to hide from).

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
from kvstore.tenants import DEFAULT_TENANT, MIN_SECRET_BYTES, Principal, derive_scope_key

__all__ = ["TokenTable", "read_tokens_file"]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenTable:
    """Token -> Principal, loaded once at start from the server config."""

    def __init__(self, entries: Mapping[str, Principal], *, anonymous: Principal | None = None):
        self._by_digest = {_digest(t): p for t, p in entries.items()}
        self._anonymous = anonymous
        self.tenants = frozenset(
            [p.tenant for p in entries.values()] + ([anonymous.tenant] if anonymous else [])
        )  # every tenant a caller can be

    @classmethod
    def from_config(cls, config: ServerConfig) -> TokenTable:
        """``auth_token`` (tenant "default", admin), then the tokens file's entries, each
        scoped with the file's ``scope_secret`` when it has one."""
        listed: list[tuple[str, str, bool]] = []
        if config.auth_token:
            listed.append((config.auth_token, DEFAULT_TENANT, True))
        secret = b""
        if config.tokens_file:
            entries, secret = _read_tokens(config.tokens_file)
            listed += entries
        tenants = {tenant for _, tenant, _ in listed}
        if config.allow_anonymous:
            tenants.add(DEFAULT_TENANT)
        if len(tenants) > 1 and not secret:
            raise ConfigError(
                f"tokens_file: {len(tenants)} tenants need a scope_secret (a top-level "
                f"string of at least {MIN_SECRET_BYTES} bytes, the same on every node, e.g. "
                "from 'openssl rand -hex 32'): without it one tenant can compute another's "
                "keys"
            )
        keys = {t: derive_scope_key(secret, t) if secret else b"" for t in tenants}
        by_token: dict[str, Principal] = {}
        for token, tenant, admin in listed:
            if token in by_token:
                raise ConfigError(f"tokens_file: a token is listed twice (tenant {tenant!r})")
            by_token[token] = Principal(tenant, admin, keys[tenant])
        anonymous = (
            Principal(DEFAULT_TENANT, scope_key=keys[DEFAULT_TENANT])
            if config.allow_anonymous
            else None
        )
        return cls(by_token, anonymous=anonymous)

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


def read_tokens_file(path: str) -> dict[str, Any]:
    """The tokens file as a table (TOML, or JSON when it ends in .json); what this module
    reads from it and what kvstore/server/quotas.py reads share this one parse."""
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
    if not isinstance(doc, dict):
        raise ConfigError(f"tokens_file {path!r}: expected a table at the top")
    return doc


def _read_tokens(path: str) -> tuple[list[tuple[str, str, bool]], bytes]:
    """``[[tokens]]`` entries (TOML, or JSON ``{"tokens": [...]}``) as (token, tenant,
    admin), and the file's ``scope_secret`` (b"" when it has none)."""
    doc = read_tokens_file(path)
    items = doc.get("tokens")
    if not isinstance(items, list) or not items:
        raise ConfigError(f"tokens_file {path!r}: expected a non-empty [[tokens]] list")
    secret = doc.get("scope_secret", "")
    if not isinstance(secret, str) or (secret and len(secret.encode()) < MIN_SECRET_BYTES):
        raise ConfigError(
            f"tokens_file {path!r}: scope_secret must be a string of at least "
            f"{MIN_SECRET_BYTES} bytes"
        )
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
            Principal(tenant)  # validates the name, naming the entry on error
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        out.append((token, tenant, admin))
    return out, secret.encode()
