"""Which shards of a sharded node a client skips for now, so a down shard fails fast.

Why: a NodeClient that loses its server waits for it to come back until the call's
deadline (a restarting server is usually back within it). On a sharded node
(kvstore/client/sharded.py) that made every call touching a down shard cost its whole
timeout, while the node's other shards answer in microseconds, and a batch waits for
its slowest shard. For a cache a fast miss beats a slow one.

So a shard that fails a call with a node failure (unreachable, its transport broken,
timed out) is *suspect* for :data:`SUSPECT_S`, as a cluster client's failed node is
(kvstore/client/members.py): calls fail its keys at once with Unavailable, the other
shards' keys stand. After that a TCP connect probes it; a shard that refuses stays
suspect, one that accepts gets one trial call (the other callers keep failing fast
meanwhile). A crashed shard therefore costs one failed call, a restarting one is used
again within a probe of its return, and a hung one (whose port still accepts) costs one
timeout per :data:`SUSPECT_S` rather than one per call. A success clears the shard at
once. A client's first call to a shard that is down when it is first needed is a
probe too (kvstore/client/sharded.py), not a connect retried for its whole timeout.

A timeout under a deadline shorter than the client's own (a caller's ``timeout=``, a
cluster client's share of its deadline) may be the caller's hurry rather than the
shard's fault: one such timeout is a *strike*, and :data:`HURRIED_STRIKES` in a row,
with no success between, make the shard suspect. A strike lapses when the next failing
call started over :data:`STRIKE_S` after it (timed from the call's start, not its end,
so a hung shard called one call at a time under a long deadline still gathers them).
So one impatient caller does not turn a busy shard into a second of misses for every
thread, and a hung shard still costs a bounded number of timeouts per hold whoever
calls it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvstore.errors import KVStoreError, TimeoutError_, TransportError, Unavailable
from kvstore.observe.counters import NodeCounters

__all__ = ["HURRIED_STRIKES", "SHARD_FAILURES", "STRIKE_S", "SUSPECT_S", "ShardSuspects"]

log = logging.getLogger(__name__)

SUSPECT_S = 1.0
"""How long a failed shard is skipped before it is probed again."""

SHARD_FAILURES = (Unavailable, TransportError, TimeoutError_)
"""Errors that say "this shard, now" rather than "this request"."""

HURRIED_STRIKES = 2
"""Timeouts under a caller's shorter deadline, in a row, that make a shard suspect."""

STRIKE_S = 5.0
"""How long a strike counts: a busy shard that times out a hurried call now and then,
with no call in between to succeed, is not held for it."""


class ShardSuspects:
    """The suspect shards of one node, for one client. Thread-safe.

    ``addresses[i]``: shard ``i``'s control address, which ``reachable`` probes."""

    def __init__(
        self,
        group: str,
        addresses: Sequence[str],
        reachable: Callable[[str], bool],
        counters: NodeCounters,
        hold_s: float = SUSPECT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.group = group
        self.addresses = list(addresses)
        self.reachable = reachable
        self.counters = counters
        self.hold_s = hold_s
        self.clock = clock
        self._lock = threading.Lock()
        self._until: dict[int, tuple[float, str]] = {}  # shard -> (skip until, why)
        self._strikes: dict[int, tuple[int, float]] = {}  # shard -> (strikes in a row, last)

    def check(self, shard: int) -> None:
        """Raise Unavailable while ``shard`` is suspect (see the module docstring). Once
        its hold is over, one caller probes it and, if it accepts, makes the one trial
        call; the others keep failing fast for another hold, until a success clears it
        or a failure holds it again."""
        if shard not in self._until:  # the common case: no lock, no clock
            return
        now = self.clock()
        with self._lock:
            entry = self._until.get(shard)
            if entry is None:
                return
            probe = now >= entry[0]
            if probe:  # half-open: this caller's probe (and trial) only, per hold
                entry = self._until[shard] = (now + self.hold_s, entry[1])
        if probe:
            if self.reachable(self.addresses[shard]):
                return  # back (or hung: the trial call will tell)
            with self._lock:
                if self._until.get(shard) is entry:  # no success cleared it meanwhile
                    entry = self._until[shard] = (self.clock() + self.hold_s, entry[1])
        until, why = entry
        self.counters.inc("shard_skipped")
        raise Unavailable(
            f"shard {shard} of node {self.group!r} ({self.addresses[shard]}) is down "
            f"({why}); skipped for {max(until - now, 0.0):.1f} s more"
        )

    def failed(
        self, shard: int, exc: KVStoreError, *, hurried: bool = False, started: float | None = None
    ) -> None:
        """Record that ``shard`` failed a call with ``exc``; only node failures count.
        ``hurried``: the call ran under a deadline shorter than the client's own, so a
        timeout is a strike (module docstring); ``started``: when that call began, by
        :attr:`clock` (now when not given)."""
        if not isinstance(exc, SHARD_FAILURES):
            return
        with self._lock:
            if hurried and isinstance(exc, TimeoutError_):
                now = self.clock()
                began = now if started is None else started
                count, last = self._strikes.get(shard, (0, began))
                count = 1 if began - last > STRIKE_S else count + 1
                self._strikes[shard] = (count, now)
                if count < HURRIED_STRIKES:
                    return
            self._strikes.pop(shard, None)
            fresh = shard not in self._until
            self._until[shard] = (self.clock() + self.hold_s, str(exc) or type(exc).__name__)
        if fresh:
            self.counters.inc("shard_failures")
            log.warning(
                "shard %d of node %r failed (%s): its keys fail at once for now",
                shard,
                self.group,
                exc,
            )

    def succeeded(self, shard: int) -> None:
        """``shard`` answered: no longer suspect, and no strikes."""
        if shard in self._strikes:
            with self._lock:
                self._strikes.pop(shard, None)
        if shard in self._until:
            with self._lock:
                gone = self._until.pop(shard, None)
            if gone is not None:
                log.info("shard %d of node %r answers again", shard, self.group)

    def suspects(self) -> set[int]:
        """The shards skipped right now (no probing)."""
        now = self.clock()
        with self._lock:
            return {s for s, (until, _) in self._until.items() if until > now}
