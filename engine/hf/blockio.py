"""How the transformers adapter and workers move blocks through a store: a prefix at a time.

A prefix is one ``batch_put`` or one ``batch_get_into`` per ``BATCH_KEYS`` blocks, never
a call per block: the store's client then moves the whole batch with one submission (on
a GPU, one batch of async copies and one synchronization; over TCP, one pipelined
stream), and the per-call work of the client, the wire and the server is paid once per
prefix instead of once per 512 KiB. ``BATCH_KEYS`` (512) stays under a server's default
``max_batch`` (1024), which a client refuses to exceed: a 16k-token prompt of 32-token
blocks is still one call.

Each key's own outcome is kept (True, False, or that key's error), so a reader still
stops at the first block that is missing, corrupt or refused: a prefix is reusable
only up to its first gap, and a cache may miss but never load wrong KV.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from engine.blockstore import BlockStore
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace

__all__ = ["BATCH_KEYS", "get_prefix_into", "leading_hits", "matched_blocks", "put_batch"]

log = logging.getLogger(__name__)

BATCH_KEYS = 512


def leading_hits(results: Sequence[Any]) -> int:
    """How many leading results are hits (``True``); the first miss or error ends it."""
    n = 0
    for r in results:
        if r is not True:
            break
        n += 1
    return n


def matched_blocks(store: BlockStore, keys: Sequence[bytes]) -> int:
    """Leading keys the store holds, asked ``BATCH_KEYS`` at a time, stopping at the first
    slice not fully stored. Raises the store's KVStoreError (the caller's miss)."""
    n = 0
    for i in range(0, len(keys), BATCH_KEYS):
        part = keys[i : i + BATCH_KEYS]
        got = int(store.match_prefix(part))
        n += got
        if got < len(part):
            break
    return n


def put_batch(
    store: BlockStore, keys: Sequence[bytes], values: Sequence[Any], namespace: Namespace
) -> list[Any]:
    """Put ``values`` under ``keys``, one batch call per ``BATCH_KEYS``; each key's outcome
    (True new, False already stored, or its error). A call that fails as a whole gives
    its error to each of its keys, so a caller sees one outcome per key and never a
    half-finished batch raising past the keys that were stored."""
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys but {len(values)} values")
    out: list[Any] = []
    for i in range(0, len(keys), BATCH_KEYS):
        ks, vs = keys[i : i + BATCH_KEYS], values[i : i + BATCH_KEYS]
        try:
            res = list(store.batch_put(ks, vs, namespace=namespace))
        except KVStoreError as exc:
            res = [exc] * len(ks)
        if len(res) != len(ks):
            raise KVStoreError(f"the store answered {len(res)} results for {len(ks)} keys")
        out += res
    return out


def get_prefix_into(
    store: BlockStore, keys: Sequence[bytes], outs: Sequence[Any], namespace: Namespace
) -> int:
    """Read ``keys`` into ``outs``, one batch call per ``BATCH_KEYS``; returns how many
    leading blocks arrived. A whole call that fails ends the prefix there (a miss);
    ``outs`` past the returned count may hold partial bytes and must not be used."""
    got = 0
    for i in range(0, len(keys), BATCH_KEYS):
        ks, os_ = keys[i : i + BATCH_KEYS], outs[i : i + BATCH_KEYS]
        try:
            hits = leading_hits(store.batch_get_into(ks, os_, namespace=namespace))
        except KVStoreError as exc:
            log.info("batch read failed (%s); the prefix ends at block %d", exc, got)
            break
        got += hits
        if hits < len(ks):
            break
    return got
