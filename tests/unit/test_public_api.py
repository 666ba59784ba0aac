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
