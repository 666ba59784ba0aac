"""What a soak (benchmarks/soak.py) saw, and how it is reported.

The records the run fills (per-phase counts in a :class:`Ledger`, one
:class:`FaultRecord` per fault, :class:`Proc` facts of each server), the summary of
them (:func:`summarize`: per fault kind and overall) and the Markdown tables
(:func:`table`). Kept apart from the run, which is about processes, load and faults.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "FAULTS",
    "STEADY",
    "WARMUP",
    "FaultRecord",
    "Ledger",
    "PhaseStats",
    "Proc",
    "proc_facts",
    "summarize",
    "table",
]

FAULTS = ("kill", "stop", "etcd")
STEADY = "steady"
WARMUP = "warmup"


@dataclass
class Proc:
    """/proc facts of one process."""

    rss_kib: int
    rss_anon_kib: int
    rss_shmem_kib: int
    fds: int
    threads: int
    thread_names: dict[str, int] = field(default_factory=dict)  # name -> how many
    fd_kinds: dict[str, int] = field(default_factory=dict)  # socket, pipe, file, anon_inode:...
    sockets: list[str] = field(default_factory=list)  # each socket fd's ends, for a leak's reader
    files: list[str] = field(default_factory=list)  # each regular file fd's path, likewise


def proc_facts(pid: int) -> Proc:
    status: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssShmem", "Threads"):
                status[name] = int(value.split()[0])
    return Proc(
        rss_kib=status.get("VmRSS", 0),
        rss_anon_kib=status.get("RssAnon", 0),
        rss_shmem_kib=status.get("RssShmem", 0),
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        threads=status.get("Threads", 0),
        thread_names=dict(Counter(_thread_names(pid))),
        fd_kinds=dict(Counter(_fd_kinds(pid))),
        sockets=_sockets(pid),
        files=_files(pid),
    )


_TCP_STATES = {"01": "ESTABLISHED", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT",
               "0A": "LISTEN", "04": "FIN_WAIT1", "05": "FIN_WAIT2", "09": "LAST_ACK"}  # fmt: skip


def _hex_addr(text: str) -> str:
    """``0100007F:1F90`` (as /proc/net/tcp writes it) -> ``127.0.0.1:8080``."""
    ip, port = text.split(":")
    if len(ip) != 8:
        return f"[{ip}]:{int(port, 16)}"
    return ".".join(str(int(ip[i : i + 2], 16)) for i in (6, 4, 2, 0)) + f":{int(port, 16)}"


def _socket_table(pid: int) -> dict[str, str]:
    """Socket inode -> a line naming its ends, from the process's view of /proc/net."""
    table: dict[str, str] = {}
    for proto in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{proto}") as f:
            for line in list(f)[1:]:
                cols = line.split()
                state = _TCP_STATES.get(cols[3], cols[3])
                table[cols[9]] = f"{proto} {_hex_addr(cols[1])}->{_hex_addr(cols[2])} {state}"
    with contextlib.suppress(OSError), open(f"/proc/{pid}/net/unix") as f:
        for line in list(f)[1:]:
            cols = line.split()
            table[cols[6]] = f"unix {cols[7] if len(cols) > 7 else '(unnamed)'}"
    return table


def _sockets(pid: int) -> list[str]:
    """Each socket fd of ``pid``: its protocol and ends (``socket:[inode]`` if unknown)."""
    inodes = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.append(target[len("socket:[") : -1])
    if not inodes:
        return []
    table = _socket_table(pid)
    return sorted(table.get(i, f"socket:[{i}]") for i in inodes)


def _fd_kinds(pid: int) -> list[str]:
    """What each open fd is: ``socket``, ``pipe``, ``anon_inode:[eventpoll]``, ``file``."""
    kinds = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            kinds.append(
                target.split(":[")[0]
                if ":[" in target
                else (target if target.startswith("anon_inode:") else "file")
            )
    return kinds


