"""KV compression codecs: fp8 (e4m3) and int8 with per-(layer, k|v, head) scales.

:class:`KVCodec` is the seam (block in the engine's dtype <-> opaque bytes), chosen by
name with :func:`get_codec`; a namespace names its codec in its layout (``...:Cint8``),
so the fingerprint separates compressed blocks from uncompressed ones. Importing this
package does not import torch; :func:`get_codec` does.
"""

from kvstore.codec.registry import CodecSpec, codec_names, codec_spec, get_codec, normalize_codec

__all__ = ["CodecSpec", "codec_names", "codec_spec", "get_codec", "normalize_codec"]
