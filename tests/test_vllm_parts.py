"""The vLLM connector's parts that need no vLLM: its config, the never-failing store
wrapper and the paged-KV copies. Runs in the main environment (and in .venv-vllm)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from engine import vllm_store
from engine.vllm_paged import PagedKV
from engine.vllm_store import ConnectorConfig, ConnectorStats, NodeStore, ResilientStore
from kvstore import Namespace, StoreNode, prefix_keys
from kvstore.errors import ConfigError, TimeoutError_, Unavailable
from kvstore.layout import KVLayout

LAYOUT = "float32:L3:H2:D8:B4:R0"
NS = Namespace("tiny", LAYOUT)


# -- config ------------------------------------------------------------------------------


def test_config_parses_and_coerces_ints_to_floats() -> None:
    c = ConnectorConfig.from_extra(
        {"endpoint": "127.0.0.1:7400", "timeout_s": 3, "retries": 0, "verify": False}
    )
    assert (c.endpoint, c.timeout_s, c.retries, c.verify) == ("127.0.0.1:7400", 3.0, 0, False)
    assert "token" not in repr(ConnectorConfig("h:1", token="secret"))


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({}, "endpoint"),
        ({"endpoint": "h:1", "timout_s": 1.0}, "unknown .*timout_s"),
        ({"endpoint": "h:1", "timeout_s": "1"}, "timeout_s.*expected float"),
        ({"endpoint": "h:1", "retries": True}, "retries.*expected int"),
        ({"endpoint": "h:1", "verify": 1}, "verify.*expected bool"),
        ({"endpoint": "h:1", "max_blocks_per_call": 0}, "max_blocks_per_call"),
        ({"endpoint": "h:1", "retry_after_s": -1}, "retry_after_s"),
    ],
)
def test_config_refuses_bad_values(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ConnectorConfig.from_extra(extra)


# -- the resilient store ----------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FlakyStore:
    """A store whose every call raises ``error`` while ``down``; counts calls."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.down = True
        self.calls = 0
        self.closed = 0

    def _maybe_fail(self) -> None:
        self.calls += 1
        if self.down:
            raise self.error

    def batch_put(self, keys: Sequence[bytes], values: Sequence[Any]) -> list[Any]:
        self._maybe_fail()
        return [True] * len(keys)

    def batch_get_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[Any]:
        self._maybe_fail()
        return [True] * len(keys)

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        self._maybe_fail()
        return len(keys)

    def remove(self, keys: Sequence[bytes]) -> int:
        self._maybe_fail()
        return 0

    def close(self) -> None:
        self.closed += 1


def resilient(store: Any, clock: Clock, retry_after_s: float = 5.0) -> ResilientStore:
    """A ResilientStore over ``store`` whose reconnects run inline (no thread)."""
    rs = ResilientStore(lambda: store, retry_after_s=retry_after_s, stats=ConnectorStats(),
                        clock=clock, spawn=lambda fn: fn())  # fmt: skip
    assert rs.open()
    return rs


def warnings(caplog: pytest.LogCaptureFixture) -> int:
    return len([r for r in caplog.records if r.levelno == logging.WARNING])


