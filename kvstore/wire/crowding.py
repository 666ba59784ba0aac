"""Whether this host has more runnable threads than CPUs: when it does, nobody should
busy-poll.

Both ends of the data socket poll for a short window rather than sleep (server:
kvstore/wire/polling.py, client: DataConn.call), which pays while each poller has a CPU
to itself. Once the host is crowded (more client processes than cores, or other jobs)
a poller spins on a CPU that the peer it is waiting for needs: the server thread that
should be sending the reply, or another client's copy. Measured on a 2-core host, 4
client processes each polling for replies made the aggregate fall as clients were
added.

The kernel's instantaneous count of runnable tasks (the fourth field of /proc/loadavg,
``running/total``) answers it. Reading the file costs a few microseconds; the answer is
kept for ``interval_s`` and shared by every thread of the process.
"""

from __future__ import annotations

import os
import time

__all__ = ["CROWDING", "Crowding", "running_tasks"]

_LOADAVG = "/proc/loadavg"


class Crowding:
    """Samples the host's runnable task count at most every ``interval_s``."""

    def __init__(self, interval_s: float = 0.05, cpus: int | None = None) -> None:
        self.interval_s = interval_s
        self.cpus = cpus or len(os.sched_getaffinity(0)) or 1
        self._checked = -1.0
        self._crowded = False
        self._available = os.path.exists(_LOADAVG)

    def crowded(self) -> bool:
        """True when more tasks are runnable on this host than it has CPUs (the caller
        itself counts as one). Plain attribute writes: a lost race costs one sample."""
        if not self._available:
            return False
        now = time.monotonic()
        if now - self._checked < self.interval_s:
            return self._crowded
        self._checked = now
        self._crowded = running_tasks() > self.cpus
        return self._crowded


def running_tasks() -> int:
    """The host's runnable tasks right now (0 where the kernel does not say)."""
    try:
        with open(_LOADAVG, "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, IndexError, ValueError):
        return 0


CROWDING = Crowding()  # one per process: every poller of this process asks it
