"""Block codec: a fixed 128-byte header in front of the raw payload bytes.

One stored object per (block, rank) holds all layers as one contiguous payload. The
header carries what a reader needs to refuse wrong bytes: magic and version, dtype
and shape, the namespace fingerprint, the block key, the payload length, an xxh3-64
checksum of the payload and an xxh32 of the header itself. The checksum is computed
once at put time (from the writer's bytes) and verified on every read from disk and
after every network transfer; DRAM reads skip it (memory is trusted and the check
would halve read bandwidth). A block put into HBM from a device tensor is the one
exception to "at put time": its header carries :data:`PENDING` until the HBM tier takes
the checksum off the critical path (kvstore/tiers/hashbook.py), and a pending header
refuses to be packed, so it can never leave the node or reach another tier.

Payloads are never re-encoded: a tensor's bytes are copied as they are, and a reader
decodes straight into its own preallocated buffer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from kvstore.errors import CorruptBlock, InvalidValue, LayoutMismatch, StorageError
from kvstore.keys import KEY_BYTES
from kvstore.layout import DTYPE_SIZES, KVLayout

__all__ = [
    "HEADER_SIZE",
    "KIND_BYTES",
    "KIND_NUMPY",
    "KIND_TORCH",
    "PENDING",
    "BlockHeader",
    "ValueInfo",
    "checksum",
    "checksum_stream",
    "copy_payload",
    "describe",
    "host_bytes",
    "layer_range",
    "layer_span",
    "materialize",
    "out_view",
    "verify_payload",
]

MAGIC = b"KVB1"
VERSION = 1
HEADER_SIZE = 128
MAX_DIMS = 6

KIND_BYTES = 0  # raw bytes in, bytes out
KIND_NUMPY = 1  # numpy array in, numpy array out
KIND_TORCH = 2  # torch tensor in, torch tensor out

# The checksum of a block whose bytes are on a device and not hashed yet (an HBM put):
# never a real xxh3-64 (those are 0 .. 2**64 - 1), and never packed.
PENDING = -1

_DTYPE_CODES: dict[str, int] = {name: i + 1 for i, name in enumerate(DTYPE_SIZES)}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}

# magic, version, dtype, ndim, kind, 3 pad, shape[6], key, ns fingerprint, length, checksum
_BODY = struct.Struct(f"<4sHBBB3x{MAX_DIMS}I{KEY_BYTES}s16sQQ")
_HCRC = struct.Struct("<I")
assert _BODY.size + _HCRC.size <= HEADER_SIZE

_NUMPY_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "float64": np.float64,
    "int8": np.int8,
    "uint8": np.uint8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
}


def checksum(payload: Any) -> int:
    """xxh3-64 of a buffer (bytes, memoryview, contiguous numpy array)."""
    return xxhash.xxh3_64_intdigest(payload)


def checksum_stream() -> Any:
    """:func:`checksum` fed piece by piece: ``update(buf)``, then ``intdigest()``."""
    return xxhash.xxh3_64()


@dataclass(frozen=True, slots=True)
class ValueInfo:
    """What a value looks like, before any bytes move."""

    dtype: str
    shape: tuple[int, ...]
    kind: int
    nbytes: int

    def check_layout(self, layout: KVLayout) -> None:
        """Refuse a value whose dtype or shape is not this layout's block."""
        if self.kind == KIND_BYTES:
            self._check_raw_size(layout)  # no geometry to check: the size must still fit
            return
        if layout.codec:
            raise LayoutMismatch(
                f"layout {layout.canonical()} stores {layout.codec}-compressed bytes; "
                "encode the block with its codec (kvstore.codec) and put the bytes"
            )
        if self.dtype != layout.dtype:
            raise LayoutMismatch(f"dtype {self.dtype} does not match the layout's {layout.dtype}")
        want = (layout.layers, 2, layout.kv_heads, layout.block_tokens, layout.head_dim)
        ok = len(self.shape) == 5 and all(
            w is None or w == s for w, s in zip(want, self.shape, strict=True)
        )
        if not ok:
            shown = tuple("*" if w is None else w for w in want)
            raise LayoutMismatch(f"shape {self.shape} does not match the layout's {shown}")

    def _check_raw_size(self, layout: KVLayout) -> None:
        """Raw bytes under a namespace must be exactly one block of its layout (any
        number of whole tokens when the layout leaves the block size open): a reader of
        the namespace copies them into a tensor of that geometry."""
        if layout.block_tokens is not None:
            want = layout.block_bytes()
            if self.nbytes != want:
                raise LayoutMismatch(
                    f"raw value of {self.nbytes} bytes; a block of {layout.canonical()} "
                    f"holds {want}"
                )
            return
        per_token = DTYPE_SIZES[layout.dtype] * layout.layers * 2 * layout.kv_heads
        per_token *= layout.head_dim
        if self.nbytes % per_token:
            raise LayoutMismatch(
                f"raw value of {self.nbytes} bytes is not whole tokens of "
                f"{layout.canonical()} ({per_token} bytes each)"
            )


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "untyped_storage")


