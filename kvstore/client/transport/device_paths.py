"""The transports' device paths: reads into and puts from tensors their DeviceSide takes
(CUDA tensors; CPU tensors with the host engine the tests give).

- Same-host reads (shm.py): a published block is copied by DMA straight from the
  registered segment (shm_direct.DirectReader.read_device); a leased one likewise, its
  lease kept until the batch's event (:func:`leased_into_device`). The server verified
  each block's xxh3 when it was committed, so no host hash runs (``verify_shm`` or a
  clock the client cannot trust: the segment's bytes are hashed after the copies, under
  the lease). Blocks the server sends inline (not in DRAM) come on the socket as below.
- Socket reads (:func:`receive_device`): each payload is received into a pinned staging
  buffer, hashed as it arrives, and copied to the device only if its xxh3 matches; the
  next receive overlaps that copy. A mismatch is a miss and the tensor is never reported
  filled.
- Puts (:func:`copy_in_device`, :func:`staged_puts`, :func:`stage_values`):
  device-to-host into the reserved extent, or into a ring of pinned staging buffers,
  on a side stream after the producer's stream; each item is hashed on the host (and,
  over TCP, sent) while the next ones' copies run. Only a put that must hold every
  payload before or during its whole send (a checksum-first PUT, UCX's sends that
  are not waited for) stages the batch at once (:func:`stage_values`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np

from kvstore._proto import store_pb2 as pb
from kvstore.blocks import HEADER_SIZE, BlockHeader, checksum, layer_span
from kvstore.client.device.reads import DeviceRead
from kvstore.client.device.side import DeviceSide
from kvstore.client.device.writes import DeviceWrite
from kvstore.client.transport.buffers import Outgoing, check_out, copy_hashed
from kvstore.client.transport.conn import DataConn
from kvstore.client.transport.inbound import Inbound, Lander, miss, plan_inline
from kvstore.client.transport.shm_direct import FALLBACK, DirectReader
from kvstore.errors import KVStoreError, TimeoutError_, TransportError
from kvstore.observe.counters import NodeCounters

__all__ = [
    "PUT_SLOTS",
    "DeviceTarget",
    "copy_in_device",
    "direct_into_device",
    "lander",
    "leased_into_device",
    "receive_device",
    "stage_values",
    "staged_puts",
]

log = logging.getLogger(__name__)


class DeviceTarget:
    """A get_into whose bytes go to a device tensor: ``dst`` (its flat uint8 view)."""

    __slots__ = ("dst", "nbytes", "view")

    def __init__(self, dst: Any, nbytes: int) -> None:
        self.dst = dst
        self.nbytes = nbytes
        self.view = None  # nothing lands on the host: receive_device stages it


def lander(side: DeviceSide) -> Lander:
    """Where a payload for a device output lands (after the dtype and size checks)."""
    flat = side.engine.flat

    def land(header: BlockHeader, out: Any, nbytes: int) -> DeviceTarget:
        check_out(header, out, nbytes)
        return DeviceTarget(flat(out), nbytes)

    return land


def receive_device(
    conn: DataConn, plans: Sequence[Inbound], counters: NodeCounters, landing: DeviceRead
) -> list[Any]:
    """Receive the planned payloads in order, each through staging into its tensor when
    its xxh3 matches; then one wait for the copies. Per-key results as receive_planned."""
    results: list[Any] = []
    for p in plans:
        target = p.landing
        if not isinstance(target, DeviceTarget):
            if p.view is not None:  # cannot land (layout mismatch): drained into scratch
                conn.recv_into(p.view, spin=True)
            results.append(p.result)
            continue

        def fill(view: np.ndarray, p: Inbound = p) -> bool:
            conn.recv_into(view, spin=True, digest=p.digest)
            return bool(p.digest.intdigest() == p.expect)

        if landing.receive(target.dst, target.nbytes, fill):
            results.append(True)
        else:
            counters.inc("corrupt_transfers")
            log.warning(
                "block %s failed its checksum after transfer; served as a miss", p.key.hex()
            )
            results.append(p.result)
    landing.finish()  # a DeviceError here fails the call: no tensor is reported filled
    return results


Leased = Callable[
    [DataConn, Sequence[bytes], Sequence[Any], pb.Scope, float, "tuple[int, int] | None"],
    list[Any],
]
"""The shared-memory transport's leased read (ShmTransport._leased)."""