def _files(pid: int) -> list[str]:
    """The paths of the process's fds that are files (not sockets, pipes or anon inodes)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if not target.startswith("anon_inode:") and ":[" not in target:
                out.append(target)
    return sorted(out)


def _thread_names(pid: int) -> list[str]:
    names = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/comm") as f:
            # "python3.11" and "python3" are both the interpreter: "python"
            names.append(f.read().strip().rstrip("0123456789_-."))
    return names


@dataclass
class PhaseStats:
    """What the clients saw while one phase (a fault, or steady state) lasted."""

    ops: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    replicated_get_errors: int = 0
    hits: int = 0
    misses: int = 0
    wrong_reads: int = 0
    wrong_bytes: int = 0
    samples: list[str] = field(default_factory=list)


class Ledger:
    """Counts per phase; the fault thread names the phase, clients add to it.

    Concurrency contract: ``_lock`` guards ``phases``; ``phase`` is a str swapped
    atomically by the driver and read without the lock by clients."""

    def __init__(self) -> None:
        self.phase = WARMUP
        self.phases: dict[str, PhaseStats] = {}
        self._lock = threading.Lock()

    def add(self, phase: str, fn: Any) -> None:
        with self._lock:
            fn(self.phases.setdefault(phase, PhaseStats()))

    def error(self, phase: str, op: str, exc: BaseException | str, replicated: bool) -> None:
        def note(s: PhaseStats) -> None:
            s.errors[op] += 1
            if replicated and op == "get":
                s.replicated_get_errors += 1
            if len(s.samples) < 5:
                s.samples.append(
                    f"{op}: {type(exc).__name__ if not isinstance(exc, str) else ''} {exc}"
                )

        self.add(phase, note)


@dataclass
class FaultRecord:
    kind: str
    phase: str
    target: str
    started_s: float  # since the soak began
    converge_s: float | None = None  # from injection until every mirror is whole again
    left_mirrors_s: float | None = None  # stop: from SIGSTOP until out of every mirror


def summarize(
    ledger: Ledger,
    faults: list[FaultRecord],
    restarts: dict[str, int],
    rss_start: dict[str, int],
    rss_end: dict[str, int],
    before: dict[str, Proc],
    after: dict[str, Proc],
) -> dict[str, Any]:
    """Per fault kind and overall: ops, errors, wrong bytes, convergence; per server:
    RSS growth and fds/threads before and after."""
    rows: dict[str, dict[str, Any]] = {}
    kinds = {f.phase: f.kind for f in faults}
    for phase, s in ledger.phases.items():
        kind = kinds.get(phase, phase)
        row = rows.setdefault(kind, _row())
        row["ops"] += sum(s.ops.values())
        row["errors"] += sum(s.errors.values())
        row["replicated_get_errors"] += s.replicated_get_errors
        row["wrong_reads"] += s.wrong_reads
        row["wrong_bytes"] += s.wrong_bytes
        row["hits"] += s.hits
        row["misses"] += s.misses
        row["samples"] += s.samples[: 5 - len(row["samples"])]
        for op, n in s.ops.items():
            row["by_op"][op] = row["by_op"].get(op, 0) + n
    for f in faults:
        row = rows.setdefault(f.kind, _row())
        row["count"] += 1
        row["converge_s"].append(f.converge_s)
        if f.left_mirrors_s is not None or f.kind == "stop":
            row["left_mirrors_s"].append(f.left_mirrors_s)
    servers = {}
    for node in restarts:
        b, a = before.get(node), after.get(node)
        start, end = rss_start.get(node), rss_end.get(node)
        servers[node] = {
            "restarts": restarts[node],
            "rss_start_kib": start,
            "rss_end_kib": end,
            "rss_growth_pct": None if not start or end is None else 100.0 * (end - start) / start,
            "before": asdict(b) if b else None,
            "after": asdict(a) if a else None,
        }
    totals = _row()
    for row in rows.values():
        for k in (
            "ops",
            "hits",
            "misses",
            "errors",
            "replicated_get_errors",
            "wrong_reads",
            "wrong_bytes",
        ):
            totals[k] += row[k]
    return {"phases": rows, "totals": totals, "servers": servers}


def _row() -> dict[str, Any]:
    return {
        "count": 0,
        "ops": 0,
        "by_op": {},
        "errors": 0,
        "replicated_get_errors": 0,
        "wrong_reads": 0,
        "wrong_bytes": 0,
        "hits": 0,
        "misses": 0,
        "converge_s": [],
        "left_mirrors_s": [],
        "samples": [],
    }


def table(report: dict[str, Any]) -> str:
    """The reliability table (Markdown) and the leak lines."""

    def secs(values: list[float | None]) -> str:
        if not values:
            return "-"
        if any(v is None for v in values):
            return "not converged"
        return f"{max(v for v in values if v is not None):.1f}"

    lines = [
        "| phase | faults | ops during | reads checked (hits) | client-visible errors "
        "| of them: gets with a live replica | wrong bytes | converged within (s, max) "
        "| frozen node out of every mirror (s, max) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    order = [WARMUP, STEADY, *FAULTS]
    for kind in sorted(report["phases"], key=lambda k: order.index(k) if k in order else 99):
        r = report["phases"][kind]
        lines.append(
            f"| {kind} | {r['count'] or '-'} | {r['ops']} | {r['hits'] + r['wrong_reads']} | "
            f"{r['errors']} | "
            f"{r['replicated_get_errors']} | {r['wrong_bytes']} | {secs(r['converge_s'])} | "
            f"{secs(r['left_mirrors_s'])} |"
        )
    t = report["totals"]
    lines.append(
        f"| **total** | | {t['ops']} | {t['hits'] + t['wrong_reads']} | {t['errors']} | "
        f"{t['replicated_get_errors']} | "
        f"{t['wrong_bytes']} | | |"
    )
    lines += ["", "| server | restarts | RSS start -> end (MiB) | growth | fds before -> after "
              "| threads before -> after |", "|---|---|---|---|---|---|"]  # fmt: skip
    for n, s in report["servers"].items():
        b, a = s["before"] or {}, s["after"] or {}
        rss = (
            f"{s['rss_start_kib'] / 1024:.0f} -> {s['rss_end_kib'] / 1024:.0f}"
            if s["rss_start_kib"] and s["rss_end_kib"]
            else "-"
        )
        growth = f"{s['rss_growth_pct']:+.1f}%" if s["rss_growth_pct"] is not None else "-"
        lines.append(
            f"| {n} | {s['restarts']} | {rss} | {growth} | {b.get('fds')} -> {a.get('fds')} | "
            f"{b.get('threads')} -> {a.get('threads')} |"
        )
    cp = report["client_process"]
    lines += [
        "",
        f"client process: fds {cp['before']['fds']} -> {cp['after']['fds']}, threads "
        f"{cp['before']['threads']} -> {cp['after']['threads']}; shm segments left by node "
        f"lives: {len(report['leaked_segments'])}; load average {report['load_avg_start'][0]:.1f} "
        f"at start, {report.get('load_avg_end', [0])[0]:.1f} at end; client opens refused "
        f"at the end (etcd healthy, retried): {len(report.get('client_opens_refused_at_end', []))}",
    ]
    return "\n".join(lines)
