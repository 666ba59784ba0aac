"""A data-socket FrameSocket over loopback TCP and the raw socket at its other end, for
tests that script one side of the protocol by hand."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

from kvstore.wire.frames import FrameSocket

__all__ = ["frame_pair"]


@contextmanager
def frame_pair(*, server_side: bool = False) -> Iterator[tuple[FrameSocket, socket.socket]]:
    """(FrameSocket, raw peer): the FrameSocket is the client's end, or the server's
    (accepted) end with ``server_side``; both close when the block ends."""
    ls = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(ls.getsockname())
    accepted, _ = ls.accept()
    ls.close()
    ours, peer = (accepted, client) if server_side else (client, accepted)
    fs = FrameSocket(ours, max_meta=1 << 20)
    fs.set_timeout(5)
    try:
        yield fs, peer
    finally:
        fs.close()
        peer.close()
