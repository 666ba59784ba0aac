"""Issue 17, attack 5: one tenant must not compute another tenant's stored keys.

Node-side keys are published to the directory, so they must not follow from public
names. With the tokens file's ``scope_secret``, a tenant's scope key is derived from the
secret, every node derives the same one, and a client learns only its own, from the
INFO reply of a node its token authenticated to. The server-side tests run on the
in-memory network too (tests/support/memory_fixtures.py), in the hermetic run.
"""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest

from kvstore import Namespace, prefix_keys
from kvstore.client.admin import AdminClient
from kvstore.config import ServerConfig
from kvstore.errors import ConfigError
from kvstore.server.auth import TokenTable
from kvstore.tenants import Principal, derive_scope_key
from tests.support.memory_fixtures import Served, over, serving
from tests.support.server_process import (
    ADMIN,
    ALPHA,
    BRAVO,
    SCOPE_SECRET,
    Token,
    principal_of,
    write_tokens,
)

NS = Namespace("scope-model", "uint8:L1:H1:D1")
PROMPT = list(range(1000, 1064))  # a prompt B guesses A has sent: 4 blocks of 16


def _table(tmp_path: Path, tokens: tuple[Token, ...] = (ALPHA, BRAVO), **kw: str) -> TokenTable:
    path = write_tokens(tmp_path / "tokens.toml", tokens, **kw)
    return TokenTable.from_config(ServerConfig(tokens_file=str(path)))


def test_scope_keys_come_from_the_secret_not_the_name(tmp_path: Path) -> None:
    table = _table(tmp_path)
    alpha, bravo = table.authenticate(ALPHA.token), table.authenticate(BRAVO.token)
    key = prefix_keys(PROMPT, 16, NS)[0]
    public = Principal("alpha").scope(key)  # what anyone could compute from the name
    assert alpha.scope(key) != public
    assert alpha.scope_key == derive_scope_key(SCOPE_SECRET.encode(), "alpha")
    assert alpha.scope_key != bravo.scope_key and alpha.scope(key) != bravo.scope(key)
    # A node loading the same file scopes alike; another secret scopes differently.
    (tmp_path / "node2").mkdir()
    again = _table(tmp_path / "node2")
    assert again.authenticate(ALPHA.token).scope(key) == alpha.scope(key)
    other = _table(tmp_path, secret="another-secret-0123456789abcdef-0123456789")
    assert other.authenticate(ALPHA.token).scope(key) != alpha.scope(key)


def test_two_tenants_need_a_secret(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="2 tenants need a scope_secret"):
        _table(tmp_path, secret="")
    with pytest.raises(ConfigError, match="at least 32 bytes"):
        _table(tmp_path, secret="short")
    # One tenant has no one to hide from: as before, scoped by its name.
    solo = _table(tmp_path, (ALPHA,), secret="").authenticate(ALPHA.token)
    assert solo.scope(b"k" * 16) == Principal("alpha").scope(b"k" * 16)
    # auth_token's tenant "default" counts as a tenant beside the file's.
    path = write_tokens(tmp_path / "one.toml", (ALPHA,), secret="")
    cfg = ServerConfig(tokens_file=str(path), auth_token="default-token-0123456789")
    with pytest.raises(ConfigError, match="scope_secret"):
        TokenTable.from_config(cfg)


def test_a_tenant_learns_only_its_own_scope_key(any_server: Served) -> None:
    for token in (ALPHA, BRAVO, ADMIN):
        with any_server.client(token) as c:
            got = base64.b64decode(c.server_info["scope_key"])
        assert got == principal_of(token).scope_key, token.tenant
    with any_server.client(BRAVO) as c:
        info = c.server_info
    assert info["tenant"] == "bravo"
    assert base64.b64decode(info["scope_key"]) != principal_of(ALPHA).scope_key


@pytest.mark.parametrize(("kind", "transport"), over("shm", "tcp"))
def test_b_cannot_compute_where_a_stored_a_prompt(
    request: pytest.FixtureRequest, kind: str, transport: str
) -> None:
    """A stores a prompt; the node holds it under keys B cannot derive from A's name."""
    store_server = serving(request, kind)
    ns = Namespace(f"{NS.model}-{transport or kind}", NS.layout)
    keys = prefix_keys(PROMPT, 16, ns)
    values = [np.full((1, 2, 1, 16, 1), i, dtype=np.uint8) for i in range(len(keys))]
    with store_server.client(ALPHA, namespace=ns, transport=transport) as a:
        assert a.batch_put(keys, values) == [True] * len(keys)
        outs = [np.empty_like(v) for v in values]
        for _ in range(2):  # the second round reads through the published index (shm)
            assert a.batch_get_into(keys, outs) == [True] * len(keys)
            assert all(np.array_equal(o, v) for o, v in zip(outs, values, strict=True))
        if transport == "shm":
            assert a.counters.get("shm_direct_reads") == len(keys)
    with store_server.client(ADMIN) as c:
        stored = {b.key for b in AdminClient(c).scan(1000, tenant="alpha", model=ns.model)}
    assert stored == set(principal_of(ALPHA).scope_all(keys))
    guessed = set(Principal("alpha").scope_all(keys))  # B's best guess from public names
    assert not guessed & stored
