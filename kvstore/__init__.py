"""kvstore: a tiered, distributed KV-cache store for disaggregated LLM serving.

The public surface (stable once landed): :class:`Namespace`, :func:`prefix_keys`,
:class:`StoreNode`, plus the error tree in :mod:`kvstore.errors`.
"""

from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey, Namespace, prefix_keys
from kvstore.node import StoreNode
from kvstore.tiers.base import TierKind

__all__ = ["BlockKey", "KVStoreError", "Namespace", "StoreNode", "TierKind", "prefix_keys"]
__version__ = "0.1.0"
