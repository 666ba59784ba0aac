"""The namespace registry (kvstore/server/namespaces.py): fingerprint -> (tenant, model), kept
in a JSON-lines file beside the SSD tier; a torn or corrupt line is skipped, never fatal.

Process-level checks (a restart, a drain between two nodes) are in tests/service/test_admin.py
and tests/cluster/test_cluster_drain.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from kvstore import Namespace
from kvstore.blocks import checksum, describe
from kvstore.config import NodeConfig, ServerConfig
from kvstore.errors import InvalidValue, StorageError
from kvstore.node.store import StoreNode
from kvstore.server.gateway import Gateway
from kvstore.server.maintenance import ImportItem, Maintenance, ScanSpec
from kvstore.server.namespaces import FILE_NAME, NamespaceRegistry
from kvstore.tenants import Principal

LAYOUT = "uint8:L1:H1:D1"
ADMIN = Principal("ops", admin=True)


def fp(i: int) -> bytes:
    return i.to_bytes(16, "little")


def lines(directory: Path) -> list[str]:
    return (directory / FILE_NAME).read_text().splitlines()


def test_in_memory_registry_adds_gets_and_selects() -> None:
    reg = NamespaceRegistry.open("")
    assert reg.path is None
    assert reg.add(fp(1), "alpha", "m1") is True
    assert reg.add(fp(1), "alpha", "m1") is False  # known: nothing changes
    assert reg.add(fp(2), "alpha", "m2") and reg.add(fp(3), "bravo", "m1")
    assert reg.get(fp(2)) == ("alpha", "m2") and reg.get(fp(9)) is None
    assert reg.select("alpha") == {fp(1), fp(2)}
    assert reg.select(model="m1") == {fp(1), fp(3)}
    assert reg.select("bravo", "m2") == frozenset()
    assert reg.select() == {fp(1), fp(2), fp(3)} and len(reg) == 3
    with pytest.raises(InvalidValue):
        reg.add(b"short", "alpha", "m1")
    with pytest.raises(InvalidValue):
        reg.add(fp(4), "", "m1")
    reg.close()


def test_entries_persist_across_reopen(tmp_path: Path) -> None:
    reg = NamespaceRegistry.open(tmp_path)
    for i, (t, m) in enumerate([("alpha", "m1"), ("alpha", "m2"), ("bravo", "m1")]):
        assert reg.add(fp(i), t, m)
    assert not reg.add(fp(0), "alpha", "m1")
    reg.close()
    reg.close()  # idempotent
    assert len(lines(tmp_path)) == 3  # one line per namespace, not per add
    again = NamespaceRegistry.open(tmp_path)
    assert again.select("alpha") == {fp(0), fp(1)} and again.get(fp(2)) == ("bravo", "m1")
    assert not again.add(fp(2), "bravo", "m1")  # known from the file: not appended again
    assert again.add(fp(3), "carol", "m3")
    again.close()
    assert len(lines(tmp_path)) == 4
    assert len(NamespaceRegistry.open(tmp_path)) == 4


def test_a_truncated_last_line_is_skipped_and_later_appends_stay_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reg = NamespaceRegistry.open(tmp_path)
    reg.add(fp(1), "alpha", "m1")
    reg.add(fp(2), "bravo", "m2")
    reg.close()
    path = tmp_path / FILE_NAME
    whole = path.read_bytes()
    torn = json.dumps({"fp": fp(3).hex(), "tenant": "carol", "model": "m3"}).encode()
    path.write_bytes(whole + torn[: len(torn) // 2])  # a crash in the middle of an append
    with caplog.at_level(logging.WARNING, logger="kvstore.server.namespaces"):
        reg = NamespaceRegistry.open(tmp_path)
    assert "skipped 1 unreadable line" in caplog.text
    assert reg.select() == {fp(1), fp(2)}
    assert path.read_bytes() == whole  # rewritten clean before anything is appended
    assert not (tmp_path / (FILE_NAME + ".tmp")).exists()
    assert reg.add(fp(3), "carol", "m3")  # not glued to the torn piece
    reg.close()
    again = NamespaceRegistry.open(tmp_path)
    assert again.get(fp(3)) == ("carol", "m3") and len(again) == 3


def test_corrupt_lines_anywhere_are_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = [{"fp": fp(i).hex(), "tenant": "alpha", "model": f"m{i}"} for i in range(3)]
    bad = [
        b"\xff\xfe not utf-8",
        b"{not json",
        b"[1, 2]",
        json.dumps({"fp": "zz", "tenant": "a", "model": "m"}).encode(),  # not hex
        json.dumps({"fp": "00ff", "tenant": "a", "model": "m"}).encode(),  # 2 bytes
        json.dumps({"fp": fp(7).hex(), "tenant": "a"}).encode(),  # no model
        json.dumps({"fp": fp(8).hex(), "tenant": 5, "model": "m"}).encode(),
        json.dumps({"fp": fp(9).hex(), "tenant": "", "model": "m"}).encode(),
        json.dumps(good[0]).encode(),  # a duplicate: first one wins
        b"",
    ]
    body = [json.dumps(good[0]).encode(), *bad[:5], json.dumps(good[1]).encode(), *bad[5:]]
    body.append(json.dumps(good[2]).encode())
    (tmp_path / FILE_NAME).write_bytes(b"\n".join(body) + b"\n")
    with caplog.at_level(logging.WARNING, logger="kvstore.server.namespaces"):
        reg = NamespaceRegistry.open(tmp_path)
    assert f"skipped {len(bad)} unreadable line" in caplog.text
    assert reg.select("alpha") == {fp(0), fp(1), fp(2)} and len(reg) == 3
    reg.close()
    assert len(lines(tmp_path)) == 3


def test_a_failed_append_keeps_the_entry_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import kvstore.server.namespaces as mod

    reg = NamespaceRegistry.open(tmp_path)
    reg.add(fp(1), "alpha", "m1")

    def full(fd: int, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mod, "_write_all", full)
    with caplog.at_level(logging.WARNING, logger="kvstore.server.namespaces"):
        assert reg.add(fp(2), "alpha", "m2")  # the request that saw it does not fail
    assert "No space left" in caplog.text
    monkeypatch.undo()
    assert reg.add(fp(3), "alpha", "m3")  # this run writes no more: memory only
    assert reg.select("alpha") == {fp(1), fp(2), fp(3)}
    reg.close()
    assert NamespaceRegistry.open(tmp_path).select() == {fp(1)}


def test_past_max_persisted_new_entries_stay_in_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reg = NamespaceRegistry(tmp_path / FILE_NAME, max_persisted=2)
    with caplog.at_level(logging.WARNING, logger="kvstore.server.namespaces"):
        for i in range(4):
            assert reg.add(fp(i), "alpha", f"m{i}")
    assert len(reg) == 4 and len(lines(tmp_path)) == 2
    assert caplog.text.count("its limit") == 1
    reg.close()


def test_an_unusable_file_is_a_storage_error(tmp_path: Path) -> None:
    (tmp_path / FILE_NAME).mkdir()  # a directory where the file should be
    with pytest.raises(StorageError, match="namespace registry"):
        NamespaceRegistry.open(tmp_path)


def test_gateway_records_scopes_and_an_import_carries_names(tmp_path: Path) -> None:
    """A scope a request resolves is recorded; an exported block names it; an import
    on another gateway records the names it came with (and refuses half a name)."""
    src = StoreNode(NodeConfig(node_id="a", dram_bytes=1 << 20, warm=False))
    dst = StoreNode(NodeConfig(node_id="b", dram_bytes=1 << 20, warm=False))
    cfg = ServerConfig(port=0, allow_anonymous=True)
    gw_a = Gateway(src, cfg, NamespaceRegistry.open(tmp_path / "a"))
    gw_b = Gateway(dst, cfg)
    try:
        alpha = Principal("alpha")
        ns = gw_a.books.namespace(alpha, "m1", LAYOUT)
        assert ns is not None and ns.fingerprint() == Namespace("m1", LAYOUT, "alpha").fingerprint()
        assert gw_a.books.names.get(ns.fingerprint()) == ("alpha", "m1")
        v = np.full((1, 2, 1, 8, 1), 7, dtype=np.uint8)
        stored = alpha.scope(fp(1))  # where alpha's write of fp(1) lands, under its scope
        assert src.put(stored, v, namespace=ns)
        (out,) = Maintenance(gw_a).export(ADMIN, [stored], 1 << 20)
        assert out is not None and (out.tenant, out.model) == ("alpha", "m1")

        def item(key: bytes, **names: str) -> ImportItem:
            assert out is not None
            return ImportItem(key, describe(v), out.payload, checksum(v), ns.fingerprint(), **names)

        admin_b = Maintenance(gw_b)
        half, whole = admin_b.import_blocks(
            ADMIN, [item(fp(5), tenant="alpha"), item(stored, tenant="alpha", model="m1")]
        )
        assert isinstance(half, InvalidValue) and whole is True
        assert gw_b.books.names.select("alpha", "m1") == {ns.fingerprint()}
        rows, _ = admin_b.scan(ADMIN, 10, spec=ScanSpec("alpha", "m1"))
        assert [r[0] for r in rows] == [stored]
    finally:
        gw_a.close()
        gw_b.close()
        src.close()
        dst.close()
    assert len(lines(tmp_path / "a")) == 1


# -- bounds (issue 17: a tenant cannot grow the registry without limit) -------------------


def test_a_tenant_past_its_namespace_limit_is_refused_and_others_are_not(
    tmp_path: Path,
) -> None:
    from kvstore.errors import LimitExceeded

    registry = NamespaceRegistry(tmp_path / FILE_NAME)
    layout = "float32:L2:H2:D8:B4"
    for i in range(3):
        ns = Namespace(f"m{i}", layout, "a")
        assert registry.add(ns.fingerprint(), "a", f"m{i}", limit=3)
    extra = Namespace("m3", layout, "a")
    with pytest.raises(LimitExceeded, match="3 namespaces"):
        registry.add(extra.fingerprint(), "a", "m3", limit=3)
    assert not registry.add(Namespace("m1", layout, "a").fingerprint(), "a", "m1", limit=3)
    assert registry.add(Namespace("m3", layout, "b").fingerprint(), "b", "m3", limit=3)
    registry.close()
    reopened = NamespaceRegistry(tmp_path / FILE_NAME)  # earlier runs' namespaces count
    with pytest.raises(LimitExceeded):
        reopened.add(extra.fingerprint(), "a", "m3", limit=3)
    assert len(reopened) == 4
    reopened.close()


def test_the_gateway_refuses_a_new_namespace_past_the_limit_before_storing() -> None:
    from kvstore.errors import LimitExceeded

    config = ServerConfig(port=0, allow_anonymous=True, max_namespaces_per_tenant=2)
    alpha, bravo = Principal("alpha"), Principal("bravo")
    with StoreNode(NodeConfig(dram_bytes=1 << 20)) as node:
        gw = Gateway(node, config)
        layout = "float32:L2:H2:D8:B4"
        assert gw.books.namespace(alpha, "m0", layout) is not None
        assert gw.books.namespace(alpha, "m1", layout) is not None
        with pytest.raises(LimitExceeded):
            gw.books.namespace(alpha, "m2", layout)
        assert gw.books.namespace(alpha, "m0", layout) is not None  # known ones still work
        assert gw.books.namespace(bravo, "m2", layout) is not None  # another tenant's own share
        assert len(gw.books.names) == 3


def test_model_names_are_bounded() -> None:
    from kvstore.errors import ConfigError
    from kvstore.keys import MAX_MODEL_NAME

    Namespace("m" * MAX_MODEL_NAME, "float32:L2:H2:D8")
    with pytest.raises(ConfigError, match="at most 256"):
        Namespace("m" * (MAX_MODEL_NAME + 1), "float32:L2:H2:D8")
    with pytest.raises(ConfigError):
        Namespace("é" * 200, "float32:L2:H2:D8")  # 400 bytes in UTF-8
