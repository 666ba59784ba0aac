"""Bounded polling for a client's next request, so a pipelined client does not pay a
sleeping server thread's wake-up on every request.

A connection thread that has just answered blocks in ``recv`` until the next request.
On a virtual machine the CPU it ran on then halts, and waking it again costs the
client 40-55 us per request on this project's 2-core hosts (measured: client send to
server header seen, 1 MiB gets, see benchmarks/RESULTS.md). An engine fetching a
prompt's blocks, or a decode worker following a prefill, sends its next request a few
dozen microseconds after the last reply. Polling the socket for a short window after
each reply catches it with a ~13 us handoff instead.

Polling costs CPU, and in CPython it can also cost the other threads their turn. A
poller takes the GIL back after every system call it makes. A thread that has just
woken with a request of its own may then wait for the whole window. So polling is
allowed only while one client has the server to itself:

- at most one connection polls at a time;
- a poller stops as soon as another connection's request is handled;
- none polls within ``quiet_s`` of two changes of connection in a row that came less
  than ``quiet_s`` apart: clients taking turns that fast are running side by side.
  A single change (one client done, another starting) does not count.

With several clients busy, the server runs exactly as without polling: their threads
keep the CPUs awake anyway. The window is ``ServerConfig.data_poll_us``; 0 turns
polling off.

The client polls for each reply the same way (ClientConfig.reply_poll_us, see
kvstore/client/transport/conn.py). Neither end polls when a server and a client share one
process (tests, embedded setups): there the poller would hold the GIL that the other
end needs in order to answer. :data:`PRESENCE` records which ends this process runs.
"""

from __future__ import annotations

import threading
import time

from kvstore.observe.counters import NodeCounters
from kvstore.wire.frames import FrameSocket

__all__ = ["PRESENCE", "IdlePoller", "Presence"]


class Presence:
    """Which ends of the data socket this process runs (plain flags: set once, read
    on every request)."""

    def __init__(self) -> None:
        self.servers = 0  # data servers running here
        self.clients = False  # a client has opened a data connection here

    @property
    def server_may_poll(self) -> bool:
        """No client here waits on this process's GIL to send its next request."""
        return not self.clients

    @property
    def client_may_poll(self) -> bool:
        """No server here needs this process's GIL to produce the reply."""
        return self.servers == 0


PRESENCE = Presence()


class IdlePoller:
    """Decides which connection may poll for its next request, and for how long.

    Shared by every connection thread of one data server. ``served`` is called by each
    connection for each request it handles; ``wait`` right after a reply. Each poll
    counts ``data_polls_caught`` (the next request came within the window) or
    ``data_polls_missed``: a server whose polls mostly miss is burning CPU for nothing
    and wants a shorter window or none.
    """

    def __init__(
        self, window_s: float, counters: NodeCounters | None = None, *, quiet_s: float = 0.005
    ) -> None:
        self.window_s = window_s
        self.quiet_s = quiet_s
        self.counters = counters if counters is not None else NodeCounters()
        self._slot = threading.Lock()  # held by the one connection polling
        self._last_conn = 0  # the connection that served the latest request
        self._switched_at = -1.0  # when requests last changed connection (perf_counter)
        self._shared_until = 0.0  # no polling before this

    @property
    def enabled(self) -> bool:
        """Whether polling is on at all."""
        return self.window_s > 0

    def served(self, conn_id: int) -> None:
        """A request of ``conn_id`` is being handled. A change of connection that comes
        within ``quiet_s`` of the previous change means clients are interleaving, and
        polling pauses for ``quiet_s``.

        Plain attribute writes under the GIL: a lost race costs one poll window at most.
        """
        if conn_id != self._last_conn:
            now = time.perf_counter()
            if self._last_conn:  # the server's first request is no change
                if now - self._switched_at < self.quiet_s:
                    self._shared_until = now + self.quiet_s
                self._switched_at = now
            self._last_conn = conn_id

    @property
    def polling(self) -> bool:
        """Whether a connection is polling right now (holds the one slot)."""
        return self._slot.locked()

    def wait(self, fs: FrameSocket, conn_id: int) -> bool:
        """Poll ``fs`` for the next request for at most the window; True if bytes have
        arrived (they are buffered in ``fs``). False when polling is not allowed now,
        the window passed, or another connection got a request; the caller then blocks
        as usual."""
        if self.window_s <= 0 or fs.buffered or fs.tls or not PRESENCE.server_may_poll:
            return False
        now = time.perf_counter()
        if now < self._shared_until or not self._slot.acquire(blocking=False):
            return False
        try:
            deadline = now + self.window_s
            caught = fs.poll_next(
                lambda: time.perf_counter() < deadline and self._last_conn == conn_id
            )
        finally:
            self._slot.release()
        self.counters.inc("data_polls_caught" if caught else "data_polls_missed")
        return caught
