"""Fault plans: which calls of a seam fail or stall, for the wrappers that inject them.

A :class:`FaultPlan` is a list of :class:`Fault` rules. The wrappers over the client's
connector (kvstore/client/faults.py: control calls, links, transports) and over the
directory (kvstore/directory/faults.py) ask the plan before delegating each call, by
an operation name (``read``, ``write``, ``exists``, ``match_prefix``, ``lend``,
``control.<Method>``, ``reachable``, ``directory.<method>``) and where it goes (a
host, or the cluster for a directory). The first rule that matches and still has
shots left fires: it sleeps ``delay_s`` (a stall), then raises ``error`` (a failure),
or, for a batch with ``after_keys`` set, lets the transport serve that many keys and
fails the rest (``per_key``: as that key's own error; otherwise the call raises once
the served part is done, as a connection cut mid-reply would).

The plan is the only state; the wrappers are real implementations of their seams that
delegate everything else. Tests build plans in code; ``ClientConfig.faults`` (env
``KVSTORE_FAULTS``) builds one from text for a whole process, e.g.
``read@node-a:error=transport:times=2,control.*:delay=0.5``.
"""

from __future__ import annotations

import asyncio
import fnmatch
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from kvstore.errors import ConfigError, KVStoreError, error_for_code

__all__ = ["Fault", "FaultPlan"]


@dataclass
class Fault:
    """One rule. ``op`` and ``where`` are shell-style patterns."""

    op: str
    where: str = "*"
    error: KVStoreError | None = None
    delay_s: float = 0.0
    times: int | None = None  # shots left (None: every matching call)
    skip: int = 0  # matching calls let through before the first shot
    after_keys: int | None = None  # batches: serve this many keys, fail the rest
    per_key: bool = False  # with after_keys: the rest get the error per key
    seen: int = field(default=0, repr=False)

    def matches(self, op: str, where: str) -> bool:
        return fnmatch.fnmatchcase(op, self.op) and fnmatch.fnmatchcase(where, self.where)


class FaultPlan:
    """Rules, asked by the fault wrappers before each call. Thread-safe."""

    def __init__(self, *faults: Fault) -> None:
        self.faults = list(faults)
        self.fired: Counter[str] = Counter()  # op -> shots fired
        self._lock = threading.Lock()

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """Heal: no rule fires any more."""
        with self._lock:
            self.faults = []

    def take(self, op: str, where: str = "") -> Fault | None:
        """The rule that fires for this call (counted), or None."""
        with self._lock:
            for f in self.faults:
                if not f.matches(op, where):
                    continue
                f.seen += 1
                if f.seen <= f.skip or (f.times is not None and f.times <= 0):
                    continue
                if f.times is not None:
                    f.times -= 1
                self.fired[op] += 1
                return f
        return None

    def inject(self, op: str, where: str = "") -> Fault | None:
        """Apply a firing rule before a blocking call: stall, then raise its error.
        Returns a rule that cuts a batch (``after_keys``) for the caller to apply."""
        f = self.take(op, where)
        if f is None:
            return None
        if f.delay_s:
            time.sleep(f.delay_s)
        if f.error is not None and f.after_keys is None:
            raise f.error
        return f

    async def ainject(self, op: str, where: str = "") -> None:
        """:meth:`inject` for a coroutine (the stall does not block the loop)."""
        f = self.take(op, where)
        if f is None:
            return
        if f.delay_s:
            await asyncio.sleep(f.delay_s)
        if f.error is not None:
            raise f.error

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        """``op[@where][:error=<code>][:delay=<s>][:times=<n>][:skip=<n>][:after=<n>]
        [:per_key]``, comma-separated; error codes are those of kvstore/errors.py."""
        plan = cls()
        for part in filter(None, (p.strip() for p in spec.split(","))):
            head, *opts = part.split(":")
            op, _, where = head.partition("@")
            f = Fault(op, where or "*")
            for opt in opts:
                name, _, value = opt.partition("=")
                try:
                    if name == "error":
                        f.error = error_for_code(value, f"injected fault ({part})")
                    elif name == "delay":
                        f.delay_s = float(value)
                    elif name == "times":
                        f.times = int(value)
                    elif name == "skip":
                        f.skip = int(value)
                    elif name == "after":
                        f.after_keys = int(value)
                    elif name == "per_key":
                        f.per_key = True
                    else:
                        raise ValueError(name)
                except ValueError:
                    raise ConfigError(f"faults: cannot read {opt!r} in {part!r}") from None
            plan.add(f)
        return plan
