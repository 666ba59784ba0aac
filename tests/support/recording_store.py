"""A store seen through a recorder: each call logged and checked, then passed on.

The engine tests (tests/engine/test_engine_device.py on the CPU, tests/gpu/ on CUDA)
use it to hold the device-generic path to its promises: every tensor handed to the
store is on the model's device, and a batch is the rows of one contiguous tensor.
The store behind it is real (a NodeStore over a StoreNode).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.blockstore import NodeStore
from kvstore import Namespace

__all__ = ["Recorder", "rows_of_one_tensor"]


def rows_of_one_tensor(ts: Sequence[torch.Tensor]) -> bool:
    """True when ``ts`` are consecutive rows of one contiguous tensor (one storage,
    each starting where the previous one ends)."""
    if not ts:
        return True
    base = ts[0].untyped_storage().data_ptr()
    step = ts[0].numel() * ts[0].element_size()
    return all(
        t.is_contiguous()
        and t.untyped_storage().data_ptr() == base
        and t.data_ptr() == ts[0].data_ptr() + i * step
        for i, t in enumerate(ts)
    )


class Recorder:
    """A NodeStore whose calls are logged and checked (device, one staging tensor)."""

    def __init__(self, inner: NodeStore, device: torch.device) -> None:
        self.inner, self.device = inner, device
        self.calls: list[tuple[str, int]] = []

    def _check(self, ts: Sequence[Any]) -> None:
        assert all(isinstance(t, torch.Tensor) and t.device == self.device for t in ts)
        assert rows_of_one_tensor(ts), "a batch must be the rows of one contiguous tensor"

    def put(self, key: bytes, value: Any, *, namespace: Namespace | None = None) -> bool:
        self.calls.append(("put", 1))
        return self.inner.put(key, value, namespace=namespace)

    def get_into(self, key: bytes, out: Any, *, namespace: Namespace | None = None) -> bool:
        self.calls.append(("get_into", 1))
        return self.inner.get_into(key, out, namespace=namespace)

    def batch_put(
        self, keys: Sequence[bytes], values: Sequence[Any], *, namespace: Namespace | None = None
    ) -> list[Any]:
        self._check(values)
        self.calls.append(("batch_put", len(keys)))
        return self.inner.batch_put(keys, values, namespace=namespace)

    def batch_get_into(
        self,
        keys: Sequence[bytes],
        outs: Sequence[Any],
        *,
        namespace: Namespace | None = None,
        layers: tuple[int, int] | None = None,
    ) -> list[Any]:
        self._check(outs)
        self.calls.append(("batch_get_into", len(keys)))
        return self.inner.batch_get_into(keys, outs, namespace=namespace, layers=layers)

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        return self.inner.match_prefix(keys)

    def remove(self, keys: Sequence[bytes]) -> int:
        return self.inner.remove(keys)

    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]
