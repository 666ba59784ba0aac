"""kvstore/procs/children.py: the children of ``kvstore up`` and of the serving launcher.
Each runs under its own PID with the environment it was given, and dies with its parent
(Linux: PR_SET_PDEATHSIG, set by a guard that execs the program)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.procs.children import spawn, stop_group, wait_ready
from tests.support.waiting import wait_until

pytestmark = pytest.mark.process

_READY = "import json, os, sys; print(json.dumps({'pid': os.getpid(), 'argv': sys.argv[1:], "
_READY += "'env': os.environ.get('CHILD_WORD')}), flush=True); import time; time.sleep(60)"


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (reaped by whoever adopted it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def test_a_child_runs_under_its_own_pid_with_its_argv_and_env(tmp_path: Path) -> None:
    child = spawn(
        "c",
        [sys.executable, "-c", _READY, "--flag", "two words"],
        log=tmp_path / "c.log",
        env={**os.environ, "CHILD_WORD": "hello"},
    )
    try:
        wait_ready([child], time.monotonic() + 30)
        want = {"pid": child.proc.pid, "argv": ["--flag", "two words"], "env": "hello"}
        assert child.facts == want
    finally:
        stop_group([child], 5)
    assert child.proc.returncode is not None


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_its_parent(tmp_path: Path) -> None:
    """A parent killed outright (no chance to stop its children) takes its child with it."""
    parent_code = (
        "import json, sys, time\n"
        "from pathlib import Path\n"
        "from kvstore.procs.children import spawn, wait_ready\n"
        f"c = spawn('c', [sys.executable, '-c', {_READY!r}], log=Path({str(tmp_path / 'c.log')!r}),"
        " env={})\n"
        "wait_ready([c], time.monotonic() + 30)\n"
        "print(json.dumps(c.facts), flush=True)\n"
        "time.sleep(60)\n"
    )
    root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True, cwd=root
    )
    try:
        assert parent.stdout is not None
        facts = json.loads(parent.stdout.readline())
        pid = facts["pid"]
        assert not _gone(pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        wait_until(lambda: _gone(pid), "the child to follow its parent")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