def direct_into_device(
    conn: DataConn,
    keys: Sequence[bytes],
    outs: Sequence[Any],
    scope: pb.Scope,
    deadline: float,
    layers: tuple[int, int] | None,
    direct: DirectReader | None,
    side: DeviceSide,
    *,
    verify: bool,
    counters: NodeCounters,
    leased: Leased,
) -> list[Any]:
    """A same-host read into device tensors: the published blocks in one DMA submission
    from the segment and one wait (DirectReader.read_device), the rest leased."""
    d = direct
    nsfp = d.namespace(scope.model, scope.layout) if d is not None else None
    results: list[Any] = [FALLBACK] * len(keys)
    if d is not None and nsfp is not None and d.alive():
        if time.monotonic() >= deadline:
            raise TimeoutError_(f"deadline passed before {len(keys)} direct reads")
        t0 = time.perf_counter()
        with DeviceRead(side.engine, side.segment, side.registration()) as landing:
            got = d.read_device(d.scoped(list(keys)), outs, nsfp, verify, counters, landing, layers)
        results = [r for r, _ in got]
        served = [keys[i] for i, (_, n) in enumerate(got) if n]
        rest = [i for i, r in enumerate(results) if r is FALLBACK]
        if served:
            counters.inc("shm_direct_reads", len(served))
            whole = None if rest else time.perf_counter() - t0  # else LEASE is timed
            conn.defer_touch(served, sum(n for _, n in got), whole)
    rest = [i for i, r in enumerate(results) if r is FALLBACK]
    if rest:
        more = leased(
            conn, [keys[i] for i in rest], [outs[i] for i in rest], scope, deadline, layers
        )
        for i, r in zip(rest, more, strict=True):
            results[i] = r
    return results


def leased_into_device(
    conn: DataConn,
    resp: pb.GetResponse,
    outs: Sequence[Any],
    side: DeviceSide,
    counters: NodeCounters,
    verify: bool,
    layers: tuple[int, int] | None,
) -> list[Any]:
    """The blocks of a LEASE reply into device tensors: the leased ones by DMA from the
    segment (queued as one submission before any inline payload is received, so the
    two overlap), the inline ones through staging; one wait, then the lease checks.
    The caller releases the leases after this returns, so each block stays pinned on
    the server until its copy's event has completed."""
    engine = side.engine
    segment = side.segment
    assert segment is not None
    results: list[Any] = [None] * len(outs)
    leased: list[tuple[int, BlockHeader, int]] = []  # (item, header, payload start)
    with DeviceRead(engine, segment, side.registration()) as landing:
        for i, ref in enumerate(resp.blocks):
            if not ref.lease_id:
                continue
            header = BlockHeader.unpack(ref.header)
            start = ref.offset + HEADER_SIZE
            try:
                lo, hi = (0, header.payload_len) if layers is None else layer_span(header, layers)
                check_out(header, outs[i], hi - lo)
            except KVStoreError as exc:
                results[i] = exc
                continue
            if ref.offset < 0 or start + header.payload_len > segment.size:
                raise TransportError(f"extent at {ref.offset} lies outside the segment")
            landing.from_segment(engine.flat(outs[i]), start + lo, hi - lo)
            leased.append((i, header, start))
        landing.submit()
        inline = [i for i, ref in enumerate(resp.blocks) if not ref.lease_id]
        land = lander(side)
        plans = [plan_inline(conn, resp.blocks[i], outs[i], True, layers, land) for i in inline]
        for i, r in zip(inline, receive_device(conn, plans, counters, landing), strict=True):
            results[i] = r
    expired = time.monotonic_ns() >= resp.lease_expires_ns
    for i, header, start in leased:
        if expired:
            counters.inc("shm_lease_expired")
            results[i] = miss(True)
        elif verify and checksum(segment[start : start + header.payload_len]) != header.checksum:
            counters.inc("corrupt_transfers")
            log.warning("block %s in shared memory failed its checksum; a miss", header.key.hex())
            results[i] = miss(True)
        else:
            results[i] = True
    if expired and leased:
        log.info("read leases expired during a device copy; %d blocks were misses", len(leased))
    return results


