"""The checksums of a device tier's blocks, known or still pending, and their hasher.

The rule (README.md, Guarantees; kvstore/tiers/hbm.py): a put into HBM from a device
tensor is one device-to-device copy and commits with its checksum *pending*
(:data:`kvstore.blocks.PENDING`). The checksum is then taken off the critical path:

1. by the background :class:`Hasher`, which, once the tier has been quiet for a moment,
   copies each pending block to pinned host memory and hashes it: its *first*
   checksum, taken from the device bytes after the put's copy completed;
2. or, if the block leaves the GPU first (a demotion, a network read, a copy into a
   host buffer), by that departure: every departure lands the bytes in host memory
   and hashes them on the way (kvstore/copies/landing.py, ``land_hashed``). A pending
   block's departure hash *is* its first checksum; a known one is checked against it,
   and a mismatch is a :class:`~kvstore.errors.CorruptBlock` (the node counts it,
   drops the block and answers a miss), never bytes handed on.

So no block leaves the GPU without a checksum computed from its bytes as they leave,
and no header carrying a pending checksum is ever packed. Corruption of a block's
device bytes is caught from the moment its first checksum is known.

Blocks are tracked by *place* (the extent offset) with a generation per seal: a place
released and reused gets a new generation, so a hash computed for the old block is
never recorded for the new one.

Concurrency: ``HashBook._lock`` (a leaf: taken under the node's index lock by
``sealed``/``forget``, alone by the hasher and departures) guards ``_sums`` and the
queue. The hasher copies and hashes outside it, on a place whose generation it checks
again before recording: a place cannot be rewritten before it is forgotten, and a
forget happens under the lock, so a hash recorded for a generation was taken from
that generation's bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from kvstore.blocks import PENDING, BlockHeader
from kvstore.errors import CorruptBlock, KVStoreError

__all__ = ["QUIET_S", "HashBook", "Hasher"]

log = logging.getLogger(__name__)

QUIET_S = 0.002  # the hasher starts once no block was sealed for this long


class HashBook:
    """Place -> (generation, bytes, checksum or PENDING) for one device tier."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._sums: dict[int, tuple[int, int, int]] = {}
        self._queue: deque[tuple[int, int]] = deque()  # (place, generation) to hash
        self._gen = 0
        self._busy = 0  # hashes taken off the queue and not yet recorded
        self.last_seal = 0.0  # time.monotonic() of the latest seal
        self.first_by_departure = 0  # first checksums a departure took (not the hasher)
        self.first_by_hasher = 0

    def sealed(self, place: int, nbytes: int, csum: int) -> None:
        """A block was committed at ``place`` with ``csum`` (PENDING: to be hashed)."""
        with self._lock:
            self._gen += 1
            self._sums[place] = (self._gen, nbytes, csum)
            self.last_seal = time.monotonic()
            if csum == PENDING:
                self._queue.append((place, self._gen))
                self._changed.notify_all()

    def forget(self, place: int) -> None:
        """The block at ``place`` is gone (its extent released)."""
        with self._lock:
            self._sums.pop(place, None)

    def pending(self) -> int:
        """How many blocks have no checksum yet."""
        with self._lock:
            return sum(1 for _, _, c in self._sums.values() if c == PENDING)

    def settle(self, place: int, header: BlockHeader, landed: int) -> BlockHeader:
        """A departure hashed the block at ``place`` as ``landed``: the header that
        vouches for those bytes (its checksum now known), or CorruptBlock when they
        differ from the checksum known before."""
        with self._lock:
            rec = self._sums.get(place)
            known = header.checksum
            if rec is not None and rec[2] != PENDING:
                known = rec[2]
            if known == PENDING:
                if rec is not None:
                    self._sums[place] = (rec[0], rec[1], landed)
                self.first_by_departure += 1
                return header.with_checksum(landed)
        if landed != known:
            raise CorruptBlock(
                f"device block {header.key.hex()}: its bytes hash to {landed:016x} on leaving "
                f"the GPU, its checksum is {known:016x}"
            )
        return header if header.checksum == known else header.with_checksum(known)

    # -- the hasher's side ------------------------------------------------------------

    def take(self, stop: threading.Event, quiet_s: float) -> tuple[int, int, int] | None:
        """The next (place, generation, bytes) to hash, once no seal came for
        ``quiet_s``; None when ``stop`` is set."""
        with self._lock:
            while not stop.is_set():
                while self._queue:
                    place, gen = self._queue[0]
                    rec = self._sums.get(place)
                    if rec is None or rec[0] != gen or rec[2] != PENDING:
                        self._queue.popleft()  # gone, reused, or a departure hashed it
                        continue
                    wait = self.last_seal + quiet_s - time.monotonic()
                    if wait > 0:
                        self._changed.wait(wait)
                        break
                    self._queue.popleft()
                    self._busy += 1
                    return place, gen, rec[1]
                else:
                    self._changed.notify_all()  # idle: wake whoever waits in drained()
                    self._changed.wait(0.5)
            return None

    def record(self, place: int, gen: int, csum: int | None) -> None:
        """The hasher's checksum for ``place`` at generation ``gen`` (None: it could not
        hash it); kept only if the block is still that generation and still pending."""
        with self._lock:
            self._busy -= 1
            rec = self._sums.get(place)
            if csum is not None and rec is not None and rec[0] == gen and rec[2] == PENDING:
                self._sums[place] = (gen, rec[1], csum)
                self.first_by_hasher += 1
            self._changed.notify_all()

    def wake(self) -> None:
        """Wake whoever waits on the book (a hasher told to stop)."""
        with self._lock:
            self._changed.notify_all()

    def drained(self, timeout: float) -> bool:
        """Wait until every block sealed so far has its checksum (or is gone); True
        when that happened within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                live = any(
                    (r := self._sums.get(p)) is not None and r[0] == g and r[2] == PENDING
                    for p, g in self._queue
                )
                if not live and not self._busy:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.notify_all()
                self._changed.wait(min(left, 0.05))


class Hasher:
    """A daemon thread giving each pending block of a HashBook its first checksum.

    ``digest(place, nbytes)`` copies the payload at ``place`` to the host and returns
    its xxh3 (the tier's departure, without the bookkeeping). Blocks are hashed in
    commit order, only while the tier is quiet (no seal for ``quiet_s``), so a burst of
    puts is not slowed by copies and hashes of its own blocks.
    """

    def __init__(
        self, book: HashBook, digest: Callable[[int, int], int], quiet_s: float = QUIET_S
    ) -> None:
        self._book, self._digest, self._quiet = book, digest, quiet_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-hbm-hasher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        book = self._book
        while True:
            got = book.take(self._stop, self._quiet)
            if got is None:
                return
            place, gen, nbytes = got
            csum: int | None = None
            try:
                csum = self._digest(place, nbytes)
            except (KVStoreError, RuntimeError) as exc:  # a CUDA error: a departure hashes it
                log.warning("hashing the device block at %d failed: %s", place, exc)
            finally:
                book.record(place, gen, csum)

    def close(self) -> None:
        """Stop the thread (it finishes the hash in hand first); idempotent."""
        self._stop.set()
        self._book.wake()
        self._thread.join(timeout=5.0)
