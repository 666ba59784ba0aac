"""How vLLM's attention kernels arrange a page's bytes, learned from the kernels.

vLLM allocates one tensor per attention layer whose logical shape is the same for every
backend, ``[num_blocks, kv_heads, block_tokens, 2 * head_dim]`` (vLLM's ``[B, H, N, C]``,
whatever order it keeps them in memory). What differs is how a backend's
``reshape_and_cache`` reads a page as keys and values (its *split*):

- ``regions`` (the CPU backend, cpu_attn.py): each page and head is a key region
  followed by a value region of ``block_tokens * head_dim`` elements
  (``view(n, H, 2B, D).chunk(2, dim=2)``), and inside a region the kernel's ISA decides
  the order:

  - ``vec`` / ``vec16`` (AVX-512, AVX2, generic): the key tile transposed, ``[D, B]``;
    the value tile token-major, ``[B, D]``.
  - ``amx`` (bf16 on AMX): tiles packed for AMX B-matrices, in 4-byte pairs of elements
    (p = 4 / itemsize): keys as ``[B/16, D/p, 16, p]`` (16-token groups of head-dim
    pairs), values as ``[D/16, B/p, 16, p]`` (16-dim groups of token pairs).
- ``tokens`` (the GPU backends: FlashAttention, Triton, FlashInfer, Flex): each token's
  ``2 * head_dim`` elements are its key then its value
  (``transpose(1, 2).split(head_dim, dim=-1)``, written by ``reshape_and_cache_flash``).

Those orders are not trusted from this docstring: :func:`probe_page_layout` runs the
kernel's own ``reshape_and_cache`` on tokens whose every element has a distinct bit
pattern, reads where each one landed, and picks the table entry that agrees (a fast
structured copy). A quantized cache (``kv_cache_dtype`` fp8: one byte an element,
written by arithmetic, so no bit pattern survives) is probed by value instead: each
element's offset is written a base-8 digit at a time, as small integers fp8 holds
exactly, and read back from the bytes as fp8. An order the table does not know (NEON,
VSX, RVV, a future change, every ``tokens`` page) gets the generic path: a per-element
index derived from the same probe. A kernel the probe cannot map is refused at engine
start, so a store never receives bytes in an unknown order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from kvstore.errors import ConfigError
from kvstore.layout import KVLayout

__all__ = [
    "SPLITS",
    "PageLayout",
    "PageWriter",
    "TileOrder",
    "known_layouts",
    "probe_page_layout",
    "quantized_dtype",
]

# The kernel's reshape_and_cache: (key, value, key_cache, value_cache, slot_mapping),
# with key/value [tokens, heads, head_dim] and the caches the backend's split views.
PageWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def _regions(kv: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, H, B, _ = kv.shape
    key, value = kv.view(n, H, 2 * B, head_dim).chunk(2, dim=2)
    return key, value


def _tokens(kv: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    key, value = kv.transpose(1, 2).split(head_dim, dim=-1)
    return key, value


# How a backend views a layer tensor [blocks, H, B, 2D] as the key and value caches its
# reshape_and_cache writes (see the module docstring).
SPLITS: dict[str, Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]] = {
    "regions": _regions,
    "tokens": _tokens,
}

_AMX_GROUP = 16  # AMX B-matrix tiles: 16 columns of 4-byte words
_DIGIT = 8  # the quantized probe's base: 1..8 are exact in fp8 e4m3 and e5m2 alike

# vLLM's quantized kv_cache_dtype names and the element each stores (one byte, held in
# a uint8 tensor): what the store's blocks of such an engine are, as its layout says.
_QUANTIZED = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def quantized_dtype(cache_dtype: str) -> torch.dtype | None:
    """The fp8 element of vLLM's ``kv_cache_dtype`` (None for ``auto``: the model's
    dtype); ConfigError for a cache the connector cannot map (scaled per block or per
    head, packed, or for MLA)."""
    if cache_dtype == "auto":
        return None
    name = _QUANTIZED.get(cache_dtype)
    if name is None:
        raise ConfigError(
            f"KVStoreConnector supports kv_cache_dtype auto, {', '.join(_QUANTIZED)}; "
            f"not {cache_dtype!r}"
        )
    return cast(torch.dtype, getattr(torch, name))


@dataclass(frozen=True)
class TileOrder:
    """How one head's key (or value) tile sits in its page region.

    The region holds the tile as a contiguous tensor of shape ``stored``; permuting it
    by ``perm`` gives the canonical ``[B, D]`` tile with B and D split into factors
    (``split``), so that a plain ``view`` reaches it from either side.
    """

    stored: tuple[int, ...]
    perm: tuple[int, ...]

    @property
    def split(self) -> tuple[int, ...]:
        """The canonical tile's shape in the permuted order (B's factors, then D's)."""
        return tuple(self.stored[p] for p in self.perm)

    @property
    def inverse(self) -> tuple[int, ...]:
        """The permutation that takes the split canonical tile back to ``stored``."""
        inv = [0] * len(self.perm)
        for i, p in enumerate(self.perm):
            inv[p] = i
        return tuple(inv)

    def positions(self) -> torch.Tensor:
        """For each canonical element (token-major), its offset inside the region."""
        n = 1
        for s in self.stored:
            n *= s
        return torch.arange(n).view(self.stored).permute(self.perm).reshape(n)


