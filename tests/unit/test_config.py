"""NodeConfig: strict sizes, KVSTORE_ environment, clear errors naming the setting."""

from __future__ import annotations

import pytest

from kvstore.config import NodeConfig, parse_size
from kvstore.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("4GiB", 4 << 30),
        ("512MiB", 512 << 20),
        ("1.5GB", 1_500_000_000),
        ("1024", 1024),
        ("16 KiB", 16 << 10),
        ("2g", 2 << 30),
        (0, 0),
    ],
)
def test_parse_size(text: str | int, want: int) -> None:
    assert parse_size(text) == want


@pytest.mark.parametrize("bad", ["4 GiBs", "-1", "lots", "", "1e9", True, -5])
def test_parse_size_refuses_junk(bad: object) -> None:
    with pytest.raises(ConfigError, match="dram_bytes"):
        parse_size(bad, "dram_bytes")  # type: ignore[arg-type]


def test_env_then_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_DRAM_BYTES", "64MiB")
    monkeypatch.setenv("KVSTORE_POLICY", "s3fifo")
    monkeypatch.setenv("KVSTORE_WARM", "false")
    c = NodeConfig.load()
    assert (c.dram_bytes, c.policy, c.warm) == (64 << 20, "s3fifo", False)
    assert NodeConfig.load(dram_bytes="1GiB").dram_bytes == 1 << 30


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"node_id": "bad id!"}, "node_id"),
        ({"policy": "mru"}, "policy"),
        ({"ssd_path": "/tmp/x"}, "ssd_bytes"),
        ({"dram_bytes": 0}, "dram_bytes"),
        ({"warm": "perhaps"}, "warm"),
        ({"event_queue": "many"}, "event_queue"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_settings_name_themselves(kw: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        NodeConfig.load(env={}, **kw)


def test_env_is_read_only_in_config() -> None:
    """The one-module rule: no other module reads KVSTORE_ variables."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    reads_env = re.compile(r"os\.environ|getenv\(")
    offenders = [
        str(p.relative_to(root))
        for d in ("kvstore", "engine")
        for p in (root / d).rglob("*.py")
        if p.name != "config.py" and "KVSTORE_" in p.read_text() and reads_env.search(p.read_text())
    ]
    assert offenders == []


def test_metrics_settings() -> None:
    from kvstore.config import ServerConfig, resolve_config

    base = {"allow_anonymous": True}
    assert resolve_config(ServerConfig, env={}, flags=base).metrics_port == -1  # off by default
    env = {"KVSTORE_METRICS_PORT": "9400", "KVSTORE_METRICS_HOST": "0.0.0.0"}
    c = resolve_config(ServerConfig, env=env, flags=base)
    assert (c.metrics_host, c.metrics_port) == ("0.0.0.0", 9400)
    for bad in ({"metrics_port": "-2"}, {"metrics_port": "7400"}, {"metrics_host": " "}):
        with pytest.raises(ConfigError, match="metrics_"):
            resolve_config(ServerConfig, env={}, flags={**base, **bad})