_DTYPE_NAMES: dict[np.dtype, str] = {}


def _np_dtype_name(dt: np.dtype) -> str:
    """``dt.name``, memoized: numpy computes it in Python (~5 us) on every access."""
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = dt.name
        if len(_DTYPE_NAMES) < 256:
            _DTYPE_NAMES[dt] = name
    return name


def describe(value: Any) -> ValueInfo:
    """Dtype, shape and kind of a torch tensor, numpy array or bytes-like value."""
    if _is_torch(value):
        if value.device.type == "meta":  # torch would raise NotImplementedError later
            raise InvalidValue("a meta tensor has no data: materialize it on a real device")
        dtype = str(value.dtype).removeprefix("torch.")
        if dtype not in _DTYPE_CODES:
            raise InvalidValue(f"unsupported tensor dtype {value.dtype}")
        if not value.is_contiguous():
            raise InvalidValue("tensor must be contiguous (call .contiguous() first)")
        info = ValueInfo(
            dtype, tuple(value.shape), KIND_TORCH, value.numel() * value.element_size()
        )
    elif isinstance(value, np.ndarray):
        dtype = _np_dtype_name(value.dtype)
        if dtype not in _NUMPY_DTYPES:
            raise InvalidValue(f"unsupported array dtype {value.dtype}")
        if not value.flags.c_contiguous:
            raise InvalidValue("array must be C-contiguous (np.ascontiguousarray first)")
        info = ValueInfo(dtype, tuple(value.shape), KIND_NUMPY, value.nbytes)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        n = memoryview(value).nbytes
        info = ValueInfo("uint8", (n,), KIND_BYTES, n)
    else:
        raise InvalidValue(f"cannot store a {type(value).__name__}: use a tensor, array or bytes")
    if len(info.shape) > MAX_DIMS:
        raise InvalidValue(f"at most {MAX_DIMS} dimensions, got {len(info.shape)}")
    if info.nbytes == 0:
        raise InvalidValue("cannot store an empty value")
    return info


