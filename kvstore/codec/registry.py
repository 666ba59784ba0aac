"""Codecs by name: what a layout's ``C<name>`` field may say, and the codec it means.

Torch-free on purpose: :mod:`kvstore.layout` validates a codec name and sizes its
blocks from here, and the server parses layouts without ever loading torch. A codec's
implementation (which needs torch) is imported only when :func:`get_codec` asks for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.codec.format import encoded_nbytes
from kvstore.errors import ConfigError

if TYPE_CHECKING:
    from kvstore.codec.base import KVCodec

__all__ = ["CodecSpec", "codec_names", "codec_spec", "get_codec", "normalize_codec"]


@dataclass(frozen=True, slots=True)
class CodecSpec:
    """A codec's name, the size of its blocks, and how to load it."""

    name: str
    encoded_nbytes: Callable[[Sequence[int]], int]
    load: Callable[[], KVCodec]


def _fp8() -> KVCodec:
    from kvstore.codec.fp8 import FP8Codec

    return FP8Codec()


def _int8() -> KVCodec:
    from kvstore.codec.int8 import Int8Codec

    return Int8Codec()


_SPECS = {
    "fp8": CodecSpec("fp8", encoded_nbytes, _fp8),
    "int8": CodecSpec("int8", encoded_nbytes, _int8),
}
_ALIASES = {"fp8_e4m3": "fp8", "e4m3": "fp8", "float8_e4m3fn": "fp8"}


def codec_names() -> list[str]:
    """The codec names a layout may carry."""
    return sorted(_SPECS)


def normalize_codec(name: str | None) -> str | None:
    """The canonical codec name; None (or ``""``/``none``) means uncompressed."""
    if name is None:
        return None
    n = str(name).strip().lower()
    if n in ("", "none"):
        return None
    n = _ALIASES.get(n, n)
    if n not in _SPECS:
        raise ConfigError(f"unknown KV codec {name!r}; known: {', '.join(codec_names())}")
    return n


def codec_spec(name: str) -> CodecSpec:
    """The spec of a codec name (raises ConfigError for an unknown one)."""
    n = normalize_codec(name)
    if n is None:
        raise ConfigError("no codec named: 'none' means uncompressed")
    return _SPECS[n]


def get_codec(name: str) -> KVCodec:
    """A codec instance by name (loads its implementation, which needs torch)."""
    return codec_spec(name).load()
