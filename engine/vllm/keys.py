"""What names a vLLM request's blocks in the store, beyond its token ids.

A block's key is the chain of its prompt's token ids under the namespace
(kvstore/keys.py), which engine/hf/adapter.py computes the same way, so a transformers
worker and a vLLM engine of one model share blocks. But a vLLM request's KV can depend
on more than its ids: a LoRA adapter changes it, and vLLM's ``cache_salt`` says which
requests may share a prefix at all. Such a request's chain starts from a root of its
own (:func:`chain_root`), so its blocks never answer the base model's, another
adapter's or another salt's lookup; a short prompt's answer blocks (``save_decode``)
chain from that root too. Nothing here imports vLLM: ``kvstore vllm-router``
checks the store with the same keys.
"""

from __future__ import annotations

from hashlib import blake2b

from kvstore.keys import Namespace

__all__ = ["chain_root"]


def chain_root(
    namespace: Namespace, block_tokens: int, *, lora: str | None = None, salt: str | None = None
) -> bytes | None:
    """The root of a request's key chain: None (the namespace's own root) for a plain
    request; else one of its LoRA adapter and ``cache_salt``. ``lora`` names the
    adapter's weights: the connector passes its name and path, as vLLM's own prefix
    cache keys them, so an adapter re-pointed elsewhere never finds the old one's KV
    (engines sharing a store must load an adapter from the same path)."""
    if lora is None and not salt:
        return None
    h = blake2b(namespace.canonical(block_tokens), digest_size=16, person=b"kvstore/vllm")
    h.update(b"lora:" + (lora or "").encode() + b"\0")
    h.update(b"salt:" + (salt or "").encode())
    return h.digest()
