"""Typed, validated configuration; the only module that reads ``KVSTORE_*`` variables.

Sizes are strings like ``4GiB``, ``512MiB`` or ``1.5GB`` parsed strictly (binary
units are powers of 1024, decimal ones powers of 1000); a typo is a ConfigError
naming the setting, raised at start-up rather than at the first request.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvstore.errors import ConfigError
from kvstore.policy import POLICIES

__all__ = ["ENV_PREFIX", "NodeConfig", "parse_size"]

ENV_PREFIX = "KVSTORE_"

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int, name: str = "size") -> int:
    """``"4GiB"`` -> 4294967296. Integers pass through; negatives and junk are refused."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}: size must be >= 0, got {value}")
        return value
    m = _SIZE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{name}: cannot parse size {value!r} (try '512MiB' or '4GiB')")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _parse_bool(value: str | bool, name: str) -> bool:
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}: expected true/false, got {value!r}")


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Everything a StoreNode needs. Build with ``NodeConfig.load(...)`` at the edge.

    Attributes:
        node_id: unique within a cluster; names the node in the directory.
        dram_bytes: size of the DRAM slab (shared memory), allocated and warmed at start.
        hbm_bytes: size of the HBM slab; 0 disables it (and it needs CUDA).
        ssd_path: directory of the SSD tier; empty disables it.
        ssd_bytes: capacity of the SSD tier.
        policy: eviction policy name for every tier (see kvstore.policy).
        max_value_bytes: the largest single block accepted.
        warm: touch every page of the memory tiers at start.
        shm_name: name of the DRAM segment under /dev/shm (default: derived from the pid).
        event_queue: bound of the event queue before old events are dropped.
    """

    node_id: str = "node-0"
    dram_bytes: int = 256 * 1024**2
    hbm_bytes: int = 0
    ssd_path: str = ""
    ssd_bytes: int = 0
    policy: str = "lru"
    max_value_bytes: int = 64 * 1024**2
    warm: bool = True
    shm_name: str = ""
    event_queue: int = 1 << 20

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", self.node_id):
            raise ConfigError(f"node_id {self.node_id!r}: use 1-64 of [A-Za-z0-9._-]")
        if self.dram_bytes <= 0 and self.hbm_bytes <= 0:
            raise ConfigError("dram_bytes: a node needs a DRAM (or HBM) tier of > 0 bytes")
        if self.policy.lower() not in POLICIES:
            raise ConfigError(f"policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        if self.ssd_path and self.ssd_bytes <= 0:
            raise ConfigError("ssd_bytes: must be > 0 when ssd_path is set")
        if self.max_value_bytes <= 0:
            raise ConfigError("max_value_bytes: must be > 0")
        if self.shm_name and not re.fullmatch(r"[A-Za-z0-9._-]{1,200}", self.shm_name):
            raise ConfigError(f"shm_name {self.shm_name!r}: use [A-Za-z0-9._-]")

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> NodeConfig:
        """Defaults, then ``KVSTORE_<FIELD>`` variables, then explicit overrides."""
        env = os.environ if env is None else env
        raw: dict[str, Any] = {}
        for f in fields(cls):
            v = env.get(ENV_PREFIX + f.name.upper())
            if v is not None:
                raw[f.name] = v
        raw.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        return cls(**{k: _coerce(cls, k, v) for k, v in raw.items()})

    def replace(self, **changes: Any) -> NodeConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _coerce(cls: type, name: str, value: Any) -> Any:
    """Turn an env/flag string into the field's type, with the field named on error."""
    if name.endswith("_bytes"):
        return parse_size(value, name)
    default = {f.name: f.default for f in fields(cls)}[name]
    if isinstance(default, bool):
        return _parse_bool(value, name)
    if isinstance(default, int):
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: expected an integer, got {value!r}") from None
    return str(value)
