"""`kvstore demo`: chat traffic with shared prefixes through one in-process node.

Each request is a conversation turn: a shared system prompt, the conversation so
far, and a new user message. The demo hashes the prompt into 16-token blocks,
asks the node for the longest stored prefix, reads those blocks back into a
preallocated buffer (what a decode worker would do), and writes the new blocks.
Blocks have the KV geometry of SmolLM2-135M (30 layers, 3 KV heads, head dim 64,
bf16: 360 KiB per block); DRAM is sized so older turns demote to the SSD tier and
come back on a hit. Every block read is checked against what was written.
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.blocks import checksum
from kvstore.config import NodeConfig, parse_size
from kvstore.keys import Namespace, prefix_keys
from kvstore.node import StoreNode

__all__ = ["DemoReport", "run_demo"]

LAYOUT = "bf16:L30:H3:D64:B16"
BLOCK_TOKENS = 16


@dataclass
class DemoReport:
    """What the demo did, for the table and for ``--json``."""

    requests: int = 0
    prompt_blocks: int = 0
    hit_blocks: int = 0
    written_blocks: int = 0
    verified_blocks: int = 0
    seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON output."""
        return {
            "requests": self.requests,
            "prompt_blocks": self.prompt_blocks,
            "hit_blocks": self.hit_blocks,
            "written_blocks": self.written_blocks,
            "verified_blocks": self.verified_blocks,
            "block_hit_rate": self.hit_blocks / max(self.prompt_blocks, 1),
            "seconds": self.seconds,
            "node": self.stats,
        }


def _kv_for(key: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    """Deterministic KV-shaped bf16 content for a key (values in a KV-like range)."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & ((1 << 63) - 1))
    return torch.empty(shape, dtype=torch.bfloat16).uniform_(-4.0, 4.0, generator=g)


def _digest(t: torch.Tensor) -> int:
    return checksum(t.reshape(-1).view(torch.uint8).numpy())


def _conversations(n_conv: int, turns: int, rng: random.Random) -> list[list[int]]:
    """Prompts in arrival order: turns of interleaved conversations."""
    system = [rng.randrange(49152) for _ in range(200)]
    convs = [list(system) for _ in range(n_conv)]
    prompts = []
    for _ in range(turns):
        for c in convs:
            c.extend(rng.randrange(49152) for _ in range(rng.randint(40, 160)))  # user turn
            prompts.append(list(c))
            c.extend(rng.randrange(49152) for _ in range(rng.randint(20, 120)))  # answer
    return prompts


def run_demo(
    *,
    conversations: int = 24,
    turns: int = 6,
    dram: str = "256MiB",
    ssd: str = "2GiB",
    ssd_path: str | None = None,
    policy: str = "s3fifo",
    seed: int = 0,
    progress: Any = None,
) -> DemoReport:
    """Run the demo workload; ``progress(done, total)`` is called after each request."""
    ns = Namespace("smollm2-135m", LAYOUT, "demo")
    shape = ns.kv_layout.block_shape()
    rng = random.Random(seed)
    prompts = _conversations(conversations, turns, rng)
    report = DemoReport()
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp:
        cfg = NodeConfig.load(
            node_id="demo",
            dram_bytes=parse_size(dram, "dram"),
            ssd_path=ssd_path or f"{tmp}/ssd",
            ssd_bytes=parse_size(ssd, "ssd"),
            policy=policy,
        )
        t0 = time.perf_counter()
        with StoreNode(cfg) as node:
            out = torch.empty(shape, dtype=torch.bfloat16)
            written: dict[bytes, int] = {}  # key -> xxh3 of what was put, to verify reads
            for i, prompt in enumerate(prompts):
                keys = prefix_keys(prompt, BLOCK_TOKENS, ns)
                hit = node.match_prefix(keys)
                for k in keys[:hit]:  # what a decode worker does with the hit
                    if not node.get_into(k, out, namespace=ns):
                        break
                    if _digest(out) != written[k]:
                        raise AssertionError(f"block {k.hex()} read back wrong bytes")
                    report.verified_blocks += 1
                for k in keys[hit:]:
                    kv = _kv_for(k, shape)
                    node.put(k, kv, namespace=ns)
                    written[k] = _digest(kv)
                    report.written_blocks += 1
                report.requests += 1
                report.prompt_blocks += len(keys)
                report.hit_blocks += hit
                if progress is not None:
                    progress(i + 1, len(prompts))
            report.seconds = time.perf_counter() - t0
            report.stats = node.stats()
    return report