def host_bytes(value: Any) -> memoryview:
    """A flat uint8 view of a CPU value's bytes, without copying.

    A CUDA tensor is copied to host here (the one place device bytes leave the GPU
    for a host tier).
    """
    if _is_torch(value):
        import torch

        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        flat = t.reshape(-1).view(torch.uint8)
        return memoryview(flat.numpy()).cast("B")
    if isinstance(value, np.ndarray):
        return memoryview(value.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    return memoryview(value).cast("B")


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The fixed header stored in front of every payload."""

    dtype: str
    shape: tuple[int, ...]
    kind: int
    key: bytes
    namespace_fp: bytes
    payload_len: int
    checksum: int
    # pack()'s result, kept: a stored block's header goes out with every read of it
    _packed: bytes | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def for_value(
        cls, key: bytes, info: ValueInfo, payload: Any, namespace_fp: bytes = b"\x00" * 16
    ) -> BlockHeader:
        """Build a header for ``payload`` (computes the checksum)."""
        return cls(
            info.dtype, info.shape, info.kind, key, namespace_fp, info.nbytes, checksum(payload)
        )

    @property
    def total_len(self) -> int:
        """Header plus payload bytes."""
        return HEADER_SIZE + self.payload_len

    def pack(self) -> bytes:
        """Serialize to exactly HEADER_SIZE bytes (computed once per header)."""
        if self._packed is not None:
            return self._packed
        if self.checksum == PENDING:
            raise StorageError(
                f"block {self.key.hex()}: its checksum is still pending on the device; "
                "it leaves the tier only through Payload.land"
            )
        shape = list(self.shape) + [0] * (MAX_DIMS - len(self.shape))
        body = _BODY.pack(
            MAGIC,
            VERSION,
            _DTYPE_CODES[self.dtype],
            len(self.shape),
            self.kind,
            *shape,
            self.key,
            self.namespace_fp,
            self.payload_len,
            self.checksum,
        )
        crc = _HCRC.pack(xxhash.xxh32_intdigest(body))
        packed = body + crc + b"\x00" * (HEADER_SIZE - len(body) - len(crc))
        object.__setattr__(self, "_packed", packed)  # frozen: set once, same value
        return packed

    @classmethod
    def unpack(cls, buf: Any) -> BlockHeader:
        """Parse and check a header; any inconsistency is a :class:`CorruptBlock`."""
        mv = memoryview(buf).cast("B")
        if mv.nbytes < HEADER_SIZE:
            raise CorruptBlock(f"header truncated: {mv.nbytes} < {HEADER_SIZE} bytes")
        body = mv[: _BODY.size]
        (crc,) = _HCRC.unpack_from(mv, _BODY.size)
        if xxhash.xxh32_intdigest(body) != crc:
            raise CorruptBlock("header checksum mismatch")
        fields = _BODY.unpack(body)
        magic, version, dcode, ndim, kind = fields[:5]
        if magic != MAGIC or version != VERSION:
            raise CorruptBlock(f"bad magic/version {magic!r}/{version}")
        if dcode not in _CODE_DTYPES or ndim > MAX_DIMS or kind > KIND_TORCH:
            raise CorruptBlock("bad dtype, ndim or kind in header")
        shape = tuple(fields[5 : 5 + ndim])
        key, nsfp, length, csum = fields[5 + MAX_DIMS :]
        dtype = _CODE_DTYPES[dcode]
        n = DTYPE_SIZES[dtype]
        for d in shape:
            n *= d
        if n != length:
            raise CorruptBlock(f"header shape {shape} x {dtype} != payload length {length}")
        return cls(dtype, shape, kind, key, nsfp, length, csum)

    def info(self) -> ValueInfo:
        """The value description this header stores."""
        return ValueInfo(self.dtype, self.shape, self.kind, self.payload_len)

    @property
    def pending(self) -> bool:
        """Whether the checksum is not known yet (a device block: see PENDING)."""
        return self.checksum == PENDING

    def with_checksum(self, csum: int) -> BlockHeader:
        """The same header carrying ``csum`` (a pending one resolved)."""
        return BlockHeader(
            self.dtype, self.shape, self.kind, self.key, self.namespace_fp, self.payload_len, csum
        )


def layer_range(layers: Any) -> tuple[int, int] | None:
    """``layers`` as given to a ranged read, checked: None, or (a, b) with 0 <= a < b."""
    if layers is None:
        return None
    try:
        a, b = (int(x) for x in layers)
    except (TypeError, ValueError):
        raise InvalidValue(f"layers {layers!r}: give (first, end) as two integers") from None
    if not 0 <= a < b <= 0xFFFFFFFF:
        raise InvalidValue(f"layers [{a}, {b}): need 0 <= first < end")
    return a, b


def layer_span(header: BlockHeader, layers: tuple[int, int]) -> tuple[int, int]:
    """Payload bytes [lo, hi) of layers [a, b) of a block: its shape's first dimension
    is the layer, outermost, so a layer range is one contiguous run of the payload."""
    a, b = layers
    if header.kind == KIND_BYTES or not header.shape:
        raise LayoutMismatch("a layer range needs a tensor block; this one holds raw bytes")
    n = header.shape[0]
    if not 0 <= a < b <= n:
        raise InvalidValue(f"layers [{a}, {b}) out of the block's {n}")
    if header.payload_len % n:
        raise LayoutMismatch(f"{header.payload_len} payload bytes do not split into {n} layers")
    per = header.payload_len // n
    return a * per, b * per


def verify_payload(header: BlockHeader, payload: Any) -> None:
    """Raise :class:`CorruptBlock` unless ``payload`` has the header's length and checksum."""
    n = memoryview(payload).nbytes
    if n != header.payload_len:
        raise CorruptBlock(f"payload is {n} bytes, header says {header.payload_len}")
    if checksum(payload) != header.checksum:
        raise CorruptBlock("payload checksum mismatch")


def _out_bytes(out: Any) -> tuple[Any, ValueInfo]:
    """A writable flat uint8 view of a caller's buffer (numpy or torch on CPU)."""
    info = describe(out)
    if _is_torch(out):
        import torch

        if out.device.type != "cpu":
            return out, info  # device buffer: copied with torch below
        return out.reshape(-1).view(torch.uint8).numpy(), info
    if isinstance(out, np.ndarray):
        if not out.flags.writeable:
            raise InvalidValue("output array is read-only")
        return out.reshape(-1).view(np.uint8), info
    mv = memoryview(out)
    if mv.readonly:
        raise InvalidValue("output buffer is read-only")
    return np.frombuffer(mv.cast("B"), dtype=np.uint8), info


def out_view(header: BlockHeader, out: Any) -> Any:
    """The caller's preallocated buffer as a flat uint8 view: a numpy array over host
    memory, or a uint8 view of a device tensor. LayoutMismatch unless it holds exactly
    the stored dtype and byte size (its shape may differ when the element counts
    agree, so a caller never receives bytes reinterpreted as another dtype)."""
    dst, info = _out_bytes(out)
    if info.kind != KIND_BYTES and info.dtype != header.dtype:
        raise LayoutMismatch(f"output dtype {info.dtype} != stored {header.dtype}")
    if info.nbytes != header.payload_len:
        raise LayoutMismatch(f"output holds {info.nbytes} bytes, block has {header.payload_len}")
    if _is_torch(dst):  # a device tensor
        import torch

        return dst.reshape(-1).view(torch.uint8)
    return dst


def copy_payload(header: BlockHeader, payload: Any, out: Any) -> None:
    """Copy a stored payload into the caller's preallocated buffer: one copy, no decode
    (the buffer is checked by :func:`out_view`)."""
    dst = out_view(header, out)
    if _is_torch(dst):  # a device output tensor
        import torch

        dst.copy_(torch.frombuffer(payload, dtype=torch.uint8), non_blocking=False)
        return
    np.copyto(dst, np.frombuffer(payload, dtype=np.uint8), casting="no")


def materialize(header: BlockHeader, payload: Any) -> Any:
    """A fresh value of the kind that was stored (bytes, numpy array or torch tensor)."""
    if header.kind == KIND_BYTES:
        return bytes(payload)
    if header.kind == KIND_NUMPY:
        arr = np.empty(header.shape, dtype=_NUMPY_DTYPES[header.dtype])
        np.copyto(arr.reshape(-1).view(np.uint8), np.frombuffer(payload, dtype=np.uint8))
        return arr
    import torch

    t = torch.empty(header.shape, dtype=getattr(torch, header.dtype))
    t.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
    return t
