"""``pip install kvstore`` with no extras serves on its own.

A fresh virtualenv gets the package from a copy of this tree and nothing else: no torch,
no transformers, no ASGI stack. In it, ``kvstore serve --port 0`` must start and serve a
put and a get from ``StoreClient``, and a serving command must fail with the one line
that names its extra. The project's own environment has every extra installed, which
would hide an import of the serving stack from the store (issue 30); only a bare
environment shows it.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.process, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
_OFFLINE = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable")

_CLIENT = """
import sys
from kvstore import StoreClient
with StoreClient.connect(sys.argv[1], transport=sys.argv[2]) as c:
    c.put(b"k" * 16, b"bare install " * 1000)
    got = c.get(b"k" * 16)
    assert bytes(got) == b"bare install " * 1000, got
    assert c.get(b"m" * 16) is None
print("ok")
"""


def _env() -> dict[str, str]:
    """No KVSTORE_* settings and no PYTHONPATH: the venv sees only what pip put in it."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    return {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_") and k not in drop}


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv with ``pip install <copy of this tree>`` and no extras."""
    root = tmp_path_factory.mktemp("bare")
    src = root / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("kvstore", "engine"):
        shutil.copytree(ROOT / part, src / part, ignore=ignore)
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, src / part)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=_env())
    pip = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(src)],
        capture_output=True,
        text=True,
        timeout=900,
        env=_env(),
        cwd=root,
    )
    if pip.returncode != 0 and any(s in pip.stderr for s in _OFFLINE):
        pytest.skip(f"no package index reachable: {pip.stderr.strip().splitlines()[-1]}")
    assert pip.returncode == 0, pip.stderr
    return venv


@pytest.fixture
def bare_server(bare_venv: Path, tmp_path: Path) -> Iterator[dict[str, object]]:
    """``kvstore serve --port 0`` from the bare venv; yields its ready line."""
    argv = [str(bare_venv / "bin" / "kvstore"), "serve", "--json", "--port", "0"]
    argv += ["--data-port", "0", "--dram-bytes", "32MiB", "--allow-anonymous"]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=_env())
    log.close()
    try:
        yield _ready(proc, tmp_path / "serve.log")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)
        assert proc.stdout is not None
        proc.stdout.close()


def _ready(proc: subprocess.Popen[str], log: Path) -> dict[str, object]:
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.2)[0]:
            line = proc.stdout.readline()
            if line.startswith("{"):
                return dict(json.loads(line))
    raise AssertionError(f"kvstore serve did not start in the bare venv:\n{log.read_text()}")


def test_the_bare_venv_has_no_extras(bare_venv: Path) -> None:
    probe = (
        "import importlib.util as u; "
        "print([m for m in ('torch', 'starlette', 'transformers') if u.find_spec(m)])"
    )
    out = subprocess.run(
        [str(bare_venv / "bin" / "python"), "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        env=_env(),
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_serve_puts_and_gets_without_extras(
    bare_venv: Path, bare_server: dict[str, object], transport: str, tmp_path: Path
) -> None:
    address = f"127.0.0.1:{bare_server['port']}"
    out = subprocess.run(
        [str(bare_venv / "bin" / "python"), "-c", _CLIENT, address, transport],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize("command", ["worker", "router", "demo", "plan"])
def test_a_serving_command_names_its_extra_in_one_line(bare_venv: Path, command: str) -> None:
    out = subprocess.run(
        [str(bare_venv / "bin" / "kvstore"), command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert f"kvstore {command} needs the 'engine' extra" in lines[0]
    assert "pip install 'kvstore[engine]'" in lines[0]


def test_the_store_commands_list_the_serving_ones(bare_venv: Path) -> None:
    out = subprocess.run(
        [str(bare_venv / "bin" / "kvstore"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert out.returncode == 0, out.stderr
    for command in ("serve", "up", "stats", "nodes", "ls", "evict", "drain", "worker", "demo"):
        assert command in out.stdout
