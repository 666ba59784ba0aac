"""Is the server on this host? The boot id says so, for processes under one kernel.

Two processes with the same ``/proc/sys/kernel/random/boot_id`` run on the same
kernel, so they can share memory if they can also open the same segment (containers
with separate /dev/shm share a boot id but not the segment: the client then fails to
map it and falls back to TCP). Hostnames alone are not enough: containers often share
one, and two machines may be given the same.
"""

from __future__ import annotations

import functools
import socket

__all__ = ["PROBE_TIMEOUT_S", "host_id", "hostname"]

_BOOT_ID = "/proc/sys/kernel/random/boot_id"

PROBE_TIMEOUT_S = 0.3
"""How long a TCP connect may take before an address counts as unreachable (a node
checking its advertised address, a client checking a member it cannot reach)."""


@functools.cache
def host_id() -> str:
    """This kernel's boot id ("" where there is none, which never matches)."""
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


def hostname() -> str:
    """This host's name (for humans; locality is decided by :func:`host_id`)."""
    return socket.gethostname()