@pytest.mark.parametrize("error", [Unavailable("refused"), TimeoutError_("slow"), OSError("x")])
def test_failures_are_misses_logged_once_then_skipped(
    error: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    clock, flaky = Clock(), FlakyStore(error)
    rs = resilient(flaky, clock)
    keys = prefix_keys(range(16), 4, NS)
    with caplog.at_level(logging.INFO, logger="vllm.kvstore"):
        assert rs.match_prefix(keys) == 0
        assert rs.get_into(keys, [None] * 4) == [False] * 4
        assert rs.put(keys, [None] * 4) == (0, 0)
        rs.remove(keys)
    assert flaky.calls == 1  # the later calls were skipped without touching the store
    assert (rs.stats.store_errors, rs.stats.skipped_calls) == (1, 3)
    assert not rs.available
    assert warnings(caplog) == 1
    assert flaky.closed == 1  # the failed client was dropped

    clock.now += 5.0  # cool-down over: this call starts a reconnect and is a miss itself
    with caplog.at_level(logging.INFO, logger="vllm.kvstore"):
        assert rs.match_prefix(keys) == 0
        assert flaky.calls == 1
        assert rs.match_prefix(keys) == 0  # the new client fails too: no second warning
        assert flaky.calls == 2
        flaky.down = False
        clock.now += 5.0
        rs.match_prefix(keys)  # reconnects
        assert rs.match_prefix(keys) == 4
    assert "reachable again" in caplog.records[-1].getMessage()
    assert warnings(caplog) == 1


def test_store_down_at_start_is_a_miss_and_reconnects_later() -> None:
    clock = Clock()
    attempts: list[int] = []
    up = FlakyStore(OSError())
    up.down = False

    def opener() -> Any:
        attempts.append(1)
        if len(attempts) == 1:
            raise Unavailable("connection refused")
        return up

    rs = ResilientStore(opener, retry_after_s=1.0, stats=ConnectorStats(), clock=clock,
                        spawn=lambda fn: fn())  # fmt: skip
    assert not rs.open()
    keys = prefix_keys(range(8), 4, NS)
    assert rs.match_prefix(keys) == 0
    assert (rs.stats.store_errors, len(attempts)) == (1, 1)
    clock.now += 1.0
    assert rs.match_prefix(keys) == 0  # reconnecting
    assert rs.match_prefix(keys) == 2
    assert len(attempts) == 2


def test_reconnect_runs_off_the_calling_thread() -> None:
    spawned: list[Any] = []
    flaky = FlakyStore(Unavailable("down"))
    clock = Clock()
    rs = ResilientStore(lambda: flaky, retry_after_s=1.0, stats=ConnectorStats(), clock=clock,
                        spawn=spawned.append)  # fmt: skip
    keys = prefix_keys(range(8), 4, NS)
    assert rs.match_prefix(keys) == 0
    assert rs.match_prefix(keys) == 0
    assert len(spawned) == 1  # one reconnect at a time, not one per call
    flaky.down = False
    spawned[0]()
    assert rs.match_prefix(keys) == 2


def test_node_store_round_trip_and_per_key_misses() -> None:
    layout = KVLayout.parse(LAYOUT)
    keys = prefix_keys(range(12), 4, NS)
    blocks = [torch.randn(layout.block_shape()) for _ in keys]
    with StoreNode(dram_bytes="4MiB") as node:
        rs = resilient(NodeStore(node, NS), Clock())
        assert rs.put(keys[:2], blocks[:2]) == (2, 0)
        assert rs.put(keys[:2], blocks[:2]) == (0, 2)  # already stored
        assert rs.match_prefix(keys) == 2
        outs = [torch.empty(layout.block_shape()) for _ in keys]
        assert rs.get_into(keys, outs) == [True, True, False]
        assert all(torch.equal(o, b) for o, b in zip(outs[:2], blocks[:2], strict=True))
        # A wrong-shaped destination is that key's error: a miss, the store stays up.
        assert rs.get_into(keys[:1], [torch.empty(3)]) == [False]
        assert rs.available and rs.stats.store_errors == 0
        rs.remove(keys[:1])
        assert rs.match_prefix(keys) == 0


def test_long_prompts_match_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_store, "MATCH_SLICE", 2)
    layout = KVLayout.parse(LAYOUT)
    keys = prefix_keys(range(4 * 7), 4, NS)
    with StoreNode(dram_bytes="4MiB") as node:
        rs = resilient(NodeStore(node, NS), Clock())
        rs.put(keys[:5], [torch.randn(layout.block_shape()) for _ in range(5)])
        assert rs.match_prefix(keys) == 5
        assert rs.match_prefix(keys[:4]) == 4


# -- paged KV ---------------------------------------------------------------------------


def cpu_pages(
    blocks: torch.Tensor, num_pages: int, page_ids: list[int], transposed: bool
) -> list[torch.Tensor]:
    """vLLM CPU-backend tensors holding ``blocks`` at ``page_ids``, built independently of
    PagedKV: per page and head, the key tile (transposed or not) then the value tile."""
    _, L, _, H, B, D = blocks.shape
    layers = [torch.zeros(num_pages, H, B, 2 * D, dtype=blocks.dtype) for _ in range(L)]
    for j, page in enumerate(page_ids):
        for li in range(L):
            for h in range(H):
                k = blocks[j, li, 0, h]
                k = k.t() if transposed else k
                flat = torch.cat([k.reshape(-1), blocks[j, li, 1, h].reshape(-1)])
                layers[li][page, h] = flat.view(B, 2 * D)
    return layers


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_gather_and_scatter_follow_the_page_layout(
    transposed: bool, dtype: torch.dtype
) -> None:
    layout = KVLayout.parse(LAYOUT.replace("float32", str(dtype).removeprefix("torch.")))
    blocks = torch.randn(5, *layout.block_shape()).to(dtype)
    page_ids = [5, 6, 0, 2, 3]  # runs of consecutive pages and single ones
    layers = cpu_pages(blocks, 8, page_ids, transposed)
    paged = PagedKV(layers, layout, keys_transposed=transposed)
    assert torch.equal(paged.gather(page_ids), blocks)
    assert torch.equal(paged.gather([3]), blocks[4:])

    empty = [torch.zeros_like(t) for t in layers]
    PagedKV(empty, layout, keys_transposed=transposed).scatter(blocks, page_ids)
    assert all(torch.equal(a, b) for a, b in zip(empty, layers, strict=True))


def test_paged_refuses_what_it_does_not_know() -> None:
    layout = KVLayout.parse(LAYOUT)
    good = [torch.zeros(4, 2, 4, 16) for _ in range(3)]
    with pytest.raises(ConfigError, match="page layout"):
        PagedKV([torch.zeros(2, 4, 4, 2, 8)] * 3, layout, keys_transposed=True)
    with pytest.raises(ConfigError, match="dtype"):
        PagedKV([t.half() for t in good], layout, keys_transposed=True)
    with pytest.raises(ConfigError, match="2 KV tensors"):
        PagedKV(good[:2], layout, keys_transposed=True)
    with pytest.raises(ConfigError, match="block size"):
        PagedKV(good, KVLayout.parse("float32:L3:H2:D8"), keys_transposed=True)
    paged = PagedKV(good, layout, keys_transposed=True)
    with pytest.raises(IndexError):
        paged.gather([4])
    with pytest.raises(ValueError, match="block ids"):
        paged.scatter(torch.zeros(2, *layout.block_shape()), [0])
