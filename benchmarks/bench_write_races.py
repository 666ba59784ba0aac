"""Does a full tier cost writers their puts? (issue 18's write-path races)

Two questions against a real ``kvstore serve`` on 127.0.0.1, each in ``--runs`` runs:

- **Concurrent writers into a full DRAM:** 4 threads, each with its own client, put 4
  blocks of 8 MiB at once (a barrier starts them together) into 32 MiB of DRAM with
  256 MiB of SSD behind it. Every put should land: DRAM makes room by demoting to SSD.
  Printed: puts lost (raised to the caller) out of 16, per run, over shm and TCP.
- **One shm batch larger than free DRAM:** ``batch_put`` of 40 blocks of 1 MiB into
  16 MiB of DRAM with 128 MiB of SSD. Printed: blocks stored out of 40, per run.

The anchor is the count itself: 0 lost and 40 of 40 stored is the bar.

    python benchmarks/bench_write_races.py [--runs 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.errors import KVStoreError
from tests.support.server_process import ALPHA, ServerProcess, base_flags


def _server(root: Path, **flags: str) -> ServerProcess:
    wd = Path(tempfile.mkdtemp(dir=root))
    return ServerProcess(wd, {**base_flags(wd), **flags}).start()


def lost_puts(root: Path, transport: str, writers: int = 4, blocks: int = 4) -> int:
    """Puts raised to the caller when ``writers`` write 8 MiB blocks into 32 MiB."""
    server = _server(root, dram_bytes="32MiB", ssd_bytes="256MiB")
    lost = [0]
    lock = threading.Lock()
    start = threading.Barrier(writers)

    def write(n: int) -> None:
        with server.client(ALPHA, transport=transport) as c:
            start.wait()
            for j in range(blocks):
                try:
                    c.put(bytes([n, j]) * 8, np.full(8 << 20, j, np.uint8))
                except KVStoreError:
                    with lock:
                        lost[0] += 1

    threads = [threading.Thread(target=write, args=(n,)) for n in range(writers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        server.stop()
    return lost[0]


def batch_stored(root: Path, n: int = 40) -> int:
    """Blocks stored by one shm ``batch_put`` of ``n`` x 1 MiB into 16 MiB of DRAM."""
    server = _server(root, dram_bytes="16MiB", ssd_bytes="128MiB")
    try:
        with server.client(ALPHA, transport="shm") as c:
            keys = [bytes([i]) * 16 for i in range(n)]
            res = c.batch_put(keys, [np.full(1 << 20, i, np.uint8) for i in range(n)])
    finally:
        server.stop()
    return sum(r is True for r in res)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for transport in ("shm", "tcp"):
            got = [lost_puts(root, transport) for _ in range(args.runs)]
            print(f"{transport}: puts lost of 16 per run: {got}")
        got = [batch_stored(root) for _ in range(args.runs)]
        print(f"shm batch of 40 x 1 MiB into 16 MiB DRAM, stored per run: {got}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
