"""A UCX client run as its own process (``python -m tests.support.ucx_client ADDRESS
[TRANSPORT]``, transport ``ucx`` unless given),
so that each test can give it the UCX settings it is about (UCX reads UCX_TLS and
UCX_NET_DEVICES once per process).

It writes blocks of 1 MiB and 4 MiB, singly and in a batch of 8, then a batch of mixed
sizes with one item stored already, reads each back with get, get_into and
batch_get_into (a miss among them), compares every byte and prints one JSON line: the
transport its connections used and whether every check held (with what failed).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from kvstore import StoreClient
from tests.support.server_process import ALPHA

MiB = 1 << 20


def _key(seed: int, name: str) -> bytes:
    return f"{seed:08x}{name}".encode().ljust(16, b".")[:16]


def check(address: str, transport: str = "ucx") -> dict[str, object]:
    """Round-trip blocks over UCX; the facts to print."""
    failed: list[str] = []
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    with StoreClient.connect(
        address, token=ALPHA.token, transport=transport, timeout_s=20, connect_timeout_s=20
    ) as c:
        for size in (MiB, 4 * MiB):
            key = _key(seed, f"s{size >> 20}")
            value = rng.integers(0, 255, size, dtype=np.uint8)
            if c.put(key, value) is not True:
                failed.append(f"put {size}")
            got = c.get(key)
            if not (isinstance(got, np.ndarray) and np.array_equal(got, value)):
                failed.append(f"get {size}")
            out = np.zeros_like(value)
            if c.get_into(key, out) is not True or not np.array_equal(out, value):
                failed.append(f"get_into {size}")
        keys = [_key(seed, f"b{i}") for i in range(8)]
        values = [rng.integers(0, 255, MiB, dtype=np.uint8) for _ in keys]
        if c.batch_put(keys, values) != [True] * 8:
            failed.append("batch_put")
        outs = [np.zeros(MiB, np.uint8) for _ in keys]
        if c.batch_get_into(keys, outs) != [True] * 8:
            failed.append("batch_get_into results")
        if not all(np.array_equal(o, v) for o, v in zip(outs, values, strict=True)):
            failed.append("batch_get_into bytes")
        if c.get(_key(seed, "never")) is not None:
            failed.append("miss")
        # a batch of mixed sizes with an item stored already; read back with a miss
        mixed_keys = [keys[0], _key(seed, "m100"), _key(seed, "m2m"), _key(seed, "m3k")]
        mixed = [
            values[0],
            *(rng.integers(0, 255, n, dtype=np.uint8) for n in (100, 2 * MiB, 3072)),
        ]
        if c.batch_put(mixed_keys, mixed) != [False, True, True, True]:
            failed.append("mixed batch_put")
        read_keys = [*mixed_keys[1:3], _key(seed, "never"), mixed_keys[3]]
        outs = [np.zeros(v.nbytes, np.uint8) for v in (mixed[1], mixed[2], mixed[1], mixed[3])]
        if c.batch_get_into(read_keys, outs) != [True, True, False, True]:
            failed.append("mixed batch_get_into results")
        wanted = [(outs[0], mixed[1]), (outs[1], mixed[2]), (outs[3], mixed[3])]
        if not all(np.array_equal(o, v) for o, v in wanted):
            failed.append("mixed batch_get_into bytes")
        transport = c.transport
        served = c.stats()["server"]
    return {
        "transport": transport,
        "failed": failed,
        "bytes_out_ucx": served.get("bytes_out_ucx", 0),
        "bytes_in_ucx": served.get("bytes_in_ucx", 0),
    }


def main() -> int:
    print(json.dumps(check(*sys.argv[1:3])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
