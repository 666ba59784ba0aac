"""What every blocking client of the SDK shares: the lifecycle, the call deadline, keys.

A client is unopened, open or closed (httpx's ClientState): ``open()`` moves it from
the first to the second, ``close()`` to the third, for good. A call on a client that
is not open raises ClosedError saying which of the two it is, and how to get an open
one, so a caller that forgot ``connect`` is told something other than one who closed
too early. :class:`~kvstore.client.store.NodeClient` (one node) and
:class:`~kvstore.client.cluster.ClusterClient` (a cluster) are both a
:class:`ClientBase`; the asyncio facade (store.py, AsyncNodeClient) has no state of its
own and reports the state of the client it wraps.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from enum import Enum
from typing import Any, ClassVar, Self

from kvstore.config import ClientConfig
from kvstore.errors import ClosedError, KVStoreError
from kvstore.keys import KEY_BYTES, as_key

__all__ = ["ClientBase", "ClientState", "one"]


class ClientState(Enum):
    """Where a client is in its life; it only ever moves forward."""

    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


class ClientBase(ABC):
    """Lifecycle, deadline and key checks of a blocking client.

    A subclass names itself in ``_name`` (as users know it) and the ways to get an open
    one in ``_open_with``; its ``open`` starts with :meth:`_already_open` and ends by
    setting ``_state`` to OPEN, its ``close`` sets it to CLOSED.
    """

    _name: ClassVar[str]
    _open_with: ClassVar[str]
    config: ClientConfig

    def __init__(self) -> None:
        self._state = ClientState.UNOPENED

    @abstractmethod
    def open(self) -> Self:
        """Connect; opening an open client does nothing, a closed one raises."""

    @abstractmethod
    def close(self) -> None:
        """Release every connection; idempotent."""

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def state(self) -> str:
        """``unopened``, ``open`` or ``closed``."""
        return self._state.value

    def _already_open(self) -> bool:
        """Whether ``open`` has nothing to do; ClosedError once closed, since a closed
        client never comes back (its counters and caches describe a past life)."""
        if self._state is ClientState.CLOSED:
            raise ClosedError(f"{self._name} is closed; create a new one to reconnect")
        return self._state is ClientState.OPEN

    def _check_open(self) -> None:
        if self._state is ClientState.UNOPENED:
            raise ClosedError(f"{self._name} is not open: use {self._open_with}")
        if self._state is ClientState.CLOSED:
            raise ClosedError(f"{self._name} is closed")

    def _as_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys of a call as 16-byte keys (hashed when given otherwise), once the
        client is known to be open."""
        self._check_open()
        return [k if type(k) is bytes and len(k) == KEY_BYTES else as_key(k) for k in keys]

    def _deadline(self, timeout: float | None) -> float:
        """When a call given ``timeout`` (None: the configured one) must be done."""
        return time.monotonic() + (self.config.timeout_s if timeout is None else timeout)


def one(results: list[Any]) -> Any:
    """The single result of a one-key batch call, its error raised."""
    r = results[0]
    if isinstance(r, KVStoreError):
        raise r
    return r
