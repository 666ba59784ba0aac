"""The vLLM connector's parts that need no vLLM: its config, the never-failing store
wrapper and the paged-KV copies. Runs in the main environment (and in .venv-vllm)."""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from engine import blockstore
from engine.blockstore import GuardedStore, NodeStore
from engine.vllm.page_order import SPLITS, quantized_dtype
from engine.vllm.paged import PagedKV, PageLayout, known_layouts, probe_page_layout
from engine.vllm.store import ConnectorConfig, ConnectorStats
from kvstore import Namespace, StoreNode, prefix_keys
from kvstore.errors import ConfigError, TimeoutError_, Unavailable
from kvstore.layout import KVLayout

LAYOUT = "float32:L3:H2:D8:B4:R0"
VLLM_LOG = logging.getLogger("vllm.kvstore")  # the connector's breaker logs there
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


def resilient(store: Any, clock: Clock, retry_after_s: float = 5.0) -> GuardedStore:
    """The connector's breaker over ``store``, its reconnects spawned inline (no thread)."""
    rs = GuardedStore(lambda: store, retry_after_s=retry_after_s, stats=ConnectorStats(),
                      clock=clock, spawn=lambda fn: fn(), logger=VLLM_LOG)  # fmt: skip
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
        assert rs.lookup(keys) == 0
        assert rs.load(keys, [None] * 4) == [False] * 4
        assert rs.save(keys, [None] * 4) == (0, 0)
        rs.discard(keys)
    assert flaky.calls == 1  # the later calls were skipped without touching the store
    assert (rs.stats.store_errors, rs.stats.skipped_calls) == (1, 3)
    assert not rs.available
    assert warnings(caplog) == 1
    assert flaky.closed == 1  # the failed client was dropped

    clock.now += 5.0  # cool-down over: this call starts a reconnect and is a miss itself
    with caplog.at_level(logging.INFO, logger="vllm.kvstore"):
        assert rs.lookup(keys) == 0
        assert flaky.calls == 1
        assert rs.lookup(keys) == 0  # the new client fails too: no second warning
        assert flaky.calls == 2
        flaky.down = False
        clock.now += 5.0
        rs.lookup(keys)  # reconnects
        assert rs.lookup(keys) == 4
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

    rs = GuardedStore(opener, retry_after_s=1.0, stats=ConnectorStats(), clock=clock,
                      spawn=lambda fn: fn())  # fmt: skip
    assert not rs.open()
    keys = prefix_keys(range(8), 4, NS)
    assert rs.lookup(keys) == 0
    assert (rs.stats.store_errors, len(attempts)) == (1, 1)
    clock.now += 1.0
    assert rs.lookup(keys) == 0  # reconnecting
    assert rs.lookup(keys) == 2
    assert len(attempts) == 2


def test_reconnect_runs_off_the_calling_thread() -> None:
    spawned: list[Any] = []
    flaky = FlakyStore(Unavailable("down"))
    clock = Clock()
    rs = GuardedStore(lambda: flaky, retry_after_s=1.0, stats=ConnectorStats(), clock=clock,
                      spawn=spawned.append)  # fmt: skip
    keys = prefix_keys(range(8), 4, NS)
    assert rs.lookup(keys) == 0
    assert rs.lookup(keys) == 0
    assert len(spawned) == 1  # one reconnect at a time, not one per call
    flaky.down = False
    spawned[0]()
    assert rs.lookup(keys) == 2


def test_node_store_round_trip_and_per_key_misses() -> None:
    layout = KVLayout.parse(LAYOUT)
    keys = prefix_keys(range(12), 4, NS)
    blocks = [torch.randn(layout.block_shape()) for _ in keys]
    with StoreNode(dram_bytes="4MiB") as node:
        rs = resilient(NodeStore(node, NS), Clock())
        assert rs.save(keys[:2], blocks[:2]) == (2, 0)
        assert rs.save(keys[:2], blocks[:2]) == (0, 2)  # already stored
        assert rs.lookup(keys) == 2
        outs = [torch.empty(layout.block_shape()) for _ in keys]
        assert rs.load(keys, outs) == [True, True, False]
        assert all(torch.equal(o, b) for o, b in zip(outs[:2], blocks[:2], strict=True))
        # A wrong-shaped destination is that key's error: a miss, the store stays up.
        assert rs.load(keys[:1], [torch.empty(3)]) == [False]
        assert rs.available and rs.stats.store_errors == 0
        rs.discard(keys[:1])
        assert rs.lookup(keys) == 0


def test_long_prompts_match_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blockstore, "MATCH_SLICE", 2)
    layout = KVLayout.parse(LAYOUT)
    keys = prefix_keys(range(4 * 7), 4, NS)
    with StoreNode(dram_bytes="4MiB") as node:
        rs = resilient(NodeStore(node, NS), Clock())
        rs.save(keys[:5], [torch.randn(layout.block_shape()) for _ in range(5)])
        assert rs.lookup(keys) == 5
        assert rs.lookup(keys[:4]) == 4


