"""Commands that live outside the store, registered by module path and imported on dispatch.

The store installs and serves alone (``pip install kvstore``); the serving commands need
torch, transformers and an ASGI stack (``pip install 'kvstore[engine]'``). So the console
script names them here as strings and imports a command's module only when that command
runs, the way SGLang's storage backend factory names backends by module path. A command
whose extra is missing fails with one line that names the extra, as httpx does for http2,
instead of a traceback from deep inside an import chain.

kvstore never imports engine (tests/unit/test_layering.py): this table and
:func:`load_attr` are the only doors, and they hold strings, not imports.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kvstore.errors import ConfigError

__all__ = [
    "EXTENSIONS",
    "Extension",
    "MissingExtra",
    "extension_for",
    "load",
    "load_attr",
    "load_extension",
]

# Packages this project ships: a ModuleNotFoundError naming one of them is a bug to show
# as it is, not a missing extra.
_OWN = ("kvstore", "engine")


@dataclass(frozen=True, slots=True)
class Extension:
    """One command registered by name: which module's ``add_parser`` defines it."""

    command: str
    module: str
    help: str
    requires: tuple[str, ...]  # top-level modules the extra brings, checked before import
    extra: str = "engine"


_MODEL = ("torch", "transformers")
_HTTP = ("starlette", "uvicorn", "httpx")
EXTENSIONS: tuple[Extension, ...] = (
    Extension(
        "demo",
        "engine.demo.cli",
        "run the main job: the live serving path on one host",
        (*_MODEL, *_HTTP, "openai"),
    ),
    Extension(
        "worker",
        "engine.serving.cli",
        "run a prefill/decode worker beside a store node",
        (*_MODEL, *_HTTP),
    ),
    Extension(
        "router",
        "engine.serving.cli",
        "run the OpenAI-compatible cache-aware router",
        (*_MODEL, *_HTTP),
    ),
    Extension(
        "vllm-router", "engine.serving.cli", "route between vLLM prefill/decode servers", _HTTP
    ),
    Extension(
        "plan",
        "engine.planning.plan",
        "replay a trace through the scheduler's policies",
        ("matplotlib",),
    ),
)


class MissingExtra(ConfigError):
    """A command's optional dependencies are not installed; the message says which extra."""

    code = "missing_extra"

    def __init__(self, what: str, extra: str, missing: str) -> None:
        super().__init__(
            f"{what} needs the '{extra}' extra ({missing} is not installed): "
            f"pip install 'kvstore[{extra}]'"
        )
        self.extra = extra
        self.missing = missing


def extension_for(command: str | None) -> Extension | None:
    """The registered extension that defines ``command``, if any."""
    return next((e for e in EXTENSIONS if e.command == command), None)


def load_extension(ext: Extension) -> ModuleType:
    """The module that defines ``ext``'s command. Every module its extra brings is looked
    for first, so a missing extra fails the same way whether the command would have
    imported it at once or only when it runs (``--help`` included)."""
    what = f"kvstore {ext.command}"
    for name in ext.requires:
        if importlib.util.find_spec(name) is None:
            raise MissingExtra(what, ext.extra, name)
    return load(ext.module, what=what, extra=ext.extra)


def load(module: str, *, what: str, extra: str = "engine") -> ModuleType:
    """Import ``module``; a missing third-party dependency becomes :class:`MissingExtra`."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if not missing or missing in _OWN:
            raise  # a module of ours is gone: a packaging bug, shown as it is
        raise MissingExtra(what, extra, missing) from exc


def load_attr(target: str, *, what: str, extra: str = "engine") -> Any:
    """``"package.module:name"`` -> the object, imported on first use (see :func:`load`)."""
    module, _, name = target.partition(":")
    return getattr(load(module, what=what, extra=extra), name)
