"""Block keys: a pure, process-independent chained hash over token blocks.

``k_i = BLAKE2b-128(k_{i-1} || tokens[i*B:(i+1)*B] as little-endian uint32)`` with
``k_{-1} = BLAKE2b-128(namespace)``. Equal keys therefore mean an equal namespace and
an equal token prefix up to and including that block, which is what makes a
longest-prefix match over keys meaningful. Only full blocks get keys: a partial
block's KV would change as the prompt grows.
"""

from __future__ import annotations

import array
import functools
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any, NewType

import numpy as np

from kvstore.errors import ConfigError, InvalidKey
from kvstore.layout import KVLayout

__all__ = [
    "MAX_MODEL_NAME",
    "KEY_BYTES",
    "BlockKey",
    "Namespace",
    "as_key",
    "key_hex",
    "prefix_keys",
]

KEY_BYTES = 16
BlockKey = NewType("BlockKey", bytes)

_DOMAIN = b"kvstore/ns/v1\x00"

MAX_MODEL_NAME = 256
"""Longest model name a namespace takes, in UTF-8 bytes (each is kept by every node
that sees it, in memory and beside its SSD tier)."""


@dataclass(frozen=True, slots=True)
class Namespace:
    """Who may share KV: same model, same KV layout, same tenant.

    ``layout`` is a layout string (see :mod:`kvstore.layout`). The tenant is set by
    the server from credentials; a client-supplied tenant is only trusted in process.
    """

    model: str
    layout: str
    tenant: str = "default"

    def __post_init__(self) -> None:
        if not self.model or "\x00" in self.model:
            raise ConfigError("namespace model must be a non-empty string without NUL")
        if len(self.model.encode()) > MAX_MODEL_NAME:
            raise ConfigError(
                f"namespace model name of {len(self.model.encode())} bytes: at most "
                f"{MAX_MODEL_NAME} (a model id or a path, not a document)"
            )
        if not self.tenant or "\x00" in self.tenant:
            raise ConfigError("namespace tenant must be a non-empty string without NUL")
        KVLayout.parse(self.layout)  # validate early, with a clear error

    @property
    def kv_layout(self) -> KVLayout:
        """The parsed layout."""
        return KVLayout.parse(self.layout)

    def with_tenant(self, tenant: str) -> Namespace:
        """The same namespace for another tenant (used by the server, never the client)."""
        return Namespace(self.model, self.layout, tenant)

    def canonical(self, block_tokens: int | None = None) -> bytes:
        """The bytes hashed into the chain root; ``block_tokens`` fills in ``B``."""
        layout = self.kv_layout
        if block_tokens is not None:
            layout = layout.with_block_tokens(block_tokens)
        return b"\x00".join(
            [self.model.encode(), layout.canonical().encode(), self.tenant.encode()]
        )

    def fingerprint(self, block_tokens: int | None = None) -> bytes:
        """16 bytes identifying this namespace; stored in every block header.

        Cached: it is checked on every read, and parsing the layout costs microseconds."""
        return _fingerprint(self, block_tokens)


@functools.lru_cache(maxsize=1024)
def _fingerprint(ns: Namespace, block_tokens: int | None) -> bytes:
    return blake2b(_DOMAIN + ns.canonical(block_tokens), digest_size=KEY_BYTES).digest()


def as_key(key: Any) -> BlockKey:
    """Validate a key: exactly 16 bytes (bytes, bytearray or memoryview)."""
    if isinstance(key, (bytearray, memoryview)):
        key = bytes(key)
    if not isinstance(key, bytes):
        raise InvalidKey(f"a block key is 16 bytes, got {type(key).__name__}")
    if len(key) != KEY_BYTES:
        raise InvalidKey(f"a block key is 16 bytes, got {len(key)}")
    return BlockKey(key)


def key_hex(key: bytes) -> str:
    """Short printable form for logs and the CLI."""
    return key.hex()


def _token_bytes(token_ids: Any) -> tuple[bytes, int]:
    """Token ids as little-endian uint32 bytes, with one conversion for the whole prompt."""
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
    elif hasattr(token_ids, "numpy") and hasattr(token_ids, "dim"):  # a torch tensor
        arr = token_ids.detach().cpu().numpy()
    else:
        if not isinstance(token_ids, (list, tuple, array.array)):
            token_ids = list(token_ids)
        try:
            a = array.array("I", token_ids)
        except (OverflowError, TypeError) as exc:
            raise InvalidKey(f"token ids must be integers in [0, 2**32): {exc}") from exc
        if sys.byteorder != "little":
            a.byteswap()
        return a.tobytes(), len(a)
    if arr.ndim != 1:
        raise InvalidKey(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise InvalidKey(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise InvalidKey("token ids must be in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes(), int(arr.size)


def prefix_keys(
    token_ids: Sequence[int] | np.ndarray | Iterable[int],
    block_tokens: int,
    namespace: Namespace,
    *,
    parent: bytes | None = None,
) -> list[BlockKey]:
    """Keys of every full block of ``token_ids``, each chained to all blocks before it.

    ``parent`` continues a chain: pass the last key of an earlier call and the tokens
    that follow it, and the keys equal those of one call over the whole prompt.
    """
    if block_tokens <= 0:
        raise ConfigError(f"block_tokens must be positive, got {block_tokens}")
    data, n = _token_bytes(token_ids)
    if parent is None:
        prev = blake2b(namespace.canonical(block_tokens), digest_size=KEY_BYTES).digest()
    else:
        prev = as_key(parent)
    step = block_tokens * 4
    mv = memoryview(data)
    keys: list[BlockKey] = []
    append = keys.append
    for off in range(0, (n // block_tokens) * step, step):
        h = blake2b(prev, digest_size=KEY_BYTES)
        h.update(mv[off : off + step])
        prev = h.digest()
        append(BlockKey(prev))
    return keys
