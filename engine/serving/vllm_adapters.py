"""The LoRA adapters a pool of ``vllm serve`` servers serves, as ``kvstore vllm-router``
needs them for its cache check.

Why: the connector roots a LoRA request's key chain in its adapter's name and path
(engine/vllm/keys.py), so a prompt's blocks under an adapter are not the base model's.
A request names its adapter only by name (``"model": "sql-lora"``); vLLM lists each
adapter it serves in ``/v1/models`` with its path (``root``) and base model
(``parent``). So the router asks a server for that list and keeps it; a request naming
an adapter, or a model it does not know, asks again once the list is
:data:`REFRESH_S` old (an adapter loaded since through vLLM's ``/v1/load_lora_adapter``,
or loaded again from another path). A model it still does not know is not checked at
all (the prefill runs): checking it as the base model could skip a prefill the decode
server then has to compute itself. The ask is bounded by the router (a short timeout):
a hung server costs a request that long, once per :data:`REFRESH_S`, and a miss.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["BASE", "REFRESH_S", "Adapters", "UNKNOWN"]

log = logging.getLogger(__name__)

REFRESH_S = 5.0
"""Least time between two reads of a server's model list."""

BASE = ""
"""What :meth:`Adapters.lora` says of the base model: no adapter."""

UNKNOWN = None
"""What :meth:`Adapters.lora` says of a model no server lists."""


class Adapters:
    """Adapter name -> ``name@path`` (how the connector names it), from ``/v1/models``.

    ``fetch()`` returns a server's ``/v1/models`` body (raising on failure); ``base`` are
    the names the base model is served under. Used from the router's event loop only.
    """

    def __init__(
        self,
        fetch: Callable[[], Awaitable[dict[str, Any]]],
        base: set[str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch = fetch
        self._base = set(base)
        self._clock = clock
        self._lora: dict[str, str] = {}
        self._read_at: float | None = None

    async def lora(self, model: Any) -> str | None:
        """:data:`BASE` for the base model (or no model named), the adapter's
        ``name@path`` for an adapter, :data:`UNKNOWN` for a model no server lists."""
        if not isinstance(model, str) or not model or model in self._base:
            return BASE
        if self._due():
            await self._refresh()
        if model in self._base:
            return BASE
        return self._lora.get(model, UNKNOWN)

    def _due(self) -> bool:
        return self._read_at is None or self._clock() - self._read_at >= REFRESH_S

    async def _refresh(self) -> None:
        self._read_at = self._clock()
        try:
            body = await self._fetch()
        except Exception as exc:  # the check is an optimization: a miss, not a failure
            log.warning("could not list the servers' models (%s: %s)", type(exc).__name__, exc)
            return
        lora: dict[str, str] = {}
        for card in body.get("data", []) if isinstance(body, dict) else []:
            if not isinstance(card, dict) or not isinstance(card.get("id"), str):
                continue
            if card.get("parent"):  # an adapter: its root is the path it was loaded from
                lora[card["id"]] = f"{card['id']}@{card.get('root') or ''}"
            else:
                self._base.add(card["id"])
        self._lora = lora
