"""Copies between host memory and device memory, for every part of the store that makes
them: the node's tiers (kvstore/tiers/: the HBM slab, a DRAM slab's copies to and from
CUDA tensors) and a client's transports (kvstore/client/device/: reads into and puts
from CUDA tensors). One room, so the rules around the copies are written once:

- engine.py: the copy-engine seam (batches of async copies on a side stream ordered
  after the producer's stream by an event, marks and one wait per batch; ordered
  copies into and out of a device slab), and :func:`~kvstore.copies.engine.is_cuda`;
- cuda.py / host.py: its CUDA implementation (pooled side streams, one ordered stream
  per device, the process's engine) and its host one (CPU tensors, copies deferred
  until waited for, so the logic above runs in CI);
- registry.py: host memory registered with CUDA, one table per process (chunks of at
  most 64 GiB, every return code checked, an overlapping range refused, the fallback
  logged once);
- staging.py: a ring of pinned staging buffers reused after their copies' events;
- landing.py: a departure landed in pieces and hashed as the pieces land, an arrival.
- caller.py: the caller's current CUDA stream, carried to the pool threads that run
  parts of its call (a sharded or cluster call's sub-calls, an async client's calls).

Nothing here imports torch until an engine is made or a tensor is copied, and nothing
here knows a tier, a transport or an inference engine.
"""
