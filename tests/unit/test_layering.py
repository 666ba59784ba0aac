"""The house's rules, read from the source with ast: kvstore never imports engine,
client/ and server/ never import each other, no package imports a layer above it, and no
modules import each other in a cycle (lazy imports inside functions count: they are
dependencies all the same)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvstore"

# Lower layers first; a module may import its own layer and the ones before it.
LAYERS: list[set[str]] = [
    {"errors", "layout", "keys", "blocks", "tier_kinds", "events", "tenants", "config", "_proto"}
    | {"codec"},  # KV compression: torch-free sizes the layout imports, codecs behind a name
    {"faults"},
    {"observe", "shm", "copies"},  # copies: host <-> device, for tiers and client
    {"tiers"},
    {"node", "wire"},
    {"directory"},
    {"client", "server", "procs"},
    {"cli"},
]
RANK = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}
APART = [("client", "server"), ("server", "client")]


# engine/: what each group drives, over the one store protocol; serving composes them.
ENGINE_LAYERS: list[set[str]] = [
    {"blockstore", "registry"},  # what they share: the store, serving records in etcd
    {"hf", "vllm", "planning"},
    {"serving"},
    {"demo"},
]
ENGINE_RANK = {room: i for i, rooms in enumerate(ENGINE_LAYERS) for room in rooms}
ENGINE_APART = [(a, b) for a in ("hf", "vllm", "planning") for b in ("hf", "vllm", "planning")]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {
        module_name(p): p
        for p in package.rglob("*.py")
        if "_proto" not in p.relative_to(ROOT).parts
    }


def _under(module: str, top: str) -> bool:
    return module == top or module.startswith(top + ".")


def imports_of(path: Path, name: str, top: str = "kvstore") -> Iterator[str]:
    """Every module under package ``top`` that ``path`` imports, at any depth of the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if _under(a.name, top))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base]) if base else ".".join(up)
            if not _under(base, top):
                continue
            yield base
            for a in node.names:  # ``from kvstore.cli import admin`` names a module
                yield f"{base}.{a.name}"


def graph(top: str = "kvstore") -> dict[str, set[str]]:
    mods = modules(ROOT / top)
    return {
        name: {m for m in imports_of(path, name, top) if m in mods and m != name}
        for name, path in mods.items()
    }


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_kvstore_never_imports_engine() -> None:
    """The store installs and serves alone; engine commands are named by module path."""
    bad = [
        f"{name} imports {m}"
        for name, path in modules().items()
        for m in imports_of(path, name, top="engine")
    ]
    assert not bad, "\n".join(sorted(bad))


def test_every_extension_names_a_module_that_exists() -> None:
    """The console script's string registry (kvstore/cli/extensions.py) stays true to the
    tree without importing it."""
    from kvstore.cli.extensions import EXTENSIONS

    for ext in EXTENSIONS:
        path = ROOT.joinpath(*ext.module.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), ext
        tree = ast.parse(path.with_suffix(".py").read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert "add_parser" in names, f"{ext.module} defines no add_parser"


def test_client_and_server_never_import_each_other() -> None:
    bad = [
        f"{a} imports {b}"
        for a, deps in graph().items()
        for b in deps
        if (room(a), room(b)) in APART
    ]
    assert not bad, "\n".join(bad)


def test_no_layer_imports_one_above_it() -> None:
    bad = []
    for a, deps in graph().items():
        for b in deps:
            ra, rb = room(a), room(b)
            if ra in RANK and rb in RANK and RANK[rb] > RANK[ra]:
                bad.append(f"{a} ({ra}) imports {b} ({rb})")
    assert not bad, "\n".join(sorted(bad))


def test_every_room_has_a_layer() -> None:
    rooms = {room(m) for m in modules()} - {""}
    assert rooms <= set(RANK), f"rooms without a layer: {sorted(rooms - set(RANK))}"


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycles() -> None:
    # A package's __init__ re-exporting its modules is not a cycle of responsibilities.
    g = {a: {b for b in deps if not a.startswith(b + ".")} for a, deps in graph().items()}
    cycle = find_cycle(g)
    assert cycle is None, " -> ".join(cycle or [])


@pytest.mark.parametrize(
    ("edges", "cyclic"),
    [({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True), ({"a": {"b"}, "b": {"c"}, "c": set()}, False)],
)
def test_the_cycle_finder_finds_cycles(edges: dict[str, set[str]], cyclic: bool) -> None:
    assert (find_cycle(edges) is not None) == cyclic


def test_engine_groups_stand_apart_and_serving_composes_them() -> None:
    """hf/, vllm/ and planning/ never import each other; nothing imports serving/ or
    demo/ from below; every engine module belongs to a group."""
    bad = []
    for a, deps in graph("engine").items():
        ra = room(a)
        assert ra in ENGINE_RANK or ra == "", f"{a}: engine room without a layer"
        for b in deps:
            rb = room(b)
            if ra != rb and (ra, rb) in ENGINE_APART:
                bad.append(f"{a} ({ra}) imports {b} ({rb})")
            elif ra in ENGINE_RANK and rb in ENGINE_RANK and ENGINE_RANK[rb] > ENGINE_RANK[ra]:
                bad.append(f"{a} ({ra}) imports {b} ({rb}), a layer above it")
    assert not bad, "\n".join(sorted(bad))
    cycle = find_cycle(
        {a: {b for b in d if not a.startswith(b + ".")} for a, d in graph("engine").items()}
    )
    assert cycle is None, " -> ".join(cycle or [])
