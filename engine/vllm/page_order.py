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
structured copy). An order the table does not know (NEON, VSX, RVV, a future change,
every ``tokens`` page) gets the generic path: a per-element index derived from the same
probe. A kernel the probe cannot map is refused at engine start, so a store never
receives bytes in an unknown order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstore.errors import ConfigError
from kvstore.layout import KVLayout

__all__ = ["SPLITS", "PageLayout", "PageWriter", "TileOrder", "known_layouts", "probe_page_layout"]

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
) -> PageLayout:
    """Learn a kernel's page order from the kernel itself, on ``device``.

    ``write`` is the kernel's reshape_and_cache, handed the caches the backend's
    ``split`` makes of one page. The page is filled with keys and values whose elements
    carry their own canonical offset ``t * D + d`` as a bit pattern (no arithmetic
    touches them: the kernels copy whole words), then read back; keys first, then
    values. A structured order that agrees wins; otherwise the probed index is used as
    it is. Raises ConfigError unless every key element landed exactly once in the key
    cache's elements and every value element in the value cache's.
    """
    if layout.block_tokens is None:
        raise ConfigError("probing a page layout needs a block size (:B<n>)")
    if split not in SPLITS:
        raise ConfigError(f"unknown page split {split!r}")
    B, D = layout.block_tokens, layout.head_dim
    n = B * D
    itemsize = torch.empty((), dtype=dtype).element_size()
    int_type = {2: torch.int16, 4: torch.int32}.get(itemsize)
    if int_type is None or n >= 1 << (8 * itemsize):
        raise ConfigError(f"cannot probe vLLM pages of {dtype} with {B}x{D} tiles")
    # Which of the head's 2n elements the backend's key and value caches are.
    cells = SPLITS[split](torch.arange(2 * n).view(1, 1, B, 2 * D), D)
    at = [c.reshape(-1) for c in cells]
    index = torch.empty(2 * n, dtype=torch.int64)
    blank = (1 << (8 * itemsize)) - 1  # all ones: no offset's pattern
    # Keys and values are probed one at a time, so a kernel that swapped the two (or
    # wrote one into both) is caught rather than mapped.
    pages = _probe_pages(write, dtype, int_type, blank, split, B, D, device)
    for kv_half, page in enumerate(pages):
        found, order = torch.sort(page[at[kv_half]])
        if not torch.equal(found, torch.arange(n)) or bool((page[at[1 - kv_half]] != blank).any()):
            raise ConfigError(
                "vLLM's attention kernel stored a probe page in an order the KV connector "
                "cannot map (elements lost, doubled or moved between keys and values); "
                "refusing to store its pages"
            )
        index[kv_half * n : (kv_half + 1) * n] = at[kv_half][order]
    for k in known_layouts(B, D, itemsize):
        if k.split == split and torch.equal(k.index, index):
            return k
    return PageLayout("probed", index, split=split)


def _probe_pages(
    write: PageWriter,
    dtype: torch.dtype,
    int_type: torch.dtype,
    blank: int,
    split: str,
    B: int,
    D: int,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """The page (its 2 * B * D elements' bit patterns) after writing offsets as keys
    and blanks (``blank``, every bit set) as values, then the other way round."""
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
        pages.append(kv.reshape(-1).cpu().to(torch.int64) & blank)
    return pages
