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
keep the CPUs awake anyway. And none polls while the host has more runnable tasks than
CPUs (kvstore/wire/crowding.py): the poll would spin on a CPU a client needs. The
window is ``ServerConfig.data_poll_us``; 0 turns polling off.

The client polls for each reply the same way (ClientConfig.reply_poll_us, see
kvstore/client/transport/conn.py). Neither end polls when a server and a client share one
process (tests, embedded setups): there the poller would hold the GIL that the other
end needs in order to answer. Each end learns it from the handshake, where both send
their host id and process id (:func:`same_process`): a data server does not poll at all
while a client of its own process is connected (DataServer hands its IdlePoller that
test), and a client does not poll for replies from a server in its own process
(DataConn.poll_replies). There is no process-wide state: each server and each client
pool decides for itself.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.observe.counters import NodeCounters
from kvstore.wire.crowding import CROWDING
from kvstore.wire.frames import FrameSocket
from kvstore.wire.locality import host_id

if TYPE_CHECKING:
    from kvstore.wire.ucx import UcxFrames

__all__ = ["IdlePoller", "same_process"]


def same_process(peer_host_id: str, peer_pid: int) -> bool:
    """Whether the peer that sent ``peer_host_id`` and ``peer_pid`` in the handshake is
    this very process: same kernel (:func:`~kvstore.wire.locality.host_id`) and same
    process id. A peer that sent no pid (0) never is. Where neither end has a boot id
    (both "") equal pids count as the same process: a doubt costs a remote peer its
    polls, never a local one its GIL.
    """
    return bool(peer_pid) and peer_pid == os.getpid() and peer_host_id == host_id()


def _always() -> bool:
    return True


class IdlePoller:
    """Decides which connection may poll for its next request, and for how long.

    Shared by every connection thread of one data server. ``served`` is called by each
    connection for each request it handles; ``wait`` right after a reply. Each poll
    counts ``data_polls_caught`` (the next request came within the window) or
    ``data_polls_missed``: a server whose polls mostly miss is burning CPU for nothing
    and wants a shorter window or none.

    ``may_poll`` comes from the owner and is asked before every poll: False while
    polling would starve someone of the GIL (DataServer: a client of its own process is
    connected). Without one, polling is always allowed.
    """

    def __init__(
        self,
        window_s: float,
        counters: NodeCounters | None = None,
        *,
        quiet_s: float = 0.005,
        may_poll: Callable[[], bool] = _always,
        crowded: Callable[[], bool] = CROWDING.crowded,
    ) -> None:
        self.window_s = window_s
        self.may_poll = may_poll
        self.crowded = crowded
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

    def wait(self, fs: FrameSocket | UcxFrames, conn_id: int, extra_s: float = 0.0) -> bool:
        """Poll ``fs`` for the next request for at most the window plus ``extra_s`` (the
        time the client is known to need first: copying a reserved extent); True if
        bytes have arrived (they are buffered in ``fs``). False when polling is not
        allowed now, the window passed, or another connection got a request; the caller
        then blocks as usual."""
        if self.window_s <= 0 or fs.buffered or fs.tls or not self.may_poll():
            return False
        now = time.perf_counter()
        if now < self._shared_until or self.crowded():
            return False
        if not self._slot.acquire(blocking=False):
            return False
        try:
            deadline = now + self.window_s + extra_s
            caught = fs.poll_next(
                lambda: time.perf_counter() < deadline and self._last_conn == conn_id
            )
        finally:
            self._slot.release()
        self.counters.inc("data_polls_caught" if caught else "data_polls_missed")
        return caught
