"""Which CPU cores the connector's transfer threads run on, on a CPU-only vLLM host.

On CPU, vLLM's forward runs as an OpenMP team whose threads wait for each other at
every barrier. A transfer thread that takes one of the team's cores preempts a team
thread, and the whole team waits for it: on a host where the team holds every core,
moving KV beside the forward slows the forward by more than the transfer hides.
vLLM's own answer (its NIXL connector on CPU) is to keep the team off some cores and run
the transfer there. This module does the same for kvstore's loader and saver threads:

- ``transfer_cpus="auto"`` (the default): when vLLM's team is bound to an explicit
  core list (``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"0-6"``), the transfer threads run
  on the process's other cores; otherwise they run where the OS puts them.
- a core list (``"7"``, ``"6,7"``, ``"4-7"``): those cores.
- ``"none"``: never pinned.
"""

from __future__ import annotations

import logging
import os

from kvstore.errors import ConfigError

__all__ = ["host_cpus", "parse_cpu_list", "pin_this_thread", "transfer_cpus"]

log = logging.getLogger("vllm.kvstore")


def parse_cpu_list(text: str) -> set[int]:
    """``"0-3,6"`` -> {0, 1, 2, 3, 6}; a list of ranks (``"0-3|4-7"``) counts as one."""
    cpus: set[int] = set()
    for part in text.replace("|", ",").split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ConfigError(f"bad CPU list {text!r}: {part!r} is not a core or a range") from None
        if a < 0 or b < a:
            raise ConfigError(f"bad CPU list {text!r}: {part!r}")
        cpus.update(range(a, b + 1))
    if not cpus:
        raise ConfigError(f"bad CPU list {text!r}: no cores")
    return cpus


def host_cpus() -> set[int]:
    """The cores this process may use. Not the calling thread's affinity: OpenMP binds
    the forward's thread to its team's cores, and this is asked from that thread."""
    try:
        with open("/sys/fs/cgroup/cpuset.cpus.effective") as f:
            return parse_cpu_list(f.read().strip())
    except (OSError, ConfigError):
        return set(range(os.cpu_count() or 1))


def transfer_cpus(setting: str, omp_bind: str | None = None) -> set[int] | None:
    """The cores for transfer threads (None: leave them to the OS). ``omp_bind`` is
    vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` (read from the environment when None)."""
    if setting == "none":
        return None
    allowed = host_cpus()
    if setting != "auto":
        cpus = parse_cpu_list(setting) & allowed
        if not cpus:
            raise ConfigError(f"transfer_cpus {setting!r}: none of them is usable here")
        return cpus
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") if omp_bind is None else omp_bind
    if bind in ("", "auto", "nobind"):
        return None
    free = allowed - parse_cpu_list(bind)
    return free or None


def pin_this_thread(cpus: set[int] | None) -> None:
    """Run the calling thread on ``cpus`` (a ThreadPoolExecutor initializer)."""
    if cpus is None:
        return
    try:
        os.sched_setaffinity(0, cpus)  # pid 0: the calling thread, on Linux
    except OSError as exc:  # a cgroup may forbid it: the transfer still runs
        log.warning("KVStoreConnector: could not pin a transfer thread to %s: %s", cpus, exc)
