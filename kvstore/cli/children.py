"""Child processes of ``kvstore up`` and of the serving launcher (engine/serving/launch.py).

Each child runs in its own session (Ctrl-C reaches only the parent, which stops them in
order), gets SIGTERM from the kernel if the parent dies first (``PR_SET_PDEATHSIG`` on
Linux), writes its log to a file and prints one JSON ready line on stdout. The parent
waits for every ready line, and stops exactly what it started, by PID: SIGTERM, then
SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
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

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


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
    log: Path
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self) -> str:
        """The last line of the child's log (for error messages)."""
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


def spawn(name: str, argv: Sequence[str], *, log: Path, env: Mapping[str, str]) -> Child:
    """Start ``argv`` with stdout piped (for the ready line) and stderr to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=fh,
            env={**env, "PYTHONUNBUFFERED": "1"},
            text=True,
            start_new_session=True,  # Ctrl-C reaches only us: we stop them in order
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
    return Child(name, proc, log)


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
