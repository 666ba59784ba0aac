"""Gate: kvstore/_proto/ is exactly what ``make proto`` generates from store.proto."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "kvstore" / "_proto"


def _generator():  # scripts/ is not a package: load the script by path
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_proto", module)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    gen = _generator()
    written = gen.generate(tmp_path)
    assert [p.name for p in written] == list(gen.GENERATED)
    for path in written:
        committed = COMMITTED / path.name
        assert committed.exists(), f"{committed} is missing: run 'make proto'"
        assert committed.read_text() == path.read_text(), (
            f"{committed.relative_to(ROOT)} is stale: run 'make proto' and commit the result"
        )


def test_generated_imports_are_package_relative() -> None:
    grpc_module = (COMMITTED / "store_pb2_grpc.py").read_text()
    assert "from . import store_pb2" in grpc_module
    assert "from kvstore.v1" not in grpc_module
    from kvstore._proto import store_pb2

    assert store_pb2.DESCRIPTOR.name == "kvstore/v1/store.proto"  # never rpc.proto
    assert store_pb2.DESCRIPTOR.package == "kvstore.v1"