@dataclass(frozen=True)
class PageLayout:
    """The order of one page and head.

    ``index[c]`` is where canonical element ``c`` lives in the head's ``2 * B * D``
    elements (keys ``[B, D]`` then values ``[B, D]``, token-major). ``key`` and ``value``
    are set when a structured order of a key region then a value region matches, which
    copies faster than the index. ``split`` is the backend's (:data:`SPLITS`).
    """

    name: str
    index: torch.Tensor
    key: TileOrder | None = None
    value: TileOrder | None = None
    split: str = "regions"

    @property
    def structured(self) -> bool:
        """Whether gather and scatter take the structured (view and copy) path."""
        return self.key is not None and self.value is not None


def known_layouts(block_tokens: int, head_dim: int, itemsize: int) -> list[PageLayout]:
    """The page orders vLLM's kernels are known to use that fit this geometry: the
    CPU kernels' structured ones, and the GPU kernels' token order (indexed)."""
    B, D = block_tokens, head_dim
    out = []

    def add(name: str, key: TileOrder, value: TileOrder) -> None:
        index = torch.cat([key.positions(), value.positions() + B * D])
        out.append(PageLayout(name, index, key, value))

    add("vec", TileOrder((D, B), (1, 0)), TileOrder((B, D), (0, 1)))  # vec and vec16
    p = 4 // itemsize if itemsize in (1, 2, 4) else 0
    if p and B % _AMX_GROUP == 0 and B % p == 0 and D % p == 0 and D % _AMX_GROUP == 0:
        g = _AMX_GROUP
        add(
            "amx",
            TileOrder((B // g, D // p, g, p), (0, 2, 1, 3)),
            TileOrder((D // g, B // p, g, p), (1, 3, 0, 2)),
        )
    keys = torch.arange(B).view(B, 1) * 2 * D + torch.arange(D)  # token t: K then V
    out.append(PageLayout("flash", torch.cat([keys.view(-1), (keys + D).view(-1)]), split="tokens"))
    return out


def probe_page_layout(
    write: PageWriter,
    dtype: torch.dtype,
    layout: KVLayout,
    *,
    split: str = "regions",
    device: torch.device | str = "cpu",
    fp8: torch.dtype | None = None,
    source: torch.dtype = torch.float32,
) -> PageLayout:
    """Learn a kernel's page order from the kernel itself, on ``device``.

    ``write`` is the kernel's reshape_and_cache, handed the caches the backend's
    ``split`` makes of one page of ``dtype`` elements. The page is filled with keys and
    values whose elements carry their own canonical offset ``t * D + d`` as a bit
    pattern (no arithmetic touches them: the kernels copy whole words), then read back;
    keys first, then values. With ``fp8`` (a quantized cache: ``dtype`` is its bytes)
    the offsets go in as ``source`` values a digit at a time (module docstring). A
    structured order that agrees wins; otherwise the probed index is used as it is.
    Raises ConfigError unless every key element landed exactly once in the key cache's
    elements and every value element in the value cache's.
    """
    if layout.block_tokens is None:
        raise ConfigError("probing a page layout needs a block size (:B<n>)")
    if split not in SPLITS:
        raise ConfigError(f"unknown page split {split!r}")
    B, D = layout.block_tokens, layout.head_dim
    n = B * D
    # Which of the head's 2n elements the backend's key and value caches are.
    cells = SPLITS[split](torch.arange(2 * n).view(1, 1, B, 2 * D), D)
    at = [c.reshape(-1) for c in cells]
    index = torch.empty(2 * n, dtype=torch.int64)
    # Keys and values are probed one at a time, so a kernel that swapped the two (or
    # wrote one into both) is caught rather than mapped.
    if fp8 is None:
        pages = _probe_pages(write, dtype, split, B, D, device)
    else:
        pages = _probe_by_value(write, (dtype, fp8, source), split, B, D, device)
    for kv_half, page in enumerate(pages):
        found, order = torch.sort(page[at[kv_half]])
        if not torch.equal(found, torch.arange(n)) or bool((page[at[1 - kv_half]] != -1).any()):
            raise ConfigError(
                "vLLM's attention kernel stored a probe page in an order the KV connector "
                "cannot map (elements lost, doubled or moved between keys and values); "
                "refusing to store its pages"
            )
        index[kv_half * n : (kv_half + 1) * n] = at[kv_half][order]
    for k in known_layouts(B, D, torch.empty((), dtype=dtype).element_size()):
        if k.split == split and torch.equal(k.index, index):
            return k
    return PageLayout("probed", index, split=split)


def _probe_pages(
    write: PageWriter,
    dtype: torch.dtype,
    split: str,
    B: int,
    D: int,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """The page (the canonical offset each of its 2 * B * D elements holds, -1 where
    none) after writing offsets as keys and blanks (every bit set) as values, then the
    other way round."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    int_type = {2: torch.int16, 4: torch.int32}.get(itemsize)
    if int_type is None or 1 << (8 * itemsize) <= B * D:
        raise ConfigError(f"cannot probe vLLM pages of {dtype} with {B}x{D} tiles")
    blank = (1 << (8 * itemsize)) - 1  # all ones: no offset's pattern
    # Two's-complement wrap keeps each offset's low bits: the bit pattern is the offset.
    offsets = torch.arange(B * D, dtype=torch.int64).view(B, 1, D).to(torch.int32).to(int_type)
    nothing = torch.full_like(offsets, -1)  # all ones: the blank pattern
    slots = torch.arange(B, dtype=torch.long, device=device)
    pages = []
    for key, value in ((offsets, nothing), (nothing, offsets)):
        kv = torch.full((1, 1, B, 2 * D), -1, dtype=int_type, device=device)
        key_cache, value_cache = SPLITS[split](kv.view(dtype), D)
        k, v = (x.view(dtype).clone().to(device) for x in (key, value))
        write(k, v, key_cache, value_cache, slots)
        page = kv.reshape(-1).cpu().to(torch.int64) & blank
        pages.append(page.masked_fill(page == blank, -1))
    return pages


def _probe_by_value(
    write: PageWriter,
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype],
    split: str,
    B: int,
    D: int,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """:func:`_probe_pages` for a quantized cache: each offset written as its base-8
    digits plus one (1..8, exact in fp8 at a scale of 1), one kernel call per digit,
    the other half zeros; an element that reads 0 was not written. ``dtypes``: the
    page's (its bytes, as the kernel is handed them), the fp8 element they hold, and
    the keys' and values' (the model's)."""
    page_dtype, fp8, source = dtypes
    n = B * D
    digits = 1
    while _DIGIT**digits < n:
        digits += 1
    offsets = torch.arange(n, dtype=torch.int64).view(B, 1, D)
    slots = torch.arange(B, dtype=torch.long, device=device)
    pages = []
    for half in (0, 1):
        landed = torch.zeros(2 * n, dtype=torch.int64)
        written = torch.zeros(2 * n, dtype=torch.bool)
        for j in range(digits):
            digit = (offsets // _DIGIT**j % _DIGIT + 1).to(device=device, dtype=source)
            zero = torch.zeros_like(digit)
            kv = torch.zeros((1, 1, B, 2 * D), dtype=torch.uint8, device=device)
            key_cache, value_cache = SPLITS[split](kv.view(page_dtype), D)
            key, value = (digit, zero) if half == 0 else (zero, digit)
            write(key, value, key_cache, value_cache, slots)
            got = kv.reshape(-1).view(fp8).cpu().float().round().to(torch.int64)
            written |= got > 0
            landed += (got - 1).clamp(min=0) * _DIGIT**j
        pages.append(landed.masked_fill(~written, -1))
    return pages
