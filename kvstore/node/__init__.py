"""One host's store, no network: StoreNode (store.py: the facade, and reads) over the
two-phase writes (writes.py), the block index (index.py: where each block lives and
who reads it; it owns the node's one lock, whose state and contract are in state.py),
the allocator (claims.py: room in a tier, victims), the index's half of moves
(moves.py), the mover (mover.py: bytes between tiers), budgets (budgets.py) and the
records of admin evictions (eviction.py)."""

from kvstore.node.store import StoreNode

__all__ = ["StoreNode"]
