"""The node's block events in vLLM's KV-events wire format, published over ZMQ.

Routers that already follow vLLM engines through their KV events (Dynamo's KV router,
llm-d's scheduler, vLLM's own router) learn which worker holds which blocks from a
ZMQ PUB stream of ``KVEventBatch`` messages. A kvstore node publishing the same stream
is a pool those routers can follow without new code.

The format, as vLLM's ``vllm/distributed/kv_events.py`` defines it (read, not copied):

- each message is three ZMQ frames: topic, sequence number (8 bytes, big-endian, one
  per batch, from 0), payload;
- the payload is a msgpack array ``[ts, events]`` (``data_parallel_rank`` omitted);
- each event is a msgpack map tagged by ``"type"``: ``BlockStored`` with
  ``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``,
  ``medium`` and ``lora_name``; ``BlockRemoved`` with ``block_hashes`` and ``medium``;
- a ROUTER socket answers replay requests: ``[identity, b"", start_seq]`` gets every
  buffered batch from ``start_seq`` on, then an end marker with sequence -1.

What a kvstore node can say: ``block_hashes`` are the 16-byte keys the node stores
(bytes, which vLLM's ExternalBlockHash allows). Those are tenant-scoped
(kvstore/tenants.py), as in the cluster directory: a tenant's router maps its own block
keys with the scope key a node's INFO reply gave its token
(``Principal(tenant, scope_key=...).scope_all(keys)``) and recognizes its blocks, while
another tenant's are opaque hashes to it. ``medium`` is ``GPU`` for HBM, ``CPU`` for DRAM
and ``STORAGE`` for SSD; a block that changes tier is a BlockRemoved from the old
medium and a BlockStored on the new one. The node stores bytes, so ``token_ids`` is
empty and ``parent_block_hash`` is None (keys already chain their prefix), and
``block_size`` is the configured tokens per block. A consumer that keys its index on
block hashes follows the pool; one that recomputes hashes from token ids needs the
engine's own events.

A node sharded across processes (``kvstore serve --shards N``) publishes one stream per
shard, as vLLM's data-parallel ranks do: shard ``i`` binds :func:`shard_endpoint` (a
TCP port plus ``i``, an ``ipc``/``inproc`` name with ``_dp<i>`` appended, vLLM's own
rule for its ranks) and puts ``i`` in each batch's ``data_parallel_rank``. Each stream
lists the blocks of its shard; a router that follows vLLM's DP ranks follows the node.

Delivery is vLLM's: at least once per subscriber that keeps up, in order, with replay
of the last ``buffer_batches`` batches. If the node's event tap overflows (the
publisher fell behind), the next batch starts with ``AllBlocksCleared`` followed by
a BlockStored of every block the node holds, so a consumer never keeps a stale view.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from kvstore.errors import ConfigError
from kvstore.events import BlockEvent, BlockMoved, BlockRemoved, BlockStored, EventQueue
from kvstore.tier_kinds import TierKind

__all__ = ["MEDIUM", "KVEventsPublisher", "encode_batch", "shard_endpoint"]

log = logging.getLogger(__name__)

# vLLM's medium of each tier, by the tier's name (the server names no device tier)
MEDIUM = {"hbm": "GPU", "dram": "CPU", "ssd": "STORAGE"}
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _stored(keys: list[bytes], medium: str, block_size: int) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": keys,
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


def _removed(keys: list[bytes], medium: str) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": keys, "medium": medium}


def to_vllm_events(events: Iterable[BlockEvent], block_size: int) -> list[dict[str, Any]]:
    """vLLM event maps for node events, in order. Runs of the same kind on the same
    medium become one event with several hashes (vLLM's events carry lists)."""
    out: list[dict[str, Any]] = []
    run: tuple[str, str] | None = None  # (type, medium) of out[-1], while it may grow

    def add(kind: str, key: bytes, tier: TierKind) -> None:
        nonlocal run
        medium = MEDIUM[tier.value]
        if run == (kind, medium):
            out[-1]["block_hashes"].append(key)
            return
        out.append(_stored([key], medium, block_size) if kind == "s" else _removed([key], medium))
        run = (kind, medium)

    for e in events:
        if isinstance(e, BlockStored):
            add("s", bytes(e.key), e.tier)
        elif isinstance(e, BlockRemoved):
            add("r", bytes(e.key), e.tier)
        elif isinstance(e, BlockMoved):
            add("r", bytes(e.key), e.src)
            add("s", bytes(e.key), e.dst)
    return out


def encode_batch(ts: float, events: list[dict[str, Any]], rank: int | None = None) -> bytes:
    """A KVEventBatch payload: msgpack ``[ts, events]``, or ``[ts, events, rank]`` from
    shard ``rank`` of a sharded node (vLLM's ``data_parallel_rank``)."""
    import msgpack

    body: list[Any] = [ts, events] if rank is None else [ts, events, rank]
    return bytes(msgpack.packb(body, use_bin_type=True))


def shard_endpoint(endpoint: str, index: int) -> str:
    """Where shard ``index`` of a sharded node publishes, given the node's ``endpoint``:
    vLLM's rule for its data-parallel ranks. ``tcp://h:5557`` -> ``tcp://h:<5557 +
    index>`` (a port of ``*`` or 0 is left for the system to pick); any other transport
    gets ``_dp<index>`` appended. Shard 0 keeps the endpoint as given."""
    if not endpoint or index == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if port in ("*", "0"):
            return endpoint
        if not port.isdigit() or int(port) + index > 65535:
            raise ConfigError(f"kv events endpoint {endpoint!r}: no port for shard {index}")
        return f"{base}:{int(port) + index}"
    return f"{endpoint}_dp{index}"


class KVEventsPublisher:
    """Publishes a node's block events on a ZMQ PUB socket, with a replay ROUTER.

    ``tap`` is the node's event tap (EventQueue.tap); ``snapshot`` lists every block as
    (key, tier) for the re-sync after the tap overflowed. One thread owns both sockets
    (ZMQ sockets are not thread-safe): it batches what the tap holds every
    ``interval_s``, publishes, and answers replay requests in between.
    """

    def __init__(
        self,
        tap: EventQueue,
        snapshot: Callable[[], list[tuple[bytes, TierKind]]],
        endpoint: str,
        *,
        replay_endpoint: str = "",
        topic: str = "kvstore",
        block_size: int = 16,
        interval_s: float = 0.01,
        buffer_batches: int = 10_000,
        max_events: int = 4096,
        rank: int | None = None,
    ) -> None:
        try:
            import msgpack  # noqa: F401
            import zmq
        except ImportError as exc:
            raise ConfigError(
                f"kv_events_endpoint needs pyzmq and msgpack ({exc}): pip install 'kvstore[events]'"
            ) from exc
        self.tap = tap
        self.snapshot = snapshot
        self.topic = topic.encode()
        self.block_size = block_size
        self.interval_s = interval_s
        self.max_events = max_events
        self.rank = rank  # the shard's index on a sharded node, else None
        self.seq = 0
        self.published = 0  # events sent
        self._seen_dropped = tap.dropped
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: Any = None
        self._stop = threading.Event()
        try:
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = ""
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(f"kv events: cannot bind {endpoint!r}: {exc}") from exc
        self._thread = threading.Thread(target=self._run, name="kvstore-kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                self.flush()
                if self._replay is not None:
                    if poller.poll(max(int(self.interval_s * 1000), 1)):
                        self._serve_replay()
                else:
                    self._stop.wait(self.interval_s)
            except Exception:  # a bad batch must not end the stream for good
                log.exception("kv events: publishing failed; going on")
                self._stop.wait(0.1)
        self.flush()

    def flush(self) -> int:
        """Publish what the tap holds now (in batches of ``max_events``); returns the
        number of node events taken. Called by the publisher thread only."""
        taken = 0
        events: list[dict[str, Any]] = []
        if self.tap.dropped != self._seen_dropped:  # fell behind: say so, then re-list
            self._seen_dropped = self.tap.dropped
            taken += len(self.tap.take())
            events.append({"type": "AllBlocksCleared"})
            blocks = [BlockStored(k, t, 0, b"") for k, t in self.snapshot()]
            events += to_vllm_events(blocks, self.block_size)
        while True:
            batch = self.tap.take(self.max_events)
            taken += len(batch)
            events += to_vllm_events(batch, self.block_size)
            if events:
                self._send(events)
                events = []
            if len(batch) < self.max_events:
                return taken

    def _send(self, events: list[dict[str, Any]]) -> None:
        payload = encode_batch(time.time(), events, self.rank)
        seq = self.seq
        self.seq += 1
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.published += len(events)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: malformed replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart(
                    (client, b"", self.topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self, timeout: float = 5.0) -> None:
        """Publish what is left, stop the thread, close the sockets."""
        self._stop.set()
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()
