"""kvstore: a tiered, distributed KV-cache store for disaggregated LLM serving.

The public surface (stable once landed): :class:`Namespace`, :func:`prefix_keys`,
:class:`StoreNode`, :class:`StoreClient` / :class:`AsyncStoreClient` (the SDK of
``kvstore serve``), plus the error tree in :mod:`kvstore.errors`.
"""

from kvstore.client import AsyncStoreClient, StoreClient
from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey, Namespace, prefix_keys
from kvstore.node.store import StoreNode
from kvstore.tier_kinds import TierKind

__all__ = [
    "AsyncStoreClient",
    "BlockKey",
    "KVStoreError",
    "Namespace",
    "StoreClient",
    "StoreNode",
    "TierKind",
    "prefix_keys",
]
__version__ = "0.1.0"
