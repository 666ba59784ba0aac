"""The client's device paths: how one call moves blocks between the node's host memory
and CUDA tensors without touching the bytes on the CPU. The machinery they share with
the node (the copy engines, the process's registry of host memory registered with
CUDA, the pinned staging ring) is kvstore/copies/; here is what is the client's own:

- side.py: one transport's device half (which values take the device paths, the
  engine, the transport's registration of its mapping of the node's segment);
- reads.py / writes.py: one call's copies into device tensors and out of them.

Nothing here imports torch until a CUDA tensor (or a test's host engine) is seen:
:func:`~kvstore.copies.engine.is_cuda` reads the value's own attributes.
"""
