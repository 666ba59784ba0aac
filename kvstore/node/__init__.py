"""One host's store, no network: StoreNode (store.py) over the block index and mover
(chain.py) and the eviction records of admin evictions (eviction.py)."""

from kvstore.node.store import StoreNode

__all__ = ["StoreNode"]
