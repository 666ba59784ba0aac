"""The tier seam: what the node needs from any place that holds block bytes.

A tier only stores and returns bytes and accounts for its space. It does not decide
what to evict (policy.py), who may read (the node's pins) or where a block lives in
the cluster (the directory). Sizes are in bytes of header plus payload.

A block sits at a *place* in its tier: an extent offset in a slab, or ``NO_PLACE`` in
a tier that finds blocks by key (the SSD tier). Bytes leave and enter a tier through a
:class:`Payload`, whatever memory they live in: a read handle gives its host bytes
(one copy when they are on a device), a reservation is filled through a host buffer
(staged and copied to the device when the tier is HBM). Nothing above this package
needs to know which tier it is talking to, or copy device memory itself.

Bytes *leave* a tier for host memory through :meth:`Payload.land`, which returns
them with the header that vouches for them: host bytes as they are, device bytes
copied and hashed on the way, their checksum checked, or taken for the first time
when the put deferred it (kvstore/tiers/hashbook.py, the rule). Every path that sends
a block's bytes off the node, or into another tier, takes them from ``land``.

A batch of device values (StoreNode.batch_put / batch_get_into) is one submission:
:meth:`Payload.queue_write` and :meth:`Payload.queue_copy_to` queue a payload's copies
on a call's batches (kvstore/copies/engine.py ``Batches``) instead of copying at once,
and the call waits once; a payload that cannot queue a value says so and is copied at
once as before.

Concurrency: tiers do no locking for the node. Space (``allocate``/``release``) is
asked for under the node's index lock; bytes move outside it, on a place that a pin
or a reservation keeps alive (kvstore/node/state.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvstore.blocks import BlockHeader, checksum, copy_payload, host_bytes
from kvstore.copies.engine import Batches
from kvstore.copies.landing import Pinned
from kvstore.tier_kinds import TierKind

__all__ = [
    "NO_PLACE",
    "HostPayload",
    "Payload",
    "Pending",
    "Tier",
    "TierKind",
]  # TierKind: tiers' names

NO_PLACE = -1  # the place of a block in a tier that finds its blocks by key


class Pending:
    """A write queued on a call's batches (:meth:`Payload.queue_write`). ``own``: the
    copy has an event of its own, and :meth:`landed` waits for it and returns the xxh3
    taken from the host bytes as they landed (the commit's landed checksum), so the
    reservation may be committed before the batch's later copies finish; otherwise the
    write is done only once the call's batches finish, and :meth:`landed` returns None
    (the tier takes the checksum later)."""

    __slots__ = ("_landed", "own")

    def __init__(self, landed: Callable[[], int] | None = None) -> None:
        self._landed = landed
        self.own = landed is not None

    def landed(self) -> int | None:
        """See the class docstring (DeviceError when the copy failed)."""
        return None if self._landed is None else self._landed()


class Payload(ABC):
    """One block's payload bytes where they lie, valid while the block is pinned (a
    read) or reserved (a write)."""

    # Whether :meth:`fill_buffer` is the stored bytes themselves (no staging copy), so
    # an xxh3 taken as they were written is the xxh3 of what is stored
    # (StoreNode.commit's ``landed_checksum``).
    fills_in_place = False
    # Whether the last :meth:`write` left the checksum to the tier, to be taken off
    # the critical path (a device-to-device put into HBM): the commit then seals the
    # header with PENDING unless a writer's checksum must be verified now.
    defers_checksum = False

    # -- reading ------------------------------------------------------------------------

    @abstractmethod
    def host(self) -> np.ndarray:
        """The bytes as a flat uint8 host array: a view when they are in host memory,
        one copy when they are on a device."""

    @abstractmethod
    def copy_to(self, header: BlockHeader, out: Any) -> None:
        """Copy into a caller's tensor, array or buffer of the stored dtype and size
        (LayoutMismatch otherwise); a device ``out`` from device bytes stays on the
        device. Device bytes copied into a host ``out`` leave the device: they are
        checked as :meth:`land` checks them (CorruptBlock)."""

    def land(
        self, header: BlockHeader, into: np.ndarray | None = None, *, pinned: Pinned = False
    ) -> tuple[BlockHeader, np.ndarray]:
        """The payload's bytes in host memory, as they leave this tier, with the header
        that vouches for them: copied into ``into`` when given (``pinned``: how it is
        page-locked, kvstore/copies/landing.py: the Registration it lies in, so device
        copies into it are cut at registered chunks' boundaries), else where they lie
        (host bytes) or in a buffer of their own. Host bytes are trusted as memory is;
        a device payload overrides this to hash the bytes as they land and check or
        settle the checksum (CorruptBlock)."""
        src = self.host()
        if into is None:
            return header, src
        np.copyto(into, src, casting="no")
        return header, into

    # -- writing ------------------------------------------------------------------------

    @abstractmethod
    def fill_buffer(self) -> np.ndarray:
        """A writable flat uint8 host array to fill the payload through: the bytes
        themselves in host memory, else a staging buffer that :meth:`seal` copies in."""

    @abstractmethod
    def write(self, value: Any) -> int | None:
        """Copy a whole value in (tensor, array, bytes, or another tier's Payload).
        Returns the xxh3 of the bytes written when the copy computed it on the way
        (a device value landing in host memory), else None."""

    def queue_write(self, value: Any, batches: Batches) -> Pending | None:
        """Queue a copy of the whole ``value`` on ``batches`` instead of copying it at
        once: the pending write, or None when this payload copies ``value`` only with
        :meth:`write` (a host value, a tier without device copies)."""
        return None

    def queue_copy_to(self, header: BlockHeader, out: Any, batches: Batches) -> bool:
        """Queue the copy into ``out`` on ``batches`` (done once they finish; the block
        stays pinned until then); False when ``out`` is copied only by :meth:`copy_to`
        (a host buffer, a departure that must be checked as it lands). LayoutMismatch
        as :meth:`copy_to`."""
        return False

    @abstractmethod
    def flush(self) -> None:
        """Finish a fill through :meth:`fill_buffer`: staged bytes reach the device."""

    @abstractmethod
    def checksum(self) -> int:
        """The xxh3 checksum of the payload (of a staged fill, read from its staging)."""


class HostPayload(Payload):
    """Payload bytes in host memory: a DRAM extent or a private buffer."""

    __slots__ = ("_arr",)
    fills_in_place = True

    def __init__(self, arr: np.ndarray) -> None:
        self._arr = arr

    def host(self) -> np.ndarray:
        return self._arr

    def copy_to(self, header: BlockHeader, out: Any) -> None:
        copy_payload(header, self._arr, out)

    def fill_buffer(self) -> np.ndarray:
        return self._arr

    def write(self, value: Any) -> int | None:
        if isinstance(value, Payload):
            src: Any = value.host()
        elif getattr(getattr(value, "device", None), "type", "cpu") != "cpu":
            import torch  # a device tensor: one copy, straight into these bytes

            torch.from_numpy(self._arr).copy_(value.detach().reshape(-1).view(torch.uint8))
            return None
        else:
            src = host_bytes(value)
        np.copyto(self._arr, np.frombuffer(src, dtype=np.uint8), casting="no")
        return None

    def flush(self) -> None:
        return None

    def checksum(self) -> int:
        return checksum(self._arr)


class Tier(ABC):
    """One tier's space and bytes, addressed by (key, place)."""

    kind: TierKind
    # The POSIX shared-memory segment same-host clients map to read and write this
    # tier's places directly (``/dev/shm/<name>``), or None when they cannot.
    shm_name: str | None = None

    # -- space --------------------------------------------------------------------------

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Bytes this tier may hold in all."""

    @property
    @abstractmethod
    def used(self) -> int:
        """Bytes currently allocated (including allocator rounding)."""

    def fits_ever(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` could fit if the tier were empty."""
        return nbytes <= self.capacity

    @abstractmethod
    def allocate(self, nbytes: int) -> int | None:
        """Room for one block of ``nbytes`` now: its place, or None when the tier is too
        full (a key-addressed tier only checks; its write takes the room)."""

    @abstractmethod
    def release(self, key: bytes, place: int) -> None:
        """Free a block's storage (or a reservation's) at ``place``."""

    # -- bytes --------------------------------------------------------------------------

    @abstractmethod
    def payload(self, place: int, nbytes: int) -> Payload | None:
        """The payload at ``place`` where it lies (to read or fill in place), or None in
        a tier whose bytes are only copied out with :meth:`load`."""

    @abstractmethod
    def seal(self, place: int, header: BlockHeader) -> None:
        """Write the header of a block whose payload was filled in place."""

    @abstractmethod
    def store(self, key: bytes, place: int, header: BlockHeader, src: Payload) -> BlockHeader:
        """Store a whole block at an allocated ``place``, its bytes taken from ``src``
        (another tier's payload: a demotion) through :meth:`Payload.land`. Returns the
        header stored, which carries the checksum the bytes were checked against (a
        block leaving a device may learn its first checksum here). CapacityError when
        a key-addressed tier found its room taken meanwhile; CorruptBlock when the
        bytes failed their checksum on the way (nothing stored)."""

    @abstractmethod
    def load(self, key: bytes, place: int, header: BlockHeader, dst: Payload) -> None:
        """Copy a stored block's payload into ``dst``, verified where the tier can rot
        (CorruptBlock, after dropping it; NotFound when it is gone)."""

    def wait_hashed(self, timeout: float = 10.0) -> bool:
        """Wait until every block committed so far has its checksum (a device tier
        takes them off the critical path); True when they all do."""
        return True

    def stored(self) -> Iterator[tuple[bytes, BlockHeader]]:
        """Blocks this tier held when it opened (a persistent tier after a restart)."""
        return iter(())

    @abstractmethod
    def close(self) -> None:
        """Release the tier's resources; idempotent."""
