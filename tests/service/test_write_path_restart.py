"""A second crash must not lose SSD blocks (issue 18): a real ``kvstore serve`` with an
lmdb + slab SSD tier, SIGKILLed twice. Blocks that survived the first crash on SSD are
read back after it (which promotes them to DRAM); they must survive the second one too,
because a promoted block keeps its SSD copy until the SSD needs the room."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from tests.support.server_fixtures import ServerFactory
from tests.support.server_process import ALPHA

pytestmark = pytest.mark.process

MIB = 1 << 20


def test_blocks_read_after_a_crash_survive_the_next_crash(server_factory: ServerFactory) -> None:
    server = server_factory(dram_bytes="8MiB", ssd_bytes="64MiB")
    keys = [b"crash" + i.to_bytes(11, "big") for i in range(14)]
    with server.client(ALPHA, transport="tcp") as c:
        assert c.batch_put(keys, [np.full(MIB, i, np.uint8) for i in range(14)]) == [True] * 14
        assert c.stats()["tiers"]["ssd"]["blocks"] >= 6

    server.restart(signal.SIGKILL)  # DRAM is lost; the SSD tier reopens with its blocks
    out = np.empty(MIB, dtype=np.uint8)
    with server.client(ALPHA, transport="tcp") as c:
        survivors = [i for i, there in enumerate(c.exists(keys)) if there]
        assert len(survivors) >= 6
        for i in survivors:  # each read promotes the block to DRAM
            assert c.get_into(keys[i], out) and out[0] == i and out[-1] == i
        assert c.stats()["tiers"]["dram"]["blocks"] == len(survivors)

    server.restart(signal.SIGKILL)
    with server.client(ALPHA, transport="tcp") as c:
        assert [i for i, there in enumerate(c.exists(keys)) if there] == survivors
        for i in survivors:
            assert c.get_into(keys[i], out) and out[0] == i and out[-1] == i
