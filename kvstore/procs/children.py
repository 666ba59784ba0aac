"""Child processes of ``kvstore up`` and of the serving launcher (engine/serving/launch.py).

Each child runs in its own session (Ctrl-C reaches only the parent, which stops them in
order), gets SIGTERM from the kernel if the parent dies first (``PR_SET_PDEATHSIG`` on
Linux), writes its log to a file and prints one JSON ready line on stdout. The parent
waits for every ready line, and stops exactly what it started, by PID: SIGTERM, then
SIGKILL after a grace period.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvstore.errors import Unavailable

__all__ = ["Child", "ReadyChild", "serve_argv", "spawn", "stop_group", "wait_ready"]

# Linux: each child first runs this guard, which asks the kernel for SIGTERM when its
# parent dies (PR_SET_PDEATHSIG, 1; it survives exec), leaves at once if the parent is
# already gone, then execs the real program under the same PID.
#
# Why not a preexec_fn that does the same between fork and exec: a preexec_fn makes
# subprocess fork() rather than vfork(), and fork() runs gRPC's fork handlers in the
# child. With gRPC busy in the parent (a store client, an etcd watch), those restart
# gRPC's poller thread in the child, subprocess then closes the child's descriptors,
# the poller's epoll descriptor among them, and the poller aborts the child before its
# exec ("epoll_wait error: Bad file descriptor"; seen once in the soak test, and
# grpc/grpc issue 43055). vfork() runs no fork handlers.
_GUARD = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('kvstore: the parent exited before this child started')\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def _guarded(argv: Sequence[str]) -> list[str]:
    """``argv`` behind the guard above (Linux), as is elsewhere."""
    if sys.platform != "linux":
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _GUARD, str(os.getpid()), *argv]


class ReadyChild(Protocol):
    """What :func:`wait_ready` and :func:`stop_group` need of a child."""

    proc: subprocess.Popen[str]
    facts: dict[str, Any]

    @property
    def name(self) -> str: ...

    def tail(self) -> str: ...


@dataclass
class Child:
    """One child process, its log and the facts of its JSON ready line."""

    name: str
    proc: subprocess.Popen[str]
    log: Path | None  # None: the child writes its log to our stderr
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self) -> str:
        """The last line of the child's log (for error messages)."""
        if self.log is None:
            return f"[{self.name}] (its log is above, on stderr)"
        try:
            text = self.log.read_text(errors="replace").strip()
        except OSError:
            return f"[{self.name}] (no log)"
        return f"[{self.name}] " + (text.splitlines()[-1] if text else "(no output)")


def serve_argv(flags: Mapping[str, Any]) -> list[str]:
    """``kvstore serve --json`` with ``flags`` (``name=value``; True for a bare switch,
    None left out), run by this interpreter."""
    argv = [sys.executable, "-m", "kvstore.cli", "serve", "--json"]
    for name, value in flags.items():
        if value is True:
            argv.append("--" + name.replace("_", "-"))
        elif value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def spawn(name: str, argv: Sequence[str], *, log: Path | None, env: Mapping[str, str]) -> Child:
    """Start ``argv`` with stdout piped (for the ready line) and stderr to ``log`` (None:
    to this process's stderr)."""
    if log is None:
        return Child(name, _popen(argv, None, env), None)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        return Child(name, _popen(argv, fh, env), log)


def _popen(argv: Sequence[str], stderr: Any, env: Mapping[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        _guarded(argv),
        stdout=subprocess.PIPE,
        stderr=stderr,
        env={**env, "PYTHONUNBUFFERED": "1"},
        text=True,
        start_new_session=True,  # Ctrl-C reaches only us: we stop them in order
    )


def wait_ready(children: Sequence[ReadyChild], deadline: float) -> None:
    """Read each child's JSON ready line into its ``facts``; Unavailable (with the log's
    last line) when one exits first or ``deadline`` passes."""
    waiting = {c.proc.stdout: c for c in children if c.proc.stdout is not None}
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            tails = "; ".join(c.tail() for c in waiting.values())
            raise Unavailable(f"not ready in time: {tails}")
        ready, _, _ = select.select(list(waiting), [], [], min(left, 0.2))
        for stream in ready:
            child = waiting[stream]
            line = stream.readline()
            if line.startswith("{"):
                child.facts = json.loads(line)
                del waiting[stream]
            elif not line and child.proc.poll() is not None:
                raise Unavailable(f"{child.name} exited: {child.tail()}")


def stop_group(children: Sequence[ReadyChild], grace: float) -> None:
    """SIGTERM every child, then wait; SIGKILL those still running after ``grace``."""
    for c in children:
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace
    for c in children:
        try:
            c.proc.wait(max(end - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait(5.0)
        if c.proc.stdout is not None:
            c.proc.stdout.close()
