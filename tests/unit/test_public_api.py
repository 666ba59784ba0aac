"""Gate: the package's __all__ is exactly its public names, and every name imports."""

from __future__ import annotations

import kvstore


def test_all_matches_public_names() -> None:
    public = {n for n in vars(kvstore) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(kvstore, n)).__name__ == "module"}
    assert set(kvstore.__all__) == public - modules


def test_design_surface_present() -> None:
    for name in ("Namespace", "prefix_keys", "StoreNode"):
        assert name in kvstore.__all__


def test_a_sharded_node_answers_every_call_with_the_same_signature() -> None:
    """StoreClient binds ShardedClient's methods over its own for a sharded node
    (kvstore/client/api.py): a caller's arguments must mean the same to both."""
    import inspect

    from kvstore.client.api import _BY_SHARD
    from kvstore.client.sharded import ShardedClient
    from kvstore.client.store import NodeClient

    def params(fn: object) -> list[tuple[str, object, object]]:
        sig = inspect.signature(fn)  # type: ignore[arg-type]
        return [(p.name, p.kind, p.default) for p in sig.parameters.values()]

    for name in _BY_SHARD:
        assert params(getattr(ShardedClient, name)) == params(getattr(NodeClient, name)), name
