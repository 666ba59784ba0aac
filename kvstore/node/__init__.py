"""One host's store, no network: StoreNode (store.py) over the block index (index.py:
where each block lives, pins, the node's one lock and its contract), the mover
(mover.py: bytes between tiers) and the eviction records of admin evictions (eviction.py)."""

from kvstore.node.store import StoreNode

__all__ = ["StoreNode"]
