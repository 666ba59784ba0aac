"""A compressed namespace through a real ``kvstore serve`` over TCP.

One client writes a prompt's int8 blocks, another (a fresh connection, transport tcp)
reuses the prefix: the bytes on the wire and in the server's tiers are the codec's,
and the tiny model's greedy tokens equal the uncompressed cache's.
"""

from __future__ import annotations

import random

import torch

from engine.hf.adapter import HFKVAdapter
from engine.hf.workers import greedy_continue
from tests.support.models import tiny_llama
from tests.support.server_process import ALPHA, ServerProcess

B = 16
N_NEW = 10


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(70 + 7 * seed)]


@torch.inference_mode()
def test_int8_prefix_reused_over_tcp(store_server: ServerProcess) -> None:
    model = tiny_llama(torch.bfloat16)
    ad = HFKVAdapter(model, model_id="tiny", block_tokens=B, kv_codec="int8")
    p = _prompt(2)
    keys = ad.keys(p)
    out = model(torch.tensor([p]), use_cache=True)
    ref = list(greedy_continue(model, out.past_key_values, int(out.logits[0, -1].argmax()), N_NEW))
    with store_server.client(ALPHA, namespace=ad.namespace, transport="tcp") as writer:
        assert ad.store_blocks(writer, keys, out.past_key_values, 0) == len(keys)
        assert writer.transport == "tcp"
    with store_server.client(ALPHA, namespace=ad.namespace, transport="tcp") as reader:
        stored = reader.get(keys[0])
        assert isinstance(stored, bytes) and len(stored) == ad.stored_block_bytes
        n, cache = ad.load_prefix(reader, keys, len(p))
        assert n == (len(p) - 1) // B and reader.transport == "tcp"
        step = model(torch.tensor([p[n * B :]]), past_key_values=cache, use_cache=True)
        first = int(step.logits[0, -1].argmax())
        assert list(greedy_continue(model, step.past_key_values, first, N_NEW)) == ref
    raw = HFKVAdapter(model, model_id="tiny", block_tokens=B)
    with store_server.client(ALPHA, namespace=raw.namespace, transport="tcp") as other:
        assert other.match_prefix(raw.keys(p)) == 0  # the uncompressed namespace sees none