# -- paged KV ---------------------------------------------------------------------------
#
# Reference writers, written from the kernels' documented element formulas one element at
# a time (independently of engine/vllm/paged.py's views): (token t, dim d) of a head goes
# to these offsets of the head's key and value regions.


def _vec_offsets(B: int, D: int, itemsize: int) -> tuple[Any, Any]:
    return (lambda t, d: d * B + t), (lambda t, d: t * D + d)


def _amx_offsets(B: int, D: int, itemsize: int) -> tuple[Any, Any]:
    p = 4 // itemsize  # elements per 4-byte word

    def key(t: int, d: int) -> int:  # 16-token groups of head-dim words
        return (t // 16) * 16 * D + (d // p) * 16 * p + (t % 16) * p + d % p

    def value(t: int, d: int) -> int:  # 16-dim groups of token words
        return (d // 16) * B * 16 + (t // p) * 16 * p + (d % 16) * p + t % p

    return key, value


def _shuffled_offsets(B: int, D: int, itemsize: int) -> tuple[Any, Any]:
    """An order no table entry knows, to exercise the probed (indexed) path."""
    n = B * D
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(7)).tolist()
    return (lambda t, d: perm[t * D + d]), (lambda t, d: perm[n - 1 - (t * D + d)])


OFFSETS = {"vec": _vec_offsets, "amx": _amx_offsets, "shuffled": _shuffled_offsets}


def reference_writer(kind: str) -> Any:
    """A reshape_and_cache with the signature of vLLM's, element by element."""

    def write(key: Any, value: Any, key_cache: Any, value_cache: Any, slots: Any) -> None:
        _, H, B, D = key_cache.shape
        k_at, v_at = OFFSETS[kind](B, D, key.element_size())
        for i, slot in enumerate(slots.tolist()):
            page, t = divmod(slot, B)
            for h in range(H):
                kflat = key_cache[page, h].view(-1)
                vflat = value_cache[page, h].view(-1)
                for d in range(D):
                    kflat[k_at(t, d)] = key[i, h, d]
                    vflat[v_at(t, d)] = value[i, h, d]

    return write


def flash_writer(key: Any, value: Any, key_cache: Any, value_cache: Any, slots: Any) -> None:
    """vLLM's GPU reshape_and_cache_flash, from its documented formula: token ``i`` goes
    to ``cache[page, offset]`` of caches ``[pages, B, H, D]`` (whatever their strides)."""
    B = key_cache.shape[1]
    for i, slot in enumerate(slots.tolist()):
        page, t = divmod(slot, B)
        key_cache[page, t] = key[i]
        value_cache[page, t] = value[i]


def layer_tensor(num_pages: int, H: int, B: int, D: int, dtype: Any, strided: bool) -> Any:
    """A zeroed ``[pages, H, B, 2D]`` layer tensor; ``strided``: a view of memory kept
    ``[pages, B, H, 2D]`` (vLLM's LBNHC layout), as vLLM hands some GPU backends'."""
    if strided:
        return torch.zeros(num_pages, B, H, 2 * D, dtype=dtype).transpose(1, 2)
    return torch.zeros(num_pages, H, B, 2 * D, dtype=dtype)


def kernel_pages(
    write: Any,
    blocks: torch.Tensor,
    num_pages: int,
    page_ids: list[int],
    split: str = "regions",
    strided: bool = False,
) -> list[torch.Tensor]:
    """vLLM tensors holding canonical ``blocks`` at ``page_ids``, written the way the
    backend writes them: tokens ``[T, H, D]`` through ``write`` into the key and value
    caches its ``split`` makes of ``[pages, H, B, 2D]``."""
    n, L, _, H, B, D = blocks.shape
    slots = torch.cat([torch.arange(p * B, (p + 1) * B) for p in page_ids])
    layers = []
    for li in range(L):
        kv = layer_tensor(num_pages, H, B, D, blocks.dtype, strided)
        key_cache, value_cache = SPLITS[split](kv, D)
        k = blocks[:, li, 0].permute(0, 2, 1, 3).reshape(n * B, H, D).contiguous()
        v = blocks[:, li, 1].permute(0, 2, 1, 3).reshape(n * B, H, D).contiguous()
        write(k, v, key_cache, value_cache, slots)
        layers.append(kv)
    return layers


def check_round_trip(
    write: Any,
    layout: KVLayout,
    dtype: torch.dtype,
    split: str = "regions",
    strided: bool = False,
) -> PageLayout:
    """Probe ``write``'s order, then gather what it wrote and scatter it back."""
    page = probe_page_layout(write, dtype, layout, split=split)
    blocks = torch.randn(4, *layout.block_shape()).to(dtype)
    page_ids = [5, 6, 0, 3]  # a run of consecutive pages and single ones
    layers = kernel_pages(write, blocks, 8, page_ids, split, strided)
    paged = PagedKV(layers, layout, page)
    assert torch.equal(paged.gather(page_ids), blocks)
    assert torch.equal(paged.gather([3]), blocks[3:])
    for li in range(layout.layers):  # the layer-wise saver's gather, each layer alone
        assert torch.equal(paged.gather_layer(page_ids, li), blocks[:, li : li + 1])
    assert torch.equal(paged.gather(page_ids, on_device=True), blocks)
    H, B, D = layout.kv_heads, layout.block_tokens or 0, layout.head_dim

    def fresh() -> list[torch.Tensor]:
        return [layer_tensor(8, H, B, D, dtype, strided) for _ in layers]

    empty = fresh()
    PagedKV(empty, layout, page).scatter(blocks, page_ids)
    assert all(torch.equal(a, b) for a, b in zip(empty, layers, strict=True))
    by_layer = fresh()  # the layer-wise loader's writes
    for li in reversed(range(layout.layers)):
        PagedKV(by_layer, layout, page).scatter(blocks[:, li : li + 1], page_ids, first_layer=li)
    assert all(torch.equal(a, b) for a, b in zip(by_layer, layers, strict=True))
    return page


@pytest.mark.parametrize(("kind", "path"), [("vec", "vec"), ("amx", "amx"), ("shuffled", "probed")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_copies_follow_each_kernel_order(kind: str, path: str, dtype: torch.dtype) -> None:
    """Every order comes back canonical; known ones take their structured copy."""
    name = str(dtype).removeprefix("torch.")
    layout = KVLayout.parse(f"{name}:L2:H2:D32:B32:R0")
    page = check_round_trip(reference_writer(kind), layout, dtype)
    assert page.name == path
    assert page.structured == (path != "probed")


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_backends_token_order_comes_back_canonical(strided: bool, dtype: torch.dtype) -> None:
    """vLLM's GPU backends keep each token's key then value in a page (and may hand the
    tensors over as strided views): probed as the "flash" order, moved by its index,
    the same code a CUDA engine runs, here on host tensors."""
    name = str(dtype).removeprefix("torch.")
    layout = KVLayout.parse(f"{name}:L2:H2:D32:B16:R0")
    page = check_round_trip(flash_writer, layout, dtype, "tokens", strided)
    assert (page.name, page.split, page.structured) == ("flash", "tokens", False)

    # A kernel that put keys where values go (or doubled a token) is refused, not mapped.
    def swapped(key: Any, value: Any, key_cache: Any, value_cache: Any, slots: Any) -> None:
        flash_writer(value, key, key_cache, value_cache, slots)

    def doubled(key: Any, value: Any, key_cache: Any, value_cache: Any, slots: Any) -> None:
        flash_writer(key, value, key_cache, value_cache, slots.clamp(max=1))

    for bad in (swapped, doubled):
        with pytest.raises(ConfigError, match="cannot map"):
            probe_page_layout(bad, dtype, layout, split="tokens")


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def quantizing(write: Any, fp8: torch.dtype, scale: float = 1.0) -> Any:
    """A quantized cache's reshape_and_cache: keys and values stored as ``fp8`` bytes of
    the value over ``scale``, through ``write``'s order."""

    def q(x: torch.Tensor) -> torch.Tensor:
        return (x.float() / scale).to(fp8).view(torch.uint8)

    def write_fp8(key: Any, value: Any, key_cache: Any, value_cache: Any, slots: Any) -> None:
        write(q(key), q(value), key_cache, value_cache, slots)

    return write_fp8


def fp8_pages(
    write: Any, keys: torch.Tensor, num_pages: int, page_ids: list[int], split: str
) -> list[torch.Tensor]:
    """uint8 layer tensors ``[pages, H, B, 2D]`` (as vLLM allocates an fp8 cache) after
    ``write`` stored ``keys`` (model-dtype blocks ``[n, L, 2, H, B, D]``) at
    ``page_ids``."""
    n, L, _, H, B, D = keys.shape
    slots = torch.cat([torch.arange(p * B, (p + 1) * B) for p in page_ids])
    layers = []
    for li in range(L):
        kv = torch.zeros(num_pages, H, B, 2 * D, dtype=torch.uint8)
        key_cache, value_cache = SPLITS[split](kv, D)
        k, v = (keys[:, li, i].permute(0, 2, 1, 3).reshape(n * B, H, D) for i in (0, 1))
        write(k.contiguous(), v.contiguous(), key_cache, value_cache, slots)
        layers.append(kv)
    return layers


def check_fp8_round_trip(
    write: Any,
    fp8: torch.dtype,
    layout: KVLayout,
    split: str = "regions",
    source: torch.dtype = torch.float32,
    exact: bool = True,
) -> PageLayout:
    """Probe a quantized cache's order by value, then: its pages gather into the KV's
    fp8 bytes in canonical order (``exact``: torch's rounding of each value; else
    within one fp8 step of it: vLLM's CPU kernel rounds toward zero), and those scatter
    back into the same pages."""
    page = probe_page_layout(write, torch.uint8, layout, split=split, fp8=fp8, source=source)
    kv = (torch.randn(3, *layout.block_shape()) * 2).to(source)
    page_ids = [4, 0, 2]
    layers = fp8_pages(write, kv, 6, page_ids, split)
    paged = PagedKV(layers, layout, page)
    got = paged.gather(page_ids)
    assert got.dtype == fp8
    if exact:
        assert torch.equal(got.view(torch.uint8), kv.float().to(fp8).view(torch.uint8))
    else:  # a misplaced element would be another value altogether
        step, tiny = {torch.float8_e4m3fn: (2**-3, 2**-9), torch.float8_e5m2: (2**-2, 2**-16)}[fp8]
        assert torch.allclose(got.float(), kv.float(), rtol=step, atol=tiny)
    for li in range(layout.layers):
        layer = paged.gather_layer(page_ids, li)
        assert torch.equal(layer.view(torch.uint8), got[:, li : li + 1].view(torch.uint8))
    empty = [torch.zeros_like(t) for t in layers]
    PagedKV(empty, layout, page).scatter(got, page_ids)
    assert all(torch.equal(a, b) for a, b in zip(empty, layers, strict=True))
    return page


KINDS = [("vec", "regions"), ("amx", "regions"), ("shuffled", "regions"), ("flash", "tokens")]


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize(("kind", "split"), KINDS)
def test_fp8_pages_are_probed_by_value_and_stored_as_their_bytes(
    fp8: torch.dtype, kind: str, split: str
) -> None:
    """vLLM's fp8 KV cache (``kv_cache_dtype`` fp8, fp8_e5m2): uint8 pages the kernel
    writes by arithmetic. Their order is learned from values, and the blocks are the
    fp8 bytes in canonical order, moved as bytes both ways (no conversion)."""
    name = str(fp8).removeprefix("torch.")
    layout = KVLayout.parse(f"{name}:L2:H2:D32:B32:R0")
    inner = flash_writer if kind == "flash" else reference_writer(kind)
    page = check_fp8_round_trip(quantizing(inner, fp8), fp8, layout, split, torch.float32)
    assert page.name == {"shuffled": "probed"}.get(kind, kind)


def test_a_quantized_probe_refuses_a_kernel_it_cannot_read() -> None:
    """Bytes at another scale than 1 (or another fp8 format) do not read back as the
    probe's digits: refused at start, never stored as if they were."""
    layout = KVLayout.parse("float8_e4m3fn:L1:H1:D32:B32")
    e4m3 = torch.float8_e4m3fn
    for bad in (quantizing(reference_writer("vec"), e4m3, scale=2.0),
                quantizing(reference_writer("vec"), torch.float8_e5m2)):  # fmt: skip
        with pytest.raises(ConfigError, match="cannot map"):
            probe_page_layout(bad, torch.uint8, layout, fp8=e4m3)
    with pytest.raises(ConfigError, match="dtype"):  # uint8 pages for a bf16 layout
        PagedKV([torch.zeros(4, 1, 32, 64, dtype=torch.uint8)], KVLayout.parse(
            "bfloat16:L1:H1:D32:B32"), known_layouts(32, 32, 2)[0])  # fmt: skip


def test_a_strided_tensor_is_refused_where_the_structured_copy_needs_views() -> None:
    layout = KVLayout.parse("float32:L1:H2:D8:B4:R0")
    vec = known_layouts(4, 8, 4)[0]
    with pytest.raises(ConfigError, match="contiguous"):
        PagedKV([layer_tensor(4, 2, 4, 8, torch.float32, True)], layout, vec)


def test_probe_refuses_an_order_it_cannot_map() -> None:
    layout = KVLayout.parse("float32:L1:H1:D16:B16")

    def lossy(key: Any, value: Any, key_cache: Any, value_cache: Any, slots: Any) -> None:
        reference_writer("vec")(key, value, key_cache, value_cache, slots)
        key_cache[0, 0, 0, 0] = key_cache[0, 0, 0, 1]  # one element doubled, one lost

    with pytest.raises(ConfigError, match="cannot map"):
        probe_page_layout(lossy, torch.float32, layout)

    def swapped(key: Any, value: Any, key_cache: Any, value_cache: Any, slots: Any) -> None:
        reference_writer("vec")(value, key, key_cache, value_cache, slots)  # K and V swapped

    with pytest.raises(ConfigError, match="cannot map"):
        probe_page_layout(swapped, torch.float32, layout)


def test_paged_refuses_what_it_does_not_know() -> None:
    layout = KVLayout.parse(LAYOUT)
    page = known_layouts(4, 8, 4)[0]
    good = [torch.zeros(4, 2, 4, 16) for _ in range(3)]
    with pytest.raises(ConfigError, match="page layout"):
        PagedKV([torch.zeros(2, 4, 4, 2, 8)] * 3, layout, page)
    with pytest.raises(ConfigError, match="dtype"):
        PagedKV([t.half() for t in good], layout, page)
    with pytest.raises(ConfigError, match="2 KV tensors"):
        PagedKV(good[:2], layout, page)
    with pytest.raises(ConfigError, match="block size"):
        PagedKV(good, KVLayout.parse("float32:L3:H2:D8"), page)
    with pytest.raises(ConfigError, match="another tile size"):
        PagedKV(good, layout, known_layouts(8, 8, 4)[0])
    paged = PagedKV(good, layout, page)
    with pytest.raises(IndexError):
        paged.gather([4])
    with pytest.raises(ValueError, match="block ids"):
        paged.scatter(torch.zeros(2, *layout.block_shape()), [0])


# -- vLLM's own kernels (in .venv-vllm) -------------------------------------------------

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM runs in .venv-vllm (make test-vllm)"
)
# The CPU kernels of vLLM's x86 builds (their reshape_and_cache is plain copies, so each
# runs whatever the CPU: amx's too, without AMX); one a build lacks is skipped.
KERNELS = [("vec", "float32"), ("vec", "bfloat16"), ("vec16", "float32"),
           ("vec16", "bfloat16"), ("amx", "bfloat16")]  # fmt: skip


def vllm_writer(isa: str) -> Any:
    from vllm import _custom_ops as ops

    def write(key: Any, value: Any, key_cache: Any, value_cache: Any, slots: Any) -> None:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    return write


@functools.cache
def compiled(isa: str, dtype: str) -> bool:
    """Whether this vLLM build carries ``isa``'s reshape_and_cache for ``dtype``."""
    layout = KVLayout.parse(f"{dtype}:L1:H1:D32:B32")
    try:
        probe_page_layout(vllm_writer(isa), getattr(torch, dtype), layout)
    except (RuntimeError, ConfigError):
        return False
    return True


@needs_vllm
@pytest.mark.parametrize(("isa", "dtype"), KERNELS)
@pytest.mark.parametrize("geometry", ["H2:D32:B32", "H3:D64:B64", "H1:D128:B32"])
def test_real_kernel_pages_come_back_canonical(isa: str, dtype: str, geometry: str) -> None:
    if not compiled(isa, dtype):
        pytest.skip(f"this vLLM build has no {isa} kernel for {dtype}")
    layout = KVLayout.parse(f"{dtype}:L2:{geometry}:R0")
    page = check_round_trip(vllm_writer(isa), layout, getattr(torch, dtype))
    assert page.structured, f"{isa} took the indexed path"


@needs_vllm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_saved_through_one_kernel_load_through_another(dtype: str) -> None:
    """A prefill engine's pages (one kernel) -> canonical blocks -> a decode engine's
    pages (another kernel) equal what the second kernel writes for the same KV."""
    layout = KVLayout.parse(f"{dtype}:L2:H2:D64:B32:R0")
    torch_dtype = getattr(torch, dtype)
    kernels = [isa for isa, dt in KERNELS if dt == dtype and compiled(isa, dt)]
    if len(kernels) < 2:
        pytest.skip(f"this vLLM build has fewer than two {dtype} kernels")
    blocks = torch.randn(3, *layout.block_shape()).to(torch_dtype)
    for src in kernels:
        written = kernel_pages(vllm_writer(src), blocks, 4, [2, 0, 3])
        page = probe_page_layout(vllm_writer(src), torch_dtype, layout)
        stored = PagedKV(written, layout, page).gather([2, 0, 3]).clone()
        assert torch.equal(stored, blocks)
        for dst in kernels:
            want = kernel_pages(vllm_writer(dst), blocks, 5, [4, 1, 2])
            got = [torch.zeros_like(t) for t in want]
            dst_page = probe_page_layout(vllm_writer(dst), torch_dtype, layout)
            PagedKV(got, layout, dst_page).scatter(stored, [4, 1, 2])
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (src, dst)


@needs_vllm
@pytest.mark.process  # vLLM's platform check runs `file` on the interpreter
@pytest.mark.parametrize("isa", ["vec", "amx"])  # vLLM's fp8 kernels on x86 (vec16 has none)
@pytest.mark.parametrize("cache", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("source", ["float32", "bfloat16"])
@pytest.mark.parametrize("geometry", ["H2:D32:B32", "H1:D64:B64"])
def test_real_fp8_kernel_pages_come_back_canonical(
    isa: str, cache: str, source: str, geometry: str
) -> None:
    """vLLM's CPU kernels for an fp8 cache, each of them whatever this CPU picks (their
    reshape_and_cache is plain stores), where vLLM runs fp8 at all: probed by value,
    their pages gather into the KV's fp8 bytes (within one fp8 step: they round toward
    zero) and scatter back. vec's order is a known structured one; amx packs fp8 pages
    in an order the table does not hold, which takes the indexed path."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    dtype = getattr(torch, source)
    _, head, block = geometry.split(":")
    try:
        _get_attn_isa(dtype, int(block[1:]), int(head[1:]), cache)
    except NotImplementedError as exc:  # fp8 on CPU: x86 with AVX-512 or AMX only
        pytest.skip(str(exc))

    def write(key: Any, value: Any, key_cache: Any, value_cache: Any, slots: Any) -> None:
        ops.cpu_attn_reshape_and_cache(
            key, value, key_cache, value_cache, slots, isa, 1.0, 1.0, cache
        )

    fp8 = quantized_dtype(cache)
    assert fp8 is not None
    layout = KVLayout.parse(f"{str(fp8).removeprefix('torch.')}:L2:{geometry}:R0")
    page = check_fp8_round_trip(write, fp8, layout, source=dtype, exact=False)
    if isa == "vec":
        assert page.structured, f"vec with {cache} took the indexed path"


@needs_vllm
@pytest.mark.process  # importing vLLM's platform runs `file` on the interpreter
def test_fp8_kv_at_a_scale_other_than_one_is_refused() -> None:
    """fp8 bytes mean value / scale; the namespace carries no scale, so an engine whose
    layers have other scales (from its checkpoint, or computed) is refused at start."""
    from types import SimpleNamespace

    from engine.vllm.worker_side import check_kv_scales

    def config(cache: str, scales: tuple[float, float], calculate: bool = False) -> Any:
        layer = SimpleNamespace(_k_scale_float=scales[0], _v_scale_float=scales[1])
        return SimpleNamespace(
            cache_config=SimpleNamespace(cache_dtype=cache, calculate_kv_scales=calculate),
            compilation_config=SimpleNamespace(static_forward_context={"l0": layer}),
        )

    check_kv_scales(config("fp8", (1.0, 1.0)), ["l0"])
    check_kv_scales(config("auto", (0.5, 1.0)), ["l0"])  # unquantized: scales unused
    with pytest.raises(ConfigError, match="scale of 1"):
        check_kv_scales(config("fp8", (1.0, 0.25)), ["l0"])
    with pytest.raises(ConfigError, match="calculate_kv_scales"):
        check_kv_scales(config("fp8_e5m2", (1.0, 1.0), calculate=True), ["l0"])
    with pytest.raises(ConfigError, match="unknown"):
        check_kv_scales(config("fp8", (1.0, 1.0)), ["l1"])


@needs_vllm
@pytest.mark.process  # importing vLLM's platform runs `file` on the interpreter
def test_keys_name_what_the_kv_depends_on() -> None:
    """A request's keys: the plain chain (the transformers adapter's too) for a plain
    prompt; a chain of its own under a LoRA adapter or a cache_salt (never another's
    blocks); none for a multimodal or embedding prompt, whose placeholder ids do not
    name its inputs (no lookup, no save)."""
    from types import SimpleNamespace

    from engine.vllm.keys import chain_root
    from engine.vllm.scheduler_side import SchedulerSide

    ns = Namespace("tiny-keys", "float32:L2:H2:D32:B32:R0")
    ids = list(range(100, 228))  # four full blocks
    bare = {"lora_request": None, "cache_salt": None, "mm_features": [], "prompt_embeds": None}

    def request(rid: str, **kw: Any) -> Any:
        n = len(ids)
        return SimpleNamespace(
            request_id=rid, prompt_token_ids=ids, num_prompt_tokens=n, **{**bare, **kw}
        )

    def planned(side: SchedulerSide, rid: str) -> list[bytes]:
        so = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=rid, num_computed_tokens=0)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={rid: len(ids)},
            kv_connector_block_state=SimpleNamespace(get_block_ids=lambda r: ([1, 2, 3, 4],)),
        )
        return [k for t in side.build_meta(so).saves for k in t.keys]  # type: ignore[arg-type]

    lora = SimpleNamespace(lora_name="sql-adapter", lora_path="/adapters/sql", lora_int_id=1)
    kinds = {"plain": {}, "salt": {"cache_salt": "a"}, "salt2": {"cache_salt": "a"},
             "other": {"cache_salt": "b"}, "lora": {"lora_request": lora}}  # fmt: skip
    with StoreNode(dram_bytes="4MiB") as node:
        rs = resilient(NodeStore(node, ns), Clock())
        side = SchedulerSide(ns, rs, ConnectorStats(), load_enabled=True, save_enabled=True)
        keys = {}
        for rid, kw in kinds.items():
            assert side.matched_tokens(request(rid, **kw), 0) == 0  # nothing stored yet
            keys[rid] = planned(side, rid)
        assert keys["plain"] == list(prefix_keys(ids, 32, ns))
        assert keys["salt"] == keys["salt2"]  # one salt: one chain
        assert len({tuple(keys[r]) for r in ("plain", "salt", "other", "lora")}) == 4
        assert rs.save(keys["plain"], [torch.zeros(2, 2, 2, 32, 32)] * 4) == (4, 0)
        assert side.matched_tokens(request("plain2"), 0) == 96  # the last block: computed
        assert side.matched_tokens(request("salt3", cache_salt="a"), 0) == 0
        assert side.matched_tokens(request("lora2", lora_request=lora), 0) == 0
        lookups = side.stats.lookups
        mm = request("mm", mm_features=[SimpleNamespace(identifier="img")])
        assert side.matched_tokens(mm, 0) == 0 and planned(side, "mm") == []
        assert side.matched_tokens(request("emb", prompt_embeds=torch.zeros(1)), 0) == 0
        assert side.stats.lookups == lookups  # the store was never asked
        # save_decode: a prompt shorter than a block chains its answer from its own
        # root too (a salted answer never lands under the plain chain)
        saver = SchedulerSide(ns, rs, ConnectorStats(), load_enabled=False, save_enabled=True,
                              save_decode=True)  # fmt: skip
        short = request("short", cache_salt="a")
        short.prompt_token_ids, short.num_prompt_tokens = ids[:10], 10
        short.all_token_ids = ids[:70]  # 60 generated
        saver.matched_tokens(short, 0)
        so = SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=["short"], num_computed_tokens=[68]),
            num_scheduled_tokens={"short": 1},  # the step computing token 69 of 70
            kv_connector_block_state=SimpleNamespace(get_block_ids=lambda r: ([1, 2, 3],)),
        )
        saved = [k for t in saver.build_meta(so).saves for k in t.keys]  # type: ignore[arg-type]
        root = chain_root(ns, 32, salt="a")
        assert saved == list(prefix_keys(ids[:64], 32, ns, parent=root))
        assert not set(saved) & set(prefix_keys(ids[:64], 32, ns))


def test_quantized_cache_names() -> None:
    assert quantized_dtype("auto") is None
    assert quantized_dtype("fp8") == quantized_dtype("fp8_e4m3") == torch.float8_e4m3fn
    assert quantized_dtype("fp8_e5m2") == torch.float8_e5m2
    with pytest.raises(ConfigError, match="fp8_inc"):
        quantized_dtype("fp8_inc")


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_steps_loads_land_layer_by_layer_or_whole_and_fail_per_request(
    layerwise: bool,
) -> None:
    """engine/vllm/loads.py over an in-process store and real page tensors: every
    request's hits in one batch per layer, each layer awaitable on its own; a request
    whose second block misses loads its first only, and that key is offered for removal."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.vllm.loads import BlockTransfer, StepLoad

    ns = Namespace("tiny-steps", "float32:L2:H2:D32:B32:R0")
    layout = KVLayout.parse(ns.layout)
    page = probe_page_layout(reference_writer("vec"), torch.float32, layout)
    blocks = torch.randn(4, *layout.block_shape())
    keys = list(prefix_keys(range(4 * 32), 32, ns))
    want = kernel_pages(reference_writer("vec"), blocks[:3], 8, [5, 6, 0])
    with StoreNode(dram_bytes="4MiB") as node:
        rs = resilient(NodeStore(node, ns), Clock())
        assert rs.save(keys[:3], list(blocks[:3])) == (3, 0)  # keys[3] is never stored
        pages = [torch.zeros_like(t) for t in want]
        paged = PagedKV(pages, layout, page)
        items = [BlockTransfer("a", keys[:2], [5, 6]), BlockTransfer("b", keys[2:], [0, 3])]
        pool = ThreadPoolExecutor(1) if layerwise else None
        try:
            step = StepLoad(items, rs, paged, chunk=2, executor=pool)
            for li in range(layout.layers):
                step.wait(li)
                for pid in (5, 6, 0):  # this layer of every loaded block is in place
                    assert torch.equal(pages[li][pid], want[li][pid])
            assert [(it.req_id, good) for it, good in step.outcome()] == [("a", 2), ("b", 1)]
            assert step.failed_keys() == [keys[3]]
            assert not pages[0][3].any() and not pages[1][3].any()
        finally:
            if pool is not None:
                pool.shutdown()


@pytest.mark.parametrize("gather_in_saver", [False, True])
def test_a_steps_saves_go_layer_by_layer_and_withdraw_failed_requests(
    gather_in_saver: bool,
) -> None:
    """engine/vllm/saves.py over an in-process store and real page tensors: each layer
    handed over is sent beside the forward, a layer never handed over is sent at the
    end, the commit stores whole canonical blocks, and a request whose load failed
    has its blocks withdrawn."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.vllm.loads import BlockTransfer
    from engine.vllm.saves import StepSave

    ns = Namespace("tiny-saves", "float32:L3:H2:D32:B32:R0")
    layout = KVLayout.parse(ns.layout)
    page = probe_page_layout(reference_writer("vec"), torch.float32, layout)
    blocks = torch.randn(4, *layout.block_shape())
    keys = list(prefix_keys(range(4 * 32), 32, ns))
    pages = kernel_pages(reference_writer("vec"), blocks, 8, [5, 6, 0, 3])
    paged = PagedKV(pages, layout, page)
    items = [BlockTransfer("a", keys[:3], [5, 6, 0]), BlockTransfer("b", keys[3:], [3])]
    pool = ThreadPoolExecutor(1)
    with StoreNode(dram_bytes="4MiB") as node:
        rs = resilient(NodeStore(node, ns), Clock())
        try:
            with torch.inference_mode():  # as vLLM's forward runs (its buffers are made so)
                step = StepSave(items, rs, paged, 2, pool, gather_in_saver=gather_in_saver)
                step.layer(0)
                step.layer(1)  # layer 2 never handed over: finish sends it
                assert node.match_prefix(keys) == 0  # nothing visible before the commit
                assert step.finish({"b"}) == (3, 0, 1)
                # the same blocks again: stored already
                again = StepSave(items[:1], rs, paged, chunk=8, executor=pool)
                assert again.finish(set()) == (0, 3, 0)
        finally:
            pool.shutdown()
        outs = [torch.empty(layout.block_shape()) for _ in keys]
        assert node.batch_get_into(keys, outs, namespace=ns) == [True, True, True, False]
        for i in range(3):
            assert torch.equal(outs[i], blocks[i])
        assert rs.stats.store_errors == 0


def test_a_save_whose_store_fails_stores_nothing_and_marks_it_down() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from engine.vllm.loads import BlockTransfer
    from engine.vllm.saves import StepSave

    ns = Namespace("tiny-saves-down", "float32:L2:H2:D32:B32:R0")
    layout = KVLayout.parse(ns.layout)
    page = probe_page_layout(reference_writer("vec"), torch.float32, layout)
    pages = kernel_pages(reference_writer("vec"), torch.randn(1, *layout.block_shape()), 4, [1])
    keys = list(prefix_keys(range(32), 32, ns))

    class FailingWrites(NodeStore):
        def begin_layers(self, keys: Sequence[bytes], *, shape: Any, dtype: Any) -> Any:
            w = super().begin_layers(keys, shape=shape, dtype=dtype)
            real = w.write

            def write(layer: int, values: Any) -> None:
                if layer == 1:
                    raise Unavailable("store went away (test)")
                real(layer, values)

            w.write = write  # type: ignore[method-assign]
            return w

    pool = ThreadPoolExecutor(1)
    with StoreNode(dram_bytes="4MiB") as node:
        rs = resilient(FailingWrites(node, ns), Clock())
        try:
            used = node.stats()["tiers"]["dram"]["used"]
            step = StepSave([BlockTransfer("a", keys, [1])], rs, PagedKV(pages, layout, page),
                            chunk=8, executor=pool)  # fmt: skip
            assert step.finish(set()) == (0, 0, 0)
        finally:
            pool.shutdown()
        assert node.match_prefix(keys) == 0
        assert node.stats()["tiers"]["dram"]["used"] == used  # the reservation is freed
        assert rs.stats.store_errors == 1 and not rs.available


def test_transfer_cores_stay_off_the_forwards_cores() -> None:
    """engine/vllm/cpus.py: with vLLM's OpenMP team bound to a list, the transfer
    threads take the process's other cores; lists parse strictly; a thread is pinned."""
    import os
    import threading

    from engine.vllm.cpus import host_cpus, parse_cpu_list, pin_this_thread, transfer_cpus

    assert parse_cpu_list("0-3,6") == {0, 1, 2, 3, 6}
    assert parse_cpu_list("0-1|2-3") == {0, 1, 2, 3}
    for bad in ("", "a", "3-1", "-1"):
        with pytest.raises(ConfigError, match="CPU list"):
            parse_cpu_list(bad)
    allowed = os.sched_getaffinity(0)
    assert allowed <= host_cpus()
    first = min(allowed)
    assert transfer_cpus("none", "0") is None
    assert transfer_cpus("auto", "auto") is None and transfer_cpus("auto", "nobind") is None
    assert transfer_cpus("auto", str(first)) == (host_cpus() - {first} or None)
    assert transfer_cpus(str(first)) == {first}
    with pytest.raises(ConfigError, match="none of them"):
        transfer_cpus("100000")
    seen: list[set[int]] = []

    def run() -> None:
        pin_this_thread({first})
        seen.append(os.sched_getaffinity(0))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == [{first}] and os.sched_getaffinity(0) == allowed  # that thread only