def copy_in_device(
    side: DeviceSide, placed: Sequence[tuple[Outgoing, int]]
) -> Generator[tuple[int, int], None, None]:
    """Copy device values into their reserved extents (``(item, extent offset)``), in
    order: yields ``(position, xxh3 of what landed)`` as each copy completes, so the
    caller commits item i while item i + 1's copy runs."""
    engine = side.engine
    segment = side.segment
    assert segment is not None
    srcs = [engine.flat(it.device) for it, _ in placed]
    starts = [off + HEADER_SIZE for _, off in placed]
    for s, src in zip(starts, srcs, strict=True):
        if s < HEADER_SIZE or s + int(src.numel()) > segment.size:
            raise TransportError(f"extent at {s - HEADER_SIZE} lies outside the segment")
    with DeviceWrite(engine, srcs, starts, segment, side.registration()) as writes:
        for j, view, landed in writes.items():
            if landed:
                yield j, checksum(view)
            else:
                dst = segment[starts[j] : starts[j] + view.size]
                yield j, copy_hashed(dst, view)


PUT_SLOTS = 4
"""Pinned staging buffers one TCP put from device tensors holds: while item i is hashed
and sent, the copies of items i + 1 .. i + 3 run."""


def staged_puts(
    side: DeviceSide, items: Sequence[Outgoing], slots: int = PUT_SLOTS
) -> Generator[tuple[Outgoing, memoryview], None, None]:
    """The device items' bytes, item by item in order, each once its device-to-host copy
    into a ring of ``slots`` pinned staging buffers is done (DeviceWrite, the same
    pipeline a same-host put runs into its extents). The bytes are valid until the next
    item is asked for: send them (a socket send has copied them when it returns) before
    asking, and the copy of item i + ``slots`` is queued into item i's buffer only
    then. Close the generator on every path out (the caller's ``finally``): that waits
    for the copies still queued, so no copy is in flight into a buffer let go."""
    engine = side.engine
    srcs = [engine.flat(it.device) for it in items]
    with DeviceWrite(engine, srcs, [None] * len(srcs), slots=slots) as writes:
        for j, view, _ in writes.items():
            yield items[j], memoryview(view)  # type: ignore[arg-type]


def stage_values(side: DeviceSide, items: Sequence[Outgoing], hashed: bool) -> None:
    """Give device items host bytes to send, all at once: copied into pinned staging as
    one batch (after the producer's stream), each hashed (``hashed``) while the next
    copies. For the puts that need every payload's bytes until the whole frame is
    sent (a checksum-first PUT; UCX, whose sends are not waited for); the others
    stream through :func:`staged_puts`."""
    todo = [it for it in items if it.device is not None]
    if not todo:
        return
    engine = side.engine
    srcs = [engine.flat(it.device) for it in todo]
    bufs = [engine.staging(int(src.numel())) for src in srcs]
    batches: dict[Any, Any] = {}
    marks = []
    try:
        for src, buf in zip(srcs, bufs, strict=True):
            batch = batches.get(src.device)
            if batch is None:
                batch = batches[src.device] = engine.begin(src.device)
            batch.d2h([buf.part(int(src.numel()))], [src])
            marks.append(batch.mark())
        for it, buf, mark, src in zip(todo, bufs, marks, srcs, strict=True):
            mark.wait()
            it.data = memoryview(buf.view[: int(src.numel())])  # type: ignore[arg-type]
            if hashed:
                it.sum = checksum(it.data)
    finally:
        for batch in batches.values():
            batch.finish()
